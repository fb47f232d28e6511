"""The OpenAI Python client against an OpenAI-compatible server: `--requests` streamed
completions, `--concurrency` at a time, with the client's own retries (its default,
2). Run by bench/clients.py with the clients' environment's Python (bench/client_env.py);
prints one JSON object: per request its outcome (served, or the error the client
raised), and every retry the client made with the Retry-After it was answered.

    python bench/client_openai.py --base-url http://127.0.0.1:8080/v1 --model tiny-llama
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
from typing import Any

import openai

RETRY_LOG = re.compile(r"Retrying request in ([0-9.]+) seconds")


class RetryLog(logging.Handler):
    """The delays the client chose before each retry (its INFO log line)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.delays_s: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = RETRY_LOG.search(record.getMessage())
        if found:
            self.delays_s.append(float(found.group(1)))


async def one(client: openai.AsyncOpenAI, args: argparse.Namespace, index: int) -> dict[str, Any]:
    started = time.monotonic()
    try:
        stream = await client.completions.create(
            model=args.model, prompt=f"Request {index}. " + args.prompt,
            max_tokens=args.max_tokens, stream=True, temperature=0,
            extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            tokens += sum(1 for choice in chunk.choices if choice.text)
        return {"served": True, "chunks": tokens, "seconds": round(time.monotonic() - started, 3)}
    except openai.APIStatusError as exc:
        return {"served": False, "status": exc.status_code, "error": type(exc).__name__,
                "message": str(exc)[:300], "seconds": round(time.monotonic() - started, 3)}
    except openai.APIError as exc:
        return {"served": False, "status": None, "error": type(exc).__name__,
                "message": str(exc)[:300], "seconds": round(time.monotonic() - started, 3)}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    retry_after: list[str] = []

    async def seen(response: Any) -> None:
        if response.status_code >= 400:
            retry_after.append(response.headers.get("retry-after") or "")

    http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]})
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", http_client=http,
                                max_retries=args.max_retries, timeout=args.timeout_s)
    gate = asyncio.Semaphore(args.concurrency)

    async def bounded(index: int) -> dict[str, Any]:
        async with gate:
            return await one(client, args, index)

    retries = RetryLog()
    logging.getLogger("openai").addHandler(retries)
    logging.getLogger("openai").setLevel(logging.INFO)
    started = time.monotonic()
    results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
    await client.close()
    return {
        "openai_version": openai.__version__,
        "max_retries": args.max_retries,
        "seconds": round(time.monotonic() - started, 3),
        "results": results,
        "error_answers_retry_after": retry_after,
        "retry_delays_s": retries.delays_s,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--max-retries", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 9)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
