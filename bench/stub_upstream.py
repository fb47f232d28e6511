#!/usr/bin/env python3
"""A minimal OpenAI-compatible server that answers at a controlled rate.

    python bench/stub_upstream.py --port 20001 [--ttft-ms 10] [--tokens 8]
        [--token-interval-ms 5] [--max-model-len 4096]

The only stand-in for vLLM the project accepts, and only to isolate proxy cost in
`bench/overhead.py`: it does no inference, so whatever latency a proxy in front of
it adds is the proxy's. It speaks just enough of vLLM's API for kvgate to run in
front of it:

- `GET /v1/models`: one model with `root: null` and `max_model_len`;
- `POST /tokenize`: `{"count": N}` with N = ceil(UTF-8 bytes / 4) of the prompt (plus
  4 per chat message), a stand-in rule, not a tokenizer;
- `GET /health`, and `GET /metrics` with the vLLM names kvgate reads:
  `vllm:cache_config_info` (a block count large enough never to throttle),
  `vllm:kv_cache_usage_perc` 0, `vllm:num_requests_running` / `_waiting`,
  `vllm:num_preemptions_total` 0;
- `POST /v1/completions` and `/v1/chat/completions`: the first token `--ttft-ms`
  after the request, then one token every `--token-interval-ms`, `--tokens` tokens
  in all (fewer if the request's `max_tokens` is lower); non-streaming answers
  arrive when the last token would have; streaming answers are vLLM's SSE chunks
  (`data: {...}` per token, a usage chunk when `stream_options.include_usage`, then
  `data: [DONE]`).

Per-request overrides (headers, passed through by any proxy): `x-stub-ttft-ms`,
`x-stub-token-interval-ms`, `x-stub-tokens` (e.g. 0/0/1 for a throughput ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class StubConfig:
    model: str
    max_model_len: int
    ttft_s: float
    interval_s: float
    tokens: int
    block_size: int = 16
    num_blocks: int = 1_000_000


class StubState:
    def __init__(self) -> None:
        self.running = 0
        self.requests = 0
        self.ids = itertools.count(1)


STUB_CONFIG = web.AppKey("stub_config", StubConfig)
STUB_STATE = web.AppKey("stub_state", StubState)


def count_tokens(payload: dict[str, Any]) -> int:
    """The stand-in tokenizer: ceil(bytes / 4), plus 4 tokens per chat message."""
    if isinstance(payload.get("messages"), list):
        messages = payload["messages"]
        text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        return max(1, math.ceil(len(text.encode()) / 4) + 4 * len(messages))
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        prompt = "".join(str(p) for p in prompt)
    return max(1, math.ceil(len(str(prompt).encode()) / 4))


def _float_header(request: web.Request, name: str, default: float) -> float:
    value = request.headers.get(name)
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        return default


async def models(request: web.Request) -> web.Response:
    config = request.app[STUB_CONFIG]
    return web.json_response({"object": "list", "data": [{
        "id": config.model, "object": "model", "created": 0, "owned_by": "kvgate-bench",
        "root": None, "parent": None, "max_model_len": config.max_model_len,
    }]})


async def tokenize(request: web.Request) -> web.Response:
    config = request.app[STUB_CONFIG]
    payload = await request.json()
    count = count_tokens(payload if isinstance(payload, dict) else {})
    return web.json_response({"count": count, "max_model_len": config.max_model_len,
                              "tokens": [], "token_strs": None})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    config = request.app[STUB_CONFIG]
    state = request.app[STUB_STATE]
    labels = (f'block_size="{config.block_size}",cache_dtype="auto",'
              f'enable_prefix_caching="False",engine="0",gpu_memory_utilization="0.9",'
              f'kv_cache_size_tokens="{config.block_size * config.num_blocks}",'
              f'num_gpu_blocks="{config.num_blocks}",sliding_window="None"')
    model = f'engine="0",model_name="{config.model}"'
    text = "\n".join([
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{labels}}} 1.0",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{model}}} {float(state.running)}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{model}}} 0.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{model}}} 0.0",
        "# TYPE vllm:num_preemptions counter",
        f"vllm:num_preemptions_total{{{model}}} 0.0",
        "# TYPE vllm:request_success counter",
        f'vllm:request_success_total{{{model},finished_reason="length"}} '
        f"{float(state.requests)}",
        "",
    ])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


def _chunk(kind: str, rid: str, created: int, model: str, text: str,
           finish: str | None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    if kind == "chat":
        body = (f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},'
                f'"model":"{model}","choices":[{{"index":0,"delta":{{"content":"{text}"}},'
                f'"logprobs":null,"finish_reason":{reason}}}]}}')
    else:
        body = (f'{{"id":"{rid}","object":"text_completion","created":{created},'
                f'"model":"{model}","choices":[{{"index":0,"text":"{text}",'
                f'"logprobs":null,"finish_reason":{reason},"stop_reason":null}}],'
                f'"usage":null}}')
    return b"data: " + body.encode() + b"\n\n"


async def generate(request: web.Request) -> web.StreamResponse:
    config = request.app[STUB_CONFIG]
    state = request.app[STUB_STATE]
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return web.json_response({"error": {"message": "not JSON", "type": "BadRequestError",
                                            "code": 400, "param": None}}, status=400)
    kind = "chat" if request.path.endswith("/chat/completions") else "completions"
    ttft_s = _float_header(request, "x-stub-ttft-ms", config.ttft_s * 1000) / 1000
    interval_s = _float_header(request, "x-stub-token-interval-ms",
                               config.interval_s * 1000) / 1000
    tokens = int(_float_header(request, "x-stub-tokens", config.tokens))
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    if isinstance(max_tokens, int) and max_tokens > 0:
        tokens = min(tokens, max_tokens)
    tokens = max(1, tokens)
    prompt_tokens = count_tokens(body)
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-stub{next(state.ids)}"
    created = int(time.time())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
             "total_tokens": prompt_tokens + tokens}
    state.running += 1
    try:
        if not body.get("stream"):
            await asyncio.sleep(ttft_s + interval_s * (tokens - 1))
            text = " tok" * tokens
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}
            if kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
                obj = "chat.completion"
            else:
                choice["text"] = text
                obj = "text_completion"
            return web.json_response({"id": rid, "object": obj, "created": created,
                                      "model": config.model, "choices": [choice],
                                      "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        if kind == "chat":  # vLLM opens a chat stream with the role
            opening = (f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},'
                       f'"model":"{config.model}","choices":[{{"index":0,"delta":'
                       f'{{"role":"assistant","content":""}},"logprobs":null,'
                       f'"finish_reason":null}}]}}')
            await response.write(b"data: " + opening.encode() + b"\n\n")
        await asyncio.sleep(ttft_s)
        for index in range(tokens):
            if index:
                await asyncio.sleep(interval_s)
            finish = "length" if index == tokens - 1 else None
            await response.write(_chunk(kind, rid, created, config.model, " tok", finish))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            final: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                     "model": config.model, "choices": [], "usage": usage}
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        state.running -= 1
        state.requests += 1


def build_app(config: StubConfig) -> web.Application:
    app = web.Application()
    app[STUB_CONFIG] = config
    app[STUB_STATE] = StubState()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="stub-qwen3-0.6b")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--ttft-ms", type=float, default=10.0)
    parser.add_argument("--token-interval-ms", type=float, default=5.0)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    config = StubConfig(model=args.model, max_model_len=args.max_model_len,
                        ttft_s=args.ttft_ms / 1000, interval_s=args.token_interval_ms / 1000,
                        tokens=args.tokens)
    web.run_app(build_app(config), host=args.host, port=args.port, access_log=None,
                print=None, backlog=4096)


if __name__ == "__main__":
    main()
