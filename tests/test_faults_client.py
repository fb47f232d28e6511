"""Client faults, against a real vLLM CPU server: clients that leave while queued,
while waiting for the first token or mid-stream; slow readers; thousands of idle
connections; bodies over the limit; bad input of every kind (each a 4xx naming the
field, none reaching vLLM when it cannot succeed); n reserved for (best_of, which
vLLM ignores, is not); unknown fields passed through.

A `FaultProxy` sits between kvgate and vLLM, here only to record what reached the
server (and, for one test, to delay it)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from support.access import access_log_checked  # noqa: F401 (autouse: every request logged once)
from support.fault_proxy import (
    Fault,
    FaultProxy,
    post_stream,
    process_figures,
    tcp_queues,
    until,
)
from support.sidecar import Sidecar, generated_on, released, running_on
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens
BODY_LIMIT = 100_000
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def completion(max_tokens: int, *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True, "temperature": 0, **extra}




@pytest.fixture
def gated(proxy: FaultProxy) -> Iterator[Sidecar]:
    with Sidecar(proxy.url, "--max-body-bytes", str(BODY_LIMIT), "--queue-max-wait-s", "60",
                 "--metrics-interval-s", "0.5") as running:
        yield running


async def test_client_leaves_while_queued(
    small_kv_vllm: VllmServer, proxy: FaultProxy, gated: Sidecar
) -> None:
    started = time.monotonic()
    cancelled_before = gated.metric("kvgate_requests_total", 'outcome="cancelled"')
    url = gated.url + "/v1/completions"
    # The first stream stalls (at the proxy) and so holds its ~31 of the 59 blocks
    # kvgate admits for as long as the test needs: a second such request has to wait.
    proxy.set_faults(Fault(path="/v1/completions", stall_after_bytes=2000, times=1))
    async with aiohttp.ClientSession() as session:
        streaming = asyncio.Event()

        async def on_event(n: int) -> None:
            streaming.set()

        first = asyncio.create_task(post_stream(session, url, completion(900),
                                                on_event=on_event))
        await asyncio.wait_for(streaming.wait(), 60)
        second = asyncio.create_task(post_stream(session, url, completion(
            900, prompt="another " + PROMPT)))  # no prompt block in common with the first
        await until(lambda: gated.state()["admission"]["queue"]["length"] == 1, 10, "queued")
        second.cancel()  # the client goes away while queued
        with pytest.raises(asyncio.CancelledError):
            await second
        await until(lambda: gated.state()["admission"]["queue"]["length"] == 0, 5, "dequeued")
        assert gated.metric("kvgate_requests_total", 'outcome="cancelled"') == (
            cancelled_before + 1)
        # Only the first request ever reached the server.
        assert len(proxy.requests("/v1/completions", since=started)) == 1
        assert gated.state()["admission"]["inflight"] == 1
        first.cancel()  # and the first one leaves mid-stream
        with pytest.raises(asyncio.CancelledError):
            await first
    await until(lambda: released(gated), 10, "reservations released")
    await until(lambda: running_on(small_kv_vllm) == 0, 20, "vLLM aborted the stream")


async def test_client_leaves_while_waiting_for_the_first_token(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    started = time.monotonic()
    proxy.set_faults(Fault(path="/v1/completions", delay_s=5.0))
    async with aiohttp.ClientSession() as session:
        waiting = asyncio.create_task(post_stream(session, gated.url + "/v1/completions",
                                                  completion(50)))
        await until(lambda: gated.state()["admission"]["inflight"] == 1, 10, "admitted")
        assert gated.state()["admission"]["ledger"]["reserved_blocks"] > 0
        left_at = time.monotonic()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    # Released as soon as the client left, well before the server would have answered;
    # the server never saw the request.
    await until(lambda: released(gated), 3, "reservation released")
    assert time.monotonic() - left_at < 3
    seen = proxy.requests("/v1/completions", "POST", since=started)
    proxy.wait_for(lambda: all(s.done for s in seen), 10)
    assert len(seen) == 1 and seen[0].abandoned and not seen[0].forwarded


async def test_client_leaves_mid_stream(
    small_kv_vllm: VllmServer, proxy: FaultProxy, gated: Sidecar
) -> None:
    # The client leaves as soon as tokens flow: checking vLLM first could race the ~2 s
    # its whole answer takes. That vLLM stopped early shows in the tokens it generated.
    before = generated_on(small_kv_vllm)
    async with aiohttp.ClientSession() as session:
        body = completion(900)
        response = await session.post(gated.url + "/v1/completions", json=body)
        assert response.status == 200
        for _ in range(10):
            await response.content.readline()
        response.close()
    await until(lambda: released(gated), 10, "reservation released")
    await until(lambda: running_on(small_kv_vllm) == 0, 20, "vLLM stopped the request")
    assert 5 <= generated_on(small_kv_vllm) - before < 900  # aborted mid-answer


def slow_reader(port: int, body: dict[str, Any]) -> socket.socket:
    """A client that sends a request and then reads nothing: its receive buffer is
    tiny and so is its MSS, which keeps the kernel's buffers on kvgate's side small
    (otherwise loopback lets a few MB sit in socket buffers)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_to_end(sock: socket.socket, timeout_s: float = 120.0) -> bytes:
    sock.settimeout(timeout_s)
    received = bytearray()
    while not received.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        received += chunk
    return bytes(received)


