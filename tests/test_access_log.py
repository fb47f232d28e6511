"""Request ids and the access log.

Fast tests run kvgate in front of the stub upstream of the benchmarks (no inference):
the id's validation, its round trip (client -> kvgate -> server -> client), the line's
fields in both formats, prompts kept out, the access log off, a rotated file. The
`vllm` test joins, for a burst with injected faults, kvgate's access log, what each
client saw, what the fault proxy did to each request and vLLM's own log, by request id.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.server import access_log

from support.access import (
    check_access_log,
    read_access_log,
)
from support.env import PYTHON, free_port, model_dir, vllm_python
from support.fault_proxy import Fault, FaultProxy, post_stream, until
from support.sidecar import Sidecar, released
from support.vllm_server import VllmServer

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens


# ---- units ------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["abc-123", "0f" * 16, "req_1:2/3+4=5@x", "a" * 128,
                                   "{curly}|[square]~!#$%&'()*,;<>?^`"])
def test_a_usable_client_request_id_is_kept(given: str) -> None:
    assert access_log.request_id({"X-Request-Id": given}) == given


@pytest.mark.parametrize("given", ["", "has space", 'quote"', "back\\slash", "a" * 129,
                                   "tab\there", "nul\x00", "é", "line\nbreak"])
def test_an_unusable_client_request_id_is_replaced(given: str) -> None:
    made = access_log.request_id({"X-Request-Id": given})
    assert made != given and re.fullmatch(r"[0-9a-f]{32}", made)
    assert access_log.request_id({}) != access_log.request_id({})


def test_lines_escape_what_needs_it_in_both_formats() -> None:
    fields: list[tuple[str, access_log.Value]] = [
        ("request_id", "r1"), ("route", '/v1/a b"c\n'), ("tenant", None), ("status", 200),
        ("stream", True), ("duration_s", 0.25), ("ttft_s", float("nan")),
    ]
    line = access_log.format_line(fields, "2026-11-30T00:00:00.000Z", "json")
    assert line.endswith("}\n") and line.count("\n") == 1
    assert json.loads(line) == {"time": "2026-11-30T00:00:00.000Z", "request_id": "r1",
                                "route": '/v1/a b"c\n', "tenant": None, "status": 200,
                                "stream": True, "duration_s": 0.25, "ttft_s": None}
    kv = access_log.format_line(fields, "2026-11-30T00:00:00.000Z", "kv")
    assert kv == ('time=2026-11-30T00:00:00.000Z request_id=r1 route="/v1/a b\\"c\\n" '
                  "tenant=- status=200 stream=true duration_s=0.250000 ttft_s=-\n")


def test_process_log_lines_about_a_request_carry_its_id() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(access_log.RequestIdFormatter(access_log.LOG_FORMAT))
    handler.addFilter(access_log.RequestIdFilter())
    logger = logging.getLogger("kvgate.test-access")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("outside any request")
        token = access_log.REQUEST_ID.set("rid-7")
        logger.warning("inside one")
        logger.warning("names its own id", extra={"request_id": None})
        access_log.REQUEST_ID.reset(token)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert not lines[0].endswith("request_id=rid-7")
    assert lines[1].endswith("inside one request_id=rid-7")
    assert lines[2].endswith("names its own id")


def test_a_rotated_file_is_reopened(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    log = access_log.AccessLog(str(path))
    log.start()
    try:
        entry = access_log.RequestRecord("one", "GET", "/v1/models")
        log.finish(entry, None, cancelled=True)
        deadline = time.monotonic() + 5
        while not path.exists() or b"one" not in path.read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        path.rename(tmp_path / "access.log.1")
        time.sleep(access_log.REOPEN_CHECK_S + 0.1)
        log.finish(access_log.RequestRecord("two", "GET", "/v1/models"), None, cancelled=True)
    finally:
        log.close()
    assert [line["request_id"] for line in read_access_log(path)] == ["two"]
    first = read_access_log(tmp_path / "access.log.1")
    assert [line["request_id"] for line in first] == ["one"]
    assert first[0]["end"] == "client_gone" and first[0]["status"] == 499
    assert list(first[0]) == list(access_log.FIELDS)


def test_an_unwritable_access_log_fails_at_start(tmp_path: Path) -> None:
    completed = subprocess.run(
        [PYTHON, "-m", "sidecar", "serve", "--upstream", "http://127.0.0.1:9",
         "--access-log", str(tmp_path / "missing" / "access.log")],
        capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 2, completed.stderr
    assert "--access-log" in completed.stderr and "cannot open" in completed.stderr
    assert "Traceback" not in completed.stderr


# ---- against the stub upstream ---------------------------------------------------------------


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([PYTHON, str(ROOT / "bench" / "stub_upstream.py"), "--port",
                             str(port), "--max-model-len", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "stub upstream did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def stubbed(stub: str, *args: str) -> Sidecar:
    return Sidecar(stub, "--model-config", "Qwen/Qwen3-0.6B", *args)


async def test_ids_round_trip_and_every_request_has_one_line(stub: str) -> None:
    marker = "PROMPT-MARKER-access-log"
    with stubbed(stub) as gated:
        url = gated.url + "/v1/completions"
        async with aiohttp.ClientSession() as session:
            given = await post_stream(session, url, {"model": "m", "prompt": marker,
                                                     "max_tokens": 4, "stream": True},
                                      headers={"x-request-id": "client-chose-this",
                                               "x-kvgate-tenant": "acme",
                                               "x-kvgate-priority": "high"})
            replaced = await post_stream(session, url, {"model": "m", "prompt": marker,
                                                        "max_tokens": 4},
                                         headers={"x-request-id": "not usable"})
            bad = await post_stream(session, url, {"prompt": marker, "max_tokens": "x"})
            async with session.get(gated.url + "/v1/models",
                                   headers={"x-request-id": "models-1"}) as models:
                assert models.headers["X-Request-Id"] == "models-1"
            async with session.get(gated.url + "/healthz") as health:
                assert re.fullmatch(r"[0-9a-f]{32}", health.headers["X-Request-Id"])
        await until(lambda: released(gated), 10, "released")
        assert header(given, "x-request-id") == "client-chose-this"
        assert header(replaced, "x-request-id") not in (None, "not usable")
        for result in (bad,):  # kvgate's own answers carry it too
            assert header(result, "x-request-id") == result.request_id
        lines = check_access_log(gated.access_log or "", _sent_to(gated))
    by_id = {line["request_id"]: line for line in lines}
    line = by_id["client-chose-this"]
    assert line["route"] == "/v1/completions" and line["method"] == "POST"
    assert (line["tenant"], line["priority"], line["outcome"], line["status"], line["end"]) \
        == ("acme", 0, "admitted", 200, "done")
    assert line["stream"] is True and line["output_tokens"] == 4
    assert line["prompt_tokens"] > 0 and line["kv_blocks"] >= 1
    assert 0 < line["ttft_s"] <= line["duration_s"]
    assert line["predicted_ttft_s"] > 0 and line["predicted_tpot_s"] > 0
    assert line["queue_wait_s"] == 0 and line["upstream_error"] is None
    assert by_id[replaced.request_id]["stream"] is False
    assert by_id[bad.request_id]["outcome"] == "invalid"
    assert by_id[bad.request_id]["status"] == 400 and by_id[bad.request_id]["end"] == "rejected"
    assert by_id["models-1"]["outcome"] == "proxied"
    # One line per proxied request, none for kvgate's own routes (/healthz, /readyz, ...).
    assert len(lines) == 4
    assert all(marker not in json.dumps(line) for line in lines)
    assert marker not in gated.log_text()


def header(result: Any, name: str) -> str | None:
    found = {key.lower(): value for key, value in result.headers.items()}.get(name)
    return None if found is None else str(found)


def _sent_to(sidecar: Sidecar) -> list[Any]:
    from support.access import SENT

    return [view for view in SENT if view.url.startswith(sidecar.url + "/")]


async def test_key_value_lines_on_stdout(stub: str) -> None:
    with stubbed(stub, "--access-log", "stdout", "--access-log-format", "kv") as gated:
        async with aiohttp.ClientSession() as session:
            result = await post_stream(session, gated.url + "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}, headers={"x-request-id": "kv-1"})
        assert result.status == 200
        await until(lambda: "request_id=kv-1 " in gated.log_text(), 5, "the line")
    line = next(li for li in gated.log_text().splitlines() if "request_id=kv-1 " in li)
    assert line.startswith("time=20")
    assert " route=/v1/chat/completions " in line and " outcome=admitted " in line
    assert " end=done " in line and " status=200 " in line and " ttft_s=- " in line


async def test_access_log_off_writes_nothing_but_still_warns(stub: str) -> None:
    # The stub cannot be stalled or cut: a server that is not there stands in for
    # an abnormal end (its connection refused: upstream_cut).
    with stubbed(stub, "--access-log", "off") as gated:
        async with aiohttp.ClientSession() as session:
            served = await post_stream(session, gated.url + "/v1/completions",
                                       {"prompt": "x", "max_tokens": 2},
                                       headers={"x-request-id": "off-1"})
            assert served.status == 200
    assert '"request_id"' not in gated.log_text() and "request_id=off-1" not in gated.log_text()
    port = free_port()
    refused = Sidecar(f"http://127.0.0.1:{port}", "--model-config", "Qwen/Qwen3-0.6B",
                      "--access-log", "off")
    refused.start(wait_ready=False)
    try:
        await until(lambda: refused.get("/healthz")[0] == 200, 30, "alive")
        async with aiohttp.ClientSession() as session, session.get(
                refused.url + "/v1/models", headers={"x-request-id": "off-2"}) as models:
            assert models.status == 503
        await until(lambda: "request off-2 ended abnormally" in refused.log_text(), 5, "warning")
    finally:
        refused.stop()
    warning = next(li for li in refused.log_text().splitlines() if "request off-2" in li)
    assert " WARNING " in warning and "end=upstream_cut" in warning
    assert "upstream_error=connect" in warning and "status=503" in warning


# ---- against a real vLLM, with faults: the join by request id -----------------------------


def vllm_lines(server: VllmServer, request_id: str) -> list[str]:
    """vLLM's own log lines about a request (its ids are cmpl-<id>-<n>[-<random>])."""
    pattern = re.compile(rf"\bcmpl-{re.escape(request_id)}\b")
    return [line for line in server.log_text().splitlines() if pattern.search(line)]


