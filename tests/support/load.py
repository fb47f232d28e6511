"""Client-side load for end-to-end tests: streamed completions and bursts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

PROMPT = "The quick brown fox jumps over the lazy dog. " * 9  # ~100 tokens


async def stream_completion(session: aiohttp.ClientSession, url: str, max_tokens: int,
                            prompt: str = PROMPT, model: str = "tiny-llama",
                            headers: dict[str, str] | None = None,
                            **extra: Any) -> dict[str, Any]:
    """A streamed /v1/completions with ignore_eos: status, Retry-After, text or error."""
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
        result["text"] = "".join(text)
        return result


async def burst(url: str, count: int = 16, max_tokens: int = 400) -> list[dict[str, Any]]:
    """`count` streamed requests sent at once."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(stream_completion(session, url, max_tokens)
                                           for _ in range(count))))