def unread_in_kernels(proxy: FaultProxy, sidecar_port: int, client_port: int) -> int:
    """Bytes of the stream sitting in kernel buffers between the proxy and the client:
    sent by the proxy and not yet read by kvgate, written by kvgate and not yet read
    by the client."""
    total = 0
    for queue in tcp_queues():
        if queue.local_port == proxy.port:  # proxy -> kvgate, in flight
            total += queue.tx_bytes
        elif queue.remote_port == proxy.port:  # at kvgate, not read yet
            total += queue.rx_bytes
        elif (queue.local_port, queue.remote_port) == (sidecar_port, client_port):
            total += queue.tx_bytes  # kvgate -> client, in flight
        elif (queue.local_port, queue.remote_port) == (client_port, sidecar_port):
            total += queue.rx_bytes  # at the client, not read
    return total


async def test_slow_reader_is_backpressured_not_buffered(big_kv_vllm: VllmServer) -> None:
    # 32 sequences of 900 tokens: a 6-7 MB stream (the random model's sampled tokens
    # vary in length from run to run: 5.9-6.8 MB seen), more than the kernel's socket
    # buffers on the way take.
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 900, "n": 32,
            "stream": True, "ignore_eos": True}
    with FaultProxy(big_kv_vllm.url, sndbuf=64 * 1024) as proxy, \
            Sidecar(proxy.url, "--metrics-interval-s", "0.5") as gated:
        assert gated.proc is not None
        before = process_figures(gated.proc.pid)
        sock = slow_reader(gated.port, body)
        client_port = sock.getsockname()[1]
        try:
            await until(lambda: bool(proxy.forwarded("/v1/completions")), 30, "forwarded")
            stream = proxy.forwarded("/v1/completions")[0]
            # The client reads nothing: the flow from vLLM stops once the buffers on
            # the way are full.
            taken, still_since = -1, time.monotonic()
            while time.monotonic() - still_since < 2.0:
                await asyncio.sleep(0.25)
                if stream.bytes_out != taken:
                    taken, still_since = stream.bytes_out, time.monotonic()
                assert not stream.done, "the whole stream went by a client reading nothing"
            # What kvgate read from the proxy and did not hand to the client's
            # connection is in kvgate's own memory: aiohttp's read and write buffers,
            # whatever the stream's size.
            held = taken - unread_in_kernels(proxy, gated.port, client_port)
            during = process_figures(gated.proc.pid)
            # kvgate serves others meanwhile: a slow client holds only its own stream
            # (were it to block kvgate, this would wait for the client, which reads
            # nothing until it is answered).
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as session, \
                    session.get(gated.url + "/v1/models") as models:
                assert models.status == 200
            assert not stream.done, "the slow client's stream ended before it read"
            received = await asyncio.to_thread(read_to_end, sock)
        finally:
            sock.close()
        total = stream.bytes_out
        print(f"slow reader: {taken} of {total} bytes taken from vLLM while the client read "
              f"nothing, {held} of them held by kvgate; kvgate RSS "
              f"{before['rss_bytes'] >> 20} -> {during['rss_bytes'] >> 20} MiB")
        assert total > 4_000_000 and b"data: [DONE]" in received
        assert len(received) > total  # all of it, in chunked framing
        assert taken < total / 2
        assert held < 3 << 19, held  # 1.5 MiB
        assert during["rss_bytes"] - before["rss_bytes"] < 16 << 20
        await until(lambda: released(gated), 10, "reservation released")