@pytest.mark.vllm
async def test_a_burst_with_faults_joins_across_client_kvgate_and_vllm() -> None:
    server = VllmServer(vllm_python(), str(model_dir("tiny-llama")), "tiny-llama", free_port(),
                        max_model_len=1024, block_size=32, num_gpu_blocks_override=64,
                        extra_args=["--enable-log-requests"])
    server.start()
    try:
        with FaultProxy(server.url) as proxy:
            gated = Sidecar(proxy.url, "--read-timeout-s", "5", "--queue-max-wait-s", "60",
                            "--metrics-interval-s", "0.5")
            try:
                gated.start()
                faults = [
                    Fault(path="/v1/completions", cut_after_bytes=1500, times=2, name="cut"),
                    Fault(path="/v1/completions", stall_after_bytes=800, times=1, name="stall"),
                    Fault(path="/v1/completions", cut_after_bytes=0, times=1, name="reset"),
                    Fault(path="/v1/completions", status=500, times=1, name="error"),
                ]
                proxy.set_faults(*faults)
                results = await _burst(gated)
                proxy.release_stalls()
                await until(lambda: released(gated), 30, "released")
            finally:
                proxy.release_stalls()
                exit_code = gated.stop()
            seen = {header(s, "x-request-id"): s for s in proxy.requests("/v1/completions")}
            applied = dict(proxy.counts)
        assert exit_code == 0
    finally:
        server.stop()
    # 1. One access-log line per request, telling what its client saw.
    lines = check_access_log(gated.access_log or "", _sent_to(gated))
    by_id = {line["request_id"]: line for line in lines}
    assert len(lines) == len(results)
    kvgate_log = gated.log_text()
    ends: dict[str, int] = {}
    for result in results:
        rid = result.request_id
        line = by_id[rid]
        ends[line["end"]] = ends.get(line["end"], 0) + 1
        assert header(result, "x-request-id") == rid
        # 2. What the fault proxy did to it agrees with how kvgate says it ended.
        hop = seen.get(rid)
        expected = {None: {"done"}, "cut": {"upstream_cut"}, "stall": {"timeout"},
                    "reset": {"upstream_cut"}, "error": {"done"}}
        if not line["stream"]:
            # A whole answer comes at the end: shorter than where the fault cuts or
            # stalls, it passes whole; later than --read-timeout-s on a busy machine,
            # kvgate answers 504 before the fault has anything to cut.
            expected = {fault: ends | {"done", "timeout"} for fault, ends in expected.items()
                        if fault not in ("reset", "error")} | {
                "reset": {"upstream_cut"}, "error": {"done"}}
        if hop is None:
            assert line["outcome"] in ("never_fits", "invalid"), line
            assert line["end"] == "rejected"
        else:
            assert line["end"] in expected[hop.fault], (hop.fault, line)
            if hop.fault == "error":
                assert line["status"] == 500 and line["upstream_error"] == "status"
        # 3. vLLM's log names the same id: the requests it received, by kvgate's id.
        mentioned = vllm_lines(server, rid)
        if hop is not None and hop.forwarded and line["status"] == 200:
            assert any("Received request" in m for m in mentioned), (rid, hop.fault)
            if line["end"] == "done" and line["stream"] is False:
                assert result.body["id"] == f"cmpl-{rid}"  # vLLM's id is kvgate's
        if hop is None or not hop.forwarded:
            assert not mentioned, (rid, mentioned)
        if any(" aborted." in m for m in mentioned):  # vLLM dropped it: kvgate says why
            assert line["end"] in ("upstream_cut", "timeout", "client_gone"), line
        # 4. Abnormal ends are in kvgate's process log with the id.
        abnormal = f"request {rid} ended abnormally"
        assert (abnormal in kvgate_log) is (line["end"] in ("upstream_cut", "timeout")
                                            or line["upstream_error"] == "status"), rid
    assert sum(applied.values()) == 5, applied  # every fault was injected
    assert ends.get("upstream_cut", 0) >= 1 and ends.get("done", 0) >= 8, ends
    # Not checked: how many of the streams the fault proxy cut vLLM still had to finish
    # (and so aborted; each abort is checked above against kvgate's line). That is the
    # machine's timing, not kvgate's: a busy API server streams behind its engine, which
    # may have finished all of them before the cuts reached it.


async def _burst(gated: Sidecar) -> list[Any]:
    """16 requests at once: streamed and whole, one that never fits, one invalid."""
    url = gated.url + "/v1/completions"
    bodies: list[dict[str, Any]] = []
    for index in range(14):
        stream = index % 3 != 0
        bodies.append({"model": "tiny-llama", "prompt": PROMPT, "ignore_eos": True,
                       # Streams long enough that vLLM is still generating when a fault
                       # cuts them, however busy the machine.
                       "max_tokens": 400 if stream else 60, "stream": stream,
                       "temperature": 0})
    # Never fits: 4 sequences of up to 1,024 tokens need 128 blocks of the 59 kvgate gives.
    bodies.append({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 5000, "n": 4,
                   "temperature": 1.0})
    bodies.append({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": -1})
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(post_stream(session, url, body) for body in bodies)))

