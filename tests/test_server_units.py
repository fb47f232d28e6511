"""Request parsing, steering headers, token counting and settings, without a server."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.server.client_headers import parse_priority, parse_steering, parse_tenant
from sidecar.server.prefix_keys import shares_prompt_blocks
from sidecar.server.requests import (
    BadRequest,
    estimate_tokens,
    parse_body,
    parse_generation,
)
from sidecar.server.settings import SettingsError, load_settings
from sidecar.server.token_stream import TokenCounter


def gen(route: str, body: dict[str, object]):  # type: ignore[no-untyped-def]
    return parse_generation(route, body)


def test_chat_reads_max_tokens_n_and_builds_a_tokenize_payload() -> None:
    request = gen("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 12, "n": 3, "stream": True, "user": "alice",
        "tools": [{"type": "function"}], "unknown_field": 1,
    })
    assert (request.max_tokens, request.sequences, request.stream, request.user) == (
        12, 3, True, "alice")
    payload = request.tokenize_payloads[0]
    assert payload["messages"][0]["content"] == "hi" and payload["tools"]
    assert payload["add_generation_prompt"] is True and payload["model"] == "m"


def test_completions_defaults_and_batches() -> None:
    single = gen("/v1/completions", {"prompt": "hello"})
    assert single.max_tokens == 16  # vLLM's default for /v1/completions
    unlimited = gen("/v1/completions", {"prompt": "hello", "max_tokens": None})
    assert unlimited.max_tokens is None
    batch = gen("/v1/completions", {"prompt": ["a", "b"], "best_of": 3, "n": 2})
    assert batch.prompts == 2 and batch.sequences == 2  # vLLM ignores best_of
    ids = gen("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]]})
    assert ids.token_counts == (3, 2) and not ids.tokenize_payloads


@pytest.mark.parametrize(("route", "body", "shares"), [
    ("/v1/completions", {"prompt": "x", "n": 4}, True),
    ("/v1/completions", {"prompt": ["x", "y"], "n": 2}, False),  # a batch: not tracked
    ("/v1/completions", {"prompt": "x", "n": 4, "prompt_logprobs": 0}, False),
    ("/v1/completions", {"prompt": "x", "n": 4, "echo": True, "logprobs": 1}, False),
    ("/v1/completions", {"prompt": "x", "n": 4, "echo": True}, True),  # no logprobs
    ("/v1/completions", {"prompt": "x", "n": 4, "echo": "true", "logprobs": 0}, False),
    ("/v1/completions", {"prompt": "x", "n": 4, "echo": False, "logprobs": 1}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "echo": True}, False),  # top_logprobs defaults to 0
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "echo": True, "top_logprobs": None}, False),  # null: 0
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "n": 2, "logprobs": True, "top_logprobs": 3}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, False),
])
def test_which_requests_share_their_prompt_blocks(route: str, body: dict[str, Any],
                                                  shares: bool) -> None:
    """As vLLM 0.32 reads its prefix cache: never for a request that returns its
    prompt's logprobs (`SamplingParams.skip_reading_prefix_cache`)."""
    assert shares_prompt_blocks(body, gen(route, body)) is shares


def test_responses_and_anthropic_messages() -> None:
    responses = gen("/v1/responses", {"input": "hi", "instructions": "be brief",
                                      "max_output_tokens": 5})
    assert responses.max_tokens == 5
    assert [m["role"] for m in responses.tokenize_payloads[0]["messages"]] == ["system", "user"]
    anthropic = gen("/v1/messages", {"system": "s", "max_tokens": 7, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "metadata": {"user_id": "u1"}})
    assert anthropic.max_tokens == 7 and anthropic.user == "u1"
    assert anthropic.tokenize_payloads[0]["messages"][1]["content"] == "hello"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": "ten"},
         "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": -1},
         "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": True},
         "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "n": 1000}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": ["x"] * 65}, "prompt"),
        ("/v1/responses", {"input": 3}, "input"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "model": 3}, "model"),
    ],
)
def test_bad_fields_are_named(route: str, body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as error:
        gen(route, body)
    assert error.value.param == param
    assert param.split("[", maxsplit=1)[0] in str(error.value)


@pytest.mark.parametrize("raw", [b"{not json", b"[1,2]", b"\xff\xfe", b"", b"null"])
def test_malformed_bodies(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="JSON"):
        parse_body(raw)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c),
                    max_leaves=20))