async def test_thousands_of_idle_connections(gated: Sidecar) -> None:
    assert gated.proc is not None
    pid = gated.proc.pid
    before = process_figures(pid)
    sockets: list[socket.socket] = []
    try:
        for index in range(3000):
            sock = socket.create_connection(("127.0.0.1", gated.port), timeout=10)
            if index % 10 == 1:  # some send half a request line and headers ...
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            elif index % 10 == 2:  # ... some half a body
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            sockets.append(sock)
        await until(lambda: gated.state()["process"]["client_connections"] >= 3000, 30,
                   "all connections accepted")
        during = process_figures(pid)
        started = time.monotonic()
        async with aiohttp.ClientSession() as session:
            served = await post_stream(session, gated.url + "/v1/completions", completion(8))
        assert served.status == 200 and served.done
        assert time.monotonic() - started < 10
        assert gated.get("/readyz")[0] == 200
    finally:
        for sock in sockets:
            sock.close()
    await until(lambda: gated.state()["process"]["client_connections"] <= 2, 15,
               "connections closed")
    after = process_figures(pid)
    print(f"3000 idle connections: kvgate RSS {before['rss_bytes'] >> 20} -> "
          f"{during['rss_bytes'] >> 20} -> {after['rss_bytes'] >> 20} MiB, fds "
          f"{before['fds']} -> {during['fds']} -> {after['fds']}")
    assert during["fds"] >= before["fds"] + 3000 - 10  # (idle upstream ones come and go)
    assert after["fds"] <= before["fds"] + 10
    assert during["rss_bytes"] - before["rss_bytes"] < 150 << 20
    assert gated.state()["admission"]["inflight"] == 0


