"""Client-side load for end-to-end tests: streamed completions and bursts."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens


async def stream_completion(session: aiohttp.ClientSession, url: str, max_tokens: int,
                            prompt: str = PROMPT, model: str = "tiny-llama",
                            headers: dict[str, str] | None = None,
                            **extra: Any) -> dict[str, Any]:
    """A streamed /v1/completions with ignore_eos: status, Retry-After, text or error,
    and when its first and last tokens arrived (`time.monotonic()`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0, **extra}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        result: dict[str, Any] = {"status": response.status,
                                  "retry_after": response.headers.get("Retry-After"),
                                  "headers": dict(response.headers)}
        if response.status != 200:
            result["body"] = await response.json(content_type=None)
            return result
        text = []
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                text += [c.get("text", "") for c in chunk.get("choices", [])]
                result.setdefault("first_token_at", time.monotonic())
                result["last_token_at"] = time.monotonic()
        result["text"] = "".join(text)
        return result


def most_streaming_at_once(results: list[dict[str, Any]]) -> int:
    """The most requests that were streaming tokens at the same moment, from each one's
    first and last token: a server streams a request's tokens only once it runs it."""
    edges = sorted(edge for r in results if "first_token_at" in r
                   for edge in ((r["first_token_at"], 1), (r["last_token_at"], -1)))
    most = current = 0
    for _, step in edges:  # at equal times an end (-1) sorts before a start (+1)
        current += step
        most = max(most, current)
    return most


async def burst(url: str, count: int = 16, max_tokens: int = 400) -> list[dict[str, Any]]:
    """`count` streamed requests sent at once."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(stream_completion(session, url, max_tokens)
                                           for _ in range(count))))