def test_parsing_never_crashes_on_arbitrary_json(value: object) -> None:
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        for body in (value, {"messages": value, "prompt": value, "input": value,
                             "max_tokens": value, "n": value}):
            try:
                parsed = parse_generation(route, parse_body(json.dumps(body).encode()))
            except BadRequest:
                continue
            assert parsed.sequences >= 1 and parsed.prompts >= 1
            assert parsed.max_tokens is None or parsed.max_tokens >= 1


def test_fallback_estimate_over_counts() -> None:
    assert estimate_tokens(["a" * 300], 0) == 101
    assert estimate_tokens(["hi", "there"], 2) == 3 + 16 + 1


@pytest.mark.parametrize("value", ["urgent", "-1", "99", "1e3", "0x1", " ", "high\r\nx: y"])
def test_absurd_priorities_are_rejected(value: str) -> None:
    with pytest.raises(BadRequest, match="x-kvgate-priority"):
        parse_priority(value, 3)


def test_priority_classes_and_numbers() -> None:
    assert [parse_priority(v, 3) for v in ("high", "NORMAL", "low", "0", "2", None)] == [
        0, 1, 2, 0, 2, 1]
    assert parse_priority("low", 1) == 0


@pytest.mark.parametrize("tenant", ["a b", "x" * 129, "evil\ninjected", "", "ümlaut",
                                    "alice\n", "x" * 128 + "\n"])
def test_tenant_injection_and_length(tenant: str) -> None:
    with pytest.raises(BadRequest, match="tenant|user"):
        parse_tenant(tenant, None)


def test_steering_header_beats_body_user() -> None:
    steering = parse_steering({"x-kvgate-tenant": "team-a", "x-kvgate-ttft-slo-ms": "250"},
                              "bob", 3)
    assert (steering.tenant, steering.ttft_slo_s) == ("team-a", 0.25)
    assert parse_steering({}, "bob", 3).tenant == "bob"
    with pytest.raises(BadRequest, match="x-kvgate-ttft-slo-ms"):
        parse_steering({"x-kvgate-ttft-slo-ms": "-5"}, None, 3)


def test_sse_token_counting_across_chunk_boundaries() -> None:
    events = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n' for _ in range(7))
    events += b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n'
    counter = TokenCounter(stream=True, sequences=1)
    for i in range(0, len(events), 5):
        counter.feed(events[i:i + 5])
    assert counter.events == 7 and counter.tokens == 7
    assert counter.usage_tokens == 7


def _events_by_payload(stream: bytes) -> tuple[int, int | None]:
    """What a stream's `data:` lines say, read one payload at a time (the reference)."""
    events, usage_tokens = 0, None
    for line in stream.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        usage = re.search(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)', payload)
        if (b'"usage"' in payload and usage is not None
                and b'"choices":[]' in payload.replace(b" ", b"")):
            usage_tokens = int(usage.group(1))
        elif b'"delta"' in payload or b'"choices"' in payload:
            events += 1
    return events, usage_tokens


_SSE_LINES = [
    b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}',
    b'data:{"choices":[{"text":"y"}]}',
    b"data: \t{\"choices\": [], \"usage\": {\"completion_tokens\": 12}} \r",
    b'data: {"choices":[],"usage":{"output_tokens":5}}',
    b'data: {"choices":[{"delta":{}}],"usage":{"completion_tokens":3}}',
    b'data: {"usage": null, "choices": [{"delta": {"content": "\\"usage\\""}}]}',
    b"data: [DONE]", b"data:", b"data:   ", b": a comment", b"event: message", b"",
    b'{"choices":[{"delta":{}}]}', b"data: {}",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_SSE_LINES), max_size=30),
       st.lists(st.integers(1, 40), min_size=1, max_size=10))
def test_stream_tokens_are_counted_as_each_payload_says(lines: list[bytes],
                                                        cuts: list[int]) -> None:
    stream = b"".join(line + b"\n" for line in lines)
    counter = TokenCounter(stream=True, sequences=1)
    at, turn = 0, 0
    while at < len(stream):  # fed in pieces cut anywhere
        size = cuts[turn % len(cuts)]
        counter.feed(stream[at:at + size])
        at, turn = at + size, turn + 1
    assert (counter.events, counter.usage_tokens) == _events_by_payload(stream)