async def test_bodies_over_the_limit_get_413(proxy: FaultProxy, gated: Sidecar) -> None:
    started = time.monotonic()
    big = json.dumps(completion(8, prompt="x" * BODY_LIMIT)).encode()

    async def chunks() -> Any:
        for start in range(0, len(big), 8192):
            yield big[start:start + 8192]

    async with aiohttp.ClientSession() as session:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            async with session.post(gated.url + path, data=big,
                                    headers={"Content-Type": "application/json"}) as response:
                assert response.status == 413
                error = (await response.json())["error"]
                assert error["code"] == "body_too_large"
                assert str(BODY_LIMIT) in error["message"]
        # Chunked, so that no Content-Length announces it.
        async with session.post(gated.url + "/v1/completions", data=chunks(),
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == 413
        served = await post_stream(session, gated.url + "/v1/completions", completion(8))
        assert served.status == 200
    # Only the last request reached the server (its /tokenize, then itself).
    assert len(proxy.requests("/v1/completions", since=started)) == 1
    assert len(proxy.requests("/tokenize", since=started)) == 1


# (route, body, param named, words of the message)
BAD_INPUT: list[tuple[str, bytes | dict[str, Any], str | None, str]] = [
    ("/v1/completions", b"{not json", None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", None, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None, "not UTF-8"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None,
     "not usable JSON"),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None,
     "nested too deeply"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens", "<="),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ("/v1/completions", {"prompt": 5}, "prompt", "must be a string"),
    ("/v1/completions", {"prompt": "x", "model": 7}, "model", "string"),
    ("/v1/completions", {"prompt": "x", "user": ["a"]}, "user", "string"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", ">= 1"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n", "integer"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, "n", "<= 128"),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, "n", "greedy"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": -1}, "temperature", ">= 0"),
    ("/v1/completions", {"prompt": "x", "user": "a b"}, "user", "characters"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "list of messages"),
    ("/v1/chat/completions", {"messages": []}, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": -5}, "max_completion_tokens", ">= 1"),
    ("/v1/responses", {"max_output_tokens": 5}, "input", "'input'"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens",
     "required"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                      "system": 5}, "system", "system"),
]


async def test_bad_input_is_a_4xx_naming_the_field_and_never_reaches_vllm(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        for path, body, param, words in BAD_INPUT:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(gated.url + path, data=data,
                                    headers={"Content-Type": "application/json"}) as response:
                answer = await response.json()
                assert response.status == 400, (path, body, answer)
            error = answer["error"]
            assert error["param"] == param, (body, error)
            assert words in error["message"], (body, error)
            if param is not None:
                assert param.split("[")[0] in error["message"], error
            assert error["type"] == "invalid_request_error"
        # Never fits the KV cache (4 sequences of up to 1,023 tokens need 128 blocks of
        # the 59 kvgate may give): checked with the server's tokenizer, never sent for
        # generation.
        too_long = await post_stream(session, gated.url + "/v1/completions",
                                     completion(5000, n=4, temperature=1.0))
        assert too_long.status == 400 and too_long.body["error"]["param"] == "max_tokens"
        assert too_long.body["error"]["code"] == "never_fits"
        assert "largest max_tokens that fits" in too_long.body["error"]["message"]
    for path in GENERATION:
        assert not proxy.forwarded(path, since=started), path
    # Only the never-fits prompt was counted by the server's /tokenize.
    assert len(proxy.requests("/tokenize", since=started)) == 1
    assert released(gated)
    assert "Traceback" not in gated.log_text()


async def test_n_is_reserved_for_and_best_of_is_not(proxy: FaultProxy, gated: Sidecar) -> None:
    async with aiohttp.ClientSession() as session:
        url = gated.url + "/v1/completions"
        one = await post_stream(session, url, completion(100, stream=False))
        three = await post_stream(session, url, completion(100, stream=False, n=3,
                                                           temperature=0.8))
        best = await post_stream(session, url, completion(100, stream=False, best_of=3))
        # 4 sequences of ~600 tokens need 4 x 19 blocks less 3 x the shared prompt
        # blocks: more than the whole cache kvgate admits into (59); vLLM alone would
        # take it and preempt.
        four = await post_stream(session, url, completion(500, stream=False, n=4,
                                                          temperature=0.8))
    blocks = int(one.headers["x-kvgate-kv-blocks"])
    assert one.status == three.status == best.status == 200
    # With prefix caching (vLLM's default) the forks hold the prompt's full blocks once
    # (tests/test_e2e_forks.py measures it): 2 x those fewer than 3 separate requests.
    shared = (int(one.headers["x-kvgate-prompt-tokens"]) - 1) // 32
    assert shared >= 1
    assert int(three.headers["x-kvgate-kv-blocks"]) == 3 * blocks - 2 * shared
    # vLLM 0.32 ignores best_of: one sequence, reserved as one.
    assert int(best.headers["x-kvgate-kv-blocks"]) == blocks
    assert len(three.body["choices"]) == 3 and len(best.body["choices"]) == 1
    assert four.status == 400 and four.body["error"]["code"] == "never_fits"
    assert four.body["kvgate"]["sequences"] == 4
    assert "4 x" in four.body["error"]["message"]
    assert released(gated)


async def test_unknown_fields_are_passed_through(proxy: FaultProxy, gated: Sidecar) -> None:
    started = time.monotonic()
    extra = {"kvgate_test_unknown": {"nested": [1, 2, 3]}, "top_k": 3, "seed": 11}
    async with aiohttp.ClientSession() as session:
        result = await post_stream(session, gated.url + "/v1/completions",
                                   completion(8, stream=False, **extra))
        chat = await post_stream(session, gated.url + "/v1/chat/completions", {
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "kvgate_test_unknown": "kept", "logit_bias": {"5": 1}})
    assert result.status == 200 and chat.status == 200
    sent = json.loads(proxy.forwarded("/v1/completions", since=started)[0].body)
    assert all(sent[name] == value for name, value in extra.items()), sent
    sent = json.loads(proxy.forwarded("/v1/chat/completions", since=started)[0].body)
    assert sent["kvgate_test_unknown"] == "kept" and sent["logit_bias"] == {"5": 1}


async def test_the_request_id_reaches_the_server_on_every_call_kvgate_makes(
    proxy: FaultProxy, gated: Sidecar
) -> None:
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        result = await post_stream(session, gated.url + "/v1/completions", completion(8),
                                   headers={"x-request-id": "rid-joined-1"})
    assert result.status == 200
    # The prompt count (vLLM: tokenize-<id>) and the generation (cmpl-<id>) both carry it.
    for path in ("/tokenize", "/v1/completions"):
        seen = proxy.requests(path, "POST", since=started)
        ids = [{k.lower(): v for k, v in s.headers.items()}.get("x-request-id") for s in seen]
        assert ids == ["rid-joined-1"], path
