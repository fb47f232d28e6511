#!/usr/bin/env python3
"""A closed-loop HTTP load generator, run in its own process.

    python bench/loadgen.py --url http://127.0.0.1:20001 --concurrency 8 --duration 5 \
        [--stream] [--warmup 0.5] [--requests N] [--max-tokens 8] [--prompt-bytes 256] \
        [--header NAME:VALUE ...] [--out FILE]

`--concurrency` workers each hold one keep-alive connection and send the same
OpenAI completion request back to back until `--duration` seconds (or `--requests`
requests in all) have passed. Requests that start during the first `--warmup`
seconds are sent but not measured. It prints (or writes to `--out`) one JSON object:
per-request latency in milliseconds (send to last byte), time to first token for
streaming requests (send to the first `data:` event), status counts, errors, and
the measured throughput.

The HTTP/1.1 client is a few dozen lines of asyncio (no aiohttp): the generator
shares the machine with what it measures, so it should cost as little CPU per
request as possible, the same for every target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


class ProtocolError(Exception):
    pass


@dataclass
class Results:
    latency_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    status: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0  # every request, warm-up included
    measured_start: float = 0.0
    measured_end: float = 0.0


def build_request(host: str, port: int, path: str, payload: bytes,
                  headers: list[tuple[str, str]]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
             "Content-Type: application/json", f"Content-Length: {len(payload)}",
             "Connection: keep-alive"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


async def read_response(reader: asyncio.StreamReader,
                        stream: bool) -> tuple[int, float | None, int, bool]:
    """(status, time of first `data:` event, events, keep-alive) of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, header_block = head.partition(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ProtocolError(f"bad status line {status_line[:60]!r}")
    status = int(parts[1])
    length: int | None = None
    chunked = False
    keep_alive = parts[0] == b"HTTP/1.1"
    for line in header_block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
        elif name == b"connection":
            keep_alive = value == b"keep-alive" or (keep_alive and value != b"close")
    body = bytearray()
    first: float | None = None
    if chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                break
            data = await reader.readexactly(size + 2)
            body += data[:-2]
            if stream and first is None and b"data: {" in body:
                first = time.perf_counter()
    elif length is not None:
        body += await reader.readexactly(length)
    else:
        body += await reader.read()
        keep_alive = False
    if stream and first is None and b"data: {" in body:
        first = time.perf_counter()
    events = body.count(b"data: {") if stream else 0
    return status, first, events, keep_alive


async def worker(host: str, port: int, request: bytes, stream: bool, results: Results,
                 measure_from: float, stop_at: float, budget: list[int]) -> None:
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    try:
        while time.perf_counter() < stop_at:
            if budget[0] <= 0:
                return
            budget[0] -= 1
            if writer is None:
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                except OSError as exc:
                    results.errors[f"connect: {exc.__class__.__name__}"] += 1
                    await asyncio.sleep(0.05)
                    continue
            assert reader is not None
            start = time.perf_counter()
            results.sent += 1
            try:
                writer.write(request)
                status, first, events, keep_alive = await read_response(reader, stream)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ProtocolError, ValueError) as exc:
                if start >= measure_from:
                    results.errors[exc.__class__.__name__] += 1
                writer.close()
                writer = None
                continue
            end = time.perf_counter()
            if not keep_alive:
                writer.close()
                writer = None
            if start < measure_from:
                continue
            results.status[status] += 1
            if status != 200:
                continue
            results.latency_ms.append((end - start) * 1000)
            if stream:
                if first is None:
                    results.errors["no data event"] += 1
                else:
                    results.ttft_ms.append((first - start) * 1000)
                results.tokens.append(events)
    finally:
        if writer is not None:
            writer.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    payload: dict[str, Any] = {
        "model": args.model,
        "prompt": ("The quick brown fox jumps over the lazy dog. " * 64)[:args.prompt_bytes],
        "max_tokens": args.max_tokens,
        "stream": args.stream,
    }
    headers = []
    for item in args.header:
        name, _, value = item.partition(":")
        headers.append((name.strip(), value.strip()))
    request = build_request(host, port, args.path, json.dumps(payload).encode(), headers)
    results = Results()
    began = time.perf_counter()
    measure_from = began + args.warmup
    stop_at = measure_from + args.duration
    budget = [args.requests if args.requests else 1 << 62]
    await asyncio.gather(*(worker(host, port, request, args.stream, results, measure_from,
                                  stop_at, budget) for _ in range(args.concurrency)))
    ended = time.perf_counter()
    window = max(1e-9, ended - measure_from)
    ok = len(results.latency_ms)
    return {
        "url": args.url + args.path,
        "concurrency": args.concurrency,
        "stream": args.stream,
        "warmup_s": args.warmup,
        "window_s": round(window, 4),
        "sent": results.sent,
        "ok": ok,
        "status": {str(k): v for k, v in sorted(results.status.items())},
        "errors": dict(results.errors),
        "throughput_rps": round(ok / window, 2),
        "latency_ms": [round(v, 4) for v in results.latency_ms],
        "ttft_ms": [round(v, 4) for v in results.ttft_ms],
        "events_mean": (sum(results.tokens) / len(results.tokens)) if results.tokens else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:20001")
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--model", default="stub-qwen3-0.6b")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds first")
    parser.add_argument("--requests", type=int, default=0, help="stop after this many (0: no "
                        "limit)")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-bytes", type=int, default=256)
    parser.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