def test_non_stream_usage_from_the_body_tail() -> None:
    counter = TokenCounter(stream=False, sequences=2)
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 40}})
    counter.feed(body.encode())
    counter.finish()
    assert counter.tokens == 20


def test_settings_precedence_and_errors(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("upstream: http://file:1\nport: 9000\nqueue_max_length: 5\n"
                      "model_config: Qwen/Qwen3-8B\n")
    settings = load_settings({"port": "9100"}, {"KVGATE_QUEUE_MAX_LENGTH": "7",
                                                "KVGATE_GATEWAY_METRICS": "true"},
                             str(config))
    assert settings.upstream == "http://file:1" and settings.port == 9100
    assert settings.queue_max_length == 7 and settings.gateway_metrics
    assert settings.model == "Qwen/Qwen3-8B"
    with pytest.raises(SettingsError) as error:
        load_settings({"port": "70000", "mode": "yolo"}, {"KVGATE_KV_TARGET_RATIO": "2"}, None)
    lines = error.value.lines
    assert any(line.startswith("--upstream: is required") for line in lines)
    assert any(line.startswith("--port:") and "70000" in line for line in lines)
    assert any(line.startswith("KVGATE_KV_TARGET_RATIO:") for line in lines)
    assert len(lines) == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstream: http://x:1\nportt: 1\n")
    with pytest.raises(SettingsError, match="unknown setting 'portt'"):
        load_settings({}, {}, str(bad))


def test_settings_errors_name_the_setting_wherever_it_came_from(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.yaml"
    config.write_text("upstream: http://127.0.0.1:1\nport: 99999\nmode: Shadow\n")
    with pytest.raises(SettingsError) as error:
        load_settings({}, {}, str(config))
    assert sorted(error.value.lines) == [
        f"--config {config}: mode: Input should be 'enforce' or 'shadow' (got 'Shadow')",
        f"--config {config}: port: Input should be less than or equal to 65535 (got 99999)"]
    # A boolean's misspelling is an error, not "off".
    with pytest.raises(SettingsError, match=r"KVGATE_CALIBRATE: must be one of .* \(got 'ture'\)"):
        load_settings({"upstream": "http://x:1"}, {"KVGATE_CALIBRATE": "ture"}, None)
    # ... reported beside every other problem, not instead of them.
    with pytest.raises(SettingsError) as error:
        load_settings({"upstream": "http://x:1"}, {"KVGATE_CALIBRATE": "ture",
                                                   "KVGATE_PORT": "0"}, None)
    assert [line.split(":")[0] for line in error.value.lines] == ["KVGATE_CALIBRATE",
                                                                  "KVGATE_PORT"]
    for word, value in (("off", False), ("No", False), ("1", True), ("on", True)):
        settings = load_settings({"upstream": "http://x:1"}, {"KVGATE_CALIBRATE": word}, None)
        assert settings.calibrate is value
    # The upstream's port.
    for bad in ("http://x:99999", "http://x:abc", "http://x:0", "http://[::1]:0", "http://x:"):
        with pytest.raises(SettingsError, match="--upstream: must have a port from 1"):
            load_settings({"upstream": bad}, {}, None)
    for good in ("http://x", "http://[::1]:8000", "https://x:8443/", "http://u:p@x"):
        assert load_settings({"upstream": good}, {}, None).upstream == good.rstrip("/")
    # Figures that go stale before the next scrape.
    with pytest.raises(SettingsError, match="--metrics-stale-s .* must be longer than"):
        load_settings({"upstream": "http://x:1", "metrics_interval_s": "30"}, {}, None)
    assert load_settings({"upstream": "http://x:1", "metrics_interval_s": "30",
                          "metrics_stale_s": "90"}, {}, None).metrics_stale_s == 90
    # One port for both listeners.
    with pytest.raises(SettingsError, match="--admin-port must differ from --port"):
        load_settings({"upstream": "http://x:1", "port": "9000", "admin_port": "9000"}, {}, None)
    # No starvation bound, from a flag or the environment as from YAML's null.
    for raw in ("none", "off"):
        assert load_settings({"upstream": "http://x:1", "starvation_bound_s": raw}, {},
                             None).starvation_bound_s is None
        assert load_settings({"upstream": "http://x:1"}, {"KVGATE_STARVATION_BOUND_S": raw},
                             None).starvation_bound_s is None
    unbounded = tmp_path / "unbounded.yaml"
    unbounded.write_text("upstream: http://x:1\nstarvation_bound_s: off\n")  # YAML: false
    assert load_settings({}, {}, str(unbounded)).starvation_bound_s is None


def test_a_port_in_use_is_named_by_its_flag() -> None:
    with socket.socket() as busy, socket.socket() as spare:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        spare.bind(("127.0.0.1", 0))  # free once closed: --port beside a busy --admin-port
        port, free = busy.getsockname()[1], spare.getsockname()[1]
        spare.close()
        for flags, named in ((["--port", str(port)], "--port"),
                             (["--port", str(free), "--admin-port", str(port)], "--admin-port")):
            proc = subprocess.run(
                [sys.executable, "-m", "sidecar", "serve", "--upstream", "http://127.0.0.1:9",
                 "--host", "127.0.0.1", *flags],
                capture_output=True, text=True, timeout=60, check=False)
            assert proc.returncode == 2, proc.stderr
            assert f"cannot listen on 127.0.0.1:{port} ({named})" in proc.stderr, proc.stderr


def test_serve_reports_every_bad_setting_on_its_own_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--upstream", "ftp://x", "--port", "0",
         "--admin-token", "short"],
        capture_output=True, text=True, timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "KVGATE_QUEUE_MAX_WAIT_S": "-1"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("kvgate serve: error: ") for line in lines)
    assert "Traceback" not in proc.stderr
    for text in ("--upstream", "--port", "--admin-token", "KVGATE_QUEUE_MAX_WAIT_S"):
        assert any(text in line for line in lines)


def test_serve_unknown_model_and_gpu_fail_fast() -> None:
    for args, message in ((["--model-config", "/nonexistent"], "--model-config: "),
                          (["--tokenizer", "/nonexistent"], "--tokenizer: /nonexistent"),
                          (["--gpu", "Z1"], "unknown GPU")):
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar", "serve", "--upstream", "http://127.0.0.1:9",
             "--port", "19999", *args],
            capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_serve_help_documents_flags_and_env() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--help"],
                          capture_output=True, text=True, timeout=60, check=True)
    for text in ("--upstream", "--model-config", "KVGATE_MODEL_CONFIG", "--mode", "--gpu",
                 "--admin-port", "--drain-timeout-s", "/readyz"):
        assert text in proc.stdout


def test_a_server_that_computed_nothing_since_the_last_scrape_is_idle() -> None:
    from sidecar.server.services import server_idle
    from sidecar.upstream import UpstreamView
    from sidecar.upstream.server_metrics import ServerMetrics

    def metrics(prompt: float | None, generated: float | None) -> ServerMetrics:
        # vLLM's gauges keep its last step's values while it runs no step.
        return ServerMetrics(kv_usage_ratio=0.8, running=3, prompt_tokens_total=prompt,
                             generation_tokens_total=generated)

    busy = UpstreamView(up=True, metrics=metrics(100, 50), previous_metrics=metrics(100, 40))
    idle = UpstreamView(up=True, metrics=metrics(100, 50), previous_metrics=metrics(100, 50))
    unknown = UpstreamView(up=True, metrics=metrics(None, None),
                           previous_metrics=metrics(None, None))
    first = UpstreamView(up=True, metrics=metrics(100, 50))
    assert server_idle(idle)
    assert not server_idle(busy) and not server_idle(unknown) and not server_idle(first)


def test_idle_upstream_connections_are_closed_before_the_server_closes_them() -> None:
    """vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a pooled
    connection kept longer can carry a request just as the server closes it, and the
    request fails. kvgate's pool lets idle connections go first (--upstream-keepalive-s),
    so the next burst opens fresh ones."""
    import asyncio

    from aiohttp import web

    from sidecar.server.app import upstream_session

    settings = load_settings({"upstream": "http://127.0.0.1:1"}, {}, None)
    assert settings.upstream_keepalive_s < 5.0  # vLLM's default keep-alive
    quick = load_settings({"upstream": "http://127.0.0.1:1", "upstream_keepalive_s": "0.3"},
                          {}, None)

    async def scenario() -> None:
        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/ok", ok)
        runner = web.AppRunner(app, keepalive_timeout=30.0)  # a patient server
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with upstream_session(quick) as session:
                await asyncio.gather(*(session.get(f"http://127.0.0.1:{port}/ok")
                                       for _ in range(4)))
                connector = session.connector
                assert connector is not None
                assert sum(len(c) for c in connector._conns.values()) >= 1  # pooled
                await asyncio.sleep(1.2)  # aiohttp sweeps idle connections every second
                assert sum(len(c) for c in connector._conns.values()) == 0
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_only_kvgate_s_request_id_and_no_steering_go_upstream() -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    from sidecar.server.access_log import RequestRecord
    from sidecar.server.proxy import _NOT_FORWARDED, _forward_headers

    client = CIMultiDictProxy(CIMultiDict([
        ("X-Request-Id", "the client's"), ("X-Data-Parallel-Rank", "3"),
        ("X-Kvgate-Tenant", "team-a"), ("X-Kvgate-Priority", "1"), ("Accept", "a"),
        ("accept", "b"), ("Connection", "keep-alive"), ("Content-Length", "2")]))
    sent = RequestRecord("kv-1", "POST", "/v1/completions").upstream_headers(
        _forward_headers(client, _NOT_FORWARDED))
    assert sent == [("Accept", "a"), ("accept", "b"), ("X-Request-Id", "kv-1")]


def test_headers_the_connection_header_names_go_no_further() -> None:
    from multidict import CIMultiDict, CIMultiDictProxy

    from sidecar.server.proxy import _NOT_FORWARDED, _forward_headers, _response_headers

    # RFC 9110, 7.6.1: each header a Connection header names is for this hop only.
    client = CIMultiDictProxy(CIMultiDict([
        ("Connection", "keep-alive, X-Hop"), ("connection", " X-Other ,"),
        ("X-Hop", "1"), ("x-other", "2"), ("Authorization", "Bearer t"), ("X-Kept", "3")]))
    assert _forward_headers(client, _NOT_FORWARDED) == [("Authorization", "Bearer t"),
                                                        ("X-Kept", "3")]
    upstream = CIMultiDict([
        ("Content-Type", "text/plain"), ("Connection", "X-Hop"), ("X-Hop", "1"),
        ("Content-Length", "31"), ("Keep-Alive", "timeout=5")])
    assert _response_headers(upstream, None) == [("Content-Type", "text/plain")]
    # A HEAD's answer keeps the length of the body its GET would have.
    assert _response_headers(upstream, None, head=True) == [
        ("Content-Type", "text/plain"), ("Content-Length", "31")]
    upstream["Content-Length"] = "31, 31"  # not one plain length: not passed on
    assert _response_headers(upstream, None, head=True) == [("Content-Type", "text/plain")]
    # kvgate's own request id goes to the server whatever a client's Connection names.
    from sidecar.server.access_log import RequestRecord
    naming = CIMultiDictProxy(CIMultiDict([
        ("Connection", "X-Request-Id, X-Data-Parallel-Rank"), ("X-Request-Id", "mine")]))
    assert RequestRecord("kv-1", "POST", "/v1/completions").upstream_headers(
        _forward_headers(naming, _NOT_FORWARDED)) == [("X-Request-Id", "kv-1")]


@pytest.mark.pure_python  # a stand-in for Services
def test_an_upstream_failure_is_counted_by_what_the_server_did() -> None:
    """Refused or reset: 503, kind connect; an answer that is not HTTP: 502, kind
    protocol (a server speaking something else, not one that is down)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from sidecar.metrics import SidecarMetrics
    from sidecar.server.proxy import _upstream_failed
    from sidecar.upstream.forward_errors import ForwardError, UpstreamProtocolError

    registry = CollectorRegistry()
    services = SimpleNamespace(metrics=SidecarMetrics(registry, lambda: None),  # type: ignore[arg-type, return-value]
                               watcher=None, settings=SimpleNamespace(read_timeout_s=600.0))
    answers = {kind: _upstream_failed(services, error).status  # type: ignore[arg-type]
               for kind, error in (("protocol", UpstreamProtocolError("HTTP/9")),
                                   ("connect", ForwardError("reset")))}
    assert answers == {"protocol": 502, "connect": 503}
    for kind in ("protocol", "connect"):
        assert registry.get_sample_value("kvgate_upstream_errors_total", {"kind": kind}) == 1
