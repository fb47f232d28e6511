"""Parse and validate the generation requests kvgate admits.

Each OpenAI-compatible route vLLM serves spells the same things differently; this
module reads, for each, what admission needs: the prompt (as a /tokenize payload,
and as text for the fallback estimate), the output reservation (`max_tokens` and
friends), how many sequences will be generated (`n`), streaming, and the
`user`. Bad input raises `BadRequest` naming the field; unknown fields are left for
the server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.admission.quick_init import quick_init

ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
MAX_SEQUENCES = 128
MAX_PROMPTS = 64
# Far above any context length; bounds the arithmetic on absurd values (10**4000).
MAX_OUTPUT_TOKENS = 1 << 30
# vLLM's threshold for greedy sampling, which gives a single answer.
GREEDY_TEMPERATURE = 1e-5
# vLLM's default for /v1/completions when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@quick_init
@dataclass(frozen=True)
class GenerationRequest:
    route: str
    model: str | None
    stream: bool
    max_tokens: int | None  # None: up to max_model_len
    sequences: int  # per prompt
    prompts: int  # completions may send a batch of prompts
    user: str | None
    tokenize_payloads: tuple[dict[str, Any], ...]
    token_counts: tuple[int, ...] = ()  # prompts given as token ids need no tokenizer
    token_ids: tuple[int, ...] | None = None  # a single prompt given as token ids
    estimate_text: tuple[str, ...] = field(default=(), repr=False)
    message_count: int = 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: object) -> str:
    """A bad value, short enough for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _positive_int(body: Mapping[str, Any], name: str, *,
                  limit: int | None = MAX_OUTPUT_TOKENS) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise BadRequest(f"'{name}' must be an integer, got {_show(value)}", name)
    if value < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {_show(value)}", name)
    if limit is not None and value > limit:
        raise BadRequest(f"'{name}' must be <= {limit}, got {_show(value)}", name)
    return int(value)


def _bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", name)
    return value


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string", name)
    return value


def _content_text(content: object, where: str) -> str:
    """Text of an OpenAI / Anthropic message content: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                text = part.get("text") or part.get("input_text") or part.get("content")
                if isinstance(text, str):
                    texts.append(text)
                elif isinstance(text, list):
                    texts.append(_content_text(text, where))
            else:
                raise BadRequest(f"'{where}' parts must be objects or strings", where)
        return "\n".join(texts)
    raise BadRequest(f"'{where}' must be a string or a list of content parts", where)


def _messages(value: object, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{name}' must be a non-empty list of messages", name)
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRequest(f"'{name}[{index}]' must be an object", f"{name}[{index}]")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"'{name}[{index}].role' must be a string", f"{name}[{index}].role")
        _content_text(message.get("content"), f"{name}[{index}].content")
    return value


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        # A body opening with "{" is UTF-8 to json.loads (no BOM, no UTF-16/32 zero
        # byte): decoded here as it would, without its encoding detection.
        body = (json.loads(raw.decode("utf-8", "surrogatepass"))
                if raw[:1] == b"{" and raw[1:2] != b"\0" else json.loads(raw))
    except UnicodeDecodeError as exc:
        raise BadRequest("request body is not valid JSON (not UTF-8)") from exc
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON ({exc.msg})") from exc
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise BadRequest(f"request body is not usable JSON ({str(exc)[:80]})") from exc
    except RecursionError as exc:
        raise BadRequest("request body is not usable JSON (nested too deeply)") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def parse_generation(route: str, body: Mapping[str, Any]) -> GenerationRequest:
    kind = ROUTES[route]
    model = _optional_str(body, "model")
    user = _optional_str(body, "user")
    stream = _bool(body, "stream")
    if kind == "chat":
        return _chat(body, model, user, stream)
    if kind == "completions":
        return _completions(body, model, user, stream)
    if kind == "responses":
        return _responses(body, model, user, stream)
    return _anthropic_messages(body, model, user, stream)


def _sequences(body: Mapping[str, Any]) -> int:
    """The sequences vLLM runs for the request: `n`. `best_of` is passed on unread:
    vLLM 0.32 ignores it (its completions and chat requests have no such field)."""
    n = _positive_int(body, "n", limit=MAX_SEQUENCES) or 1
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float)
                                    or isinstance(temperature, bool)
                                    or not 0 <= temperature < math.inf):
        raise BadRequest("'temperature' must be a number >= 0", "temperature")
    if n > 1 and temperature is not None and temperature < GREEDY_TEMPERATURE:
        # vLLM refuses it too ("n must be 1 when using greedy sampling").
        raise BadRequest(f"'n' must be 1 with greedy sampling (temperature 0), got {n}", "n")
    return n


def _chat(body: Mapping[str, Any], model: str | None, user: str | None,
          stream: bool) -> GenerationRequest:
    messages = _messages(body.get("messages"), "messages")
    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
    for passthrough in ("tools", "chat_template", "chat_template_kwargs",
                        "add_generation_prompt", "continue_final_message",
                        "add_special_tokens"):
        if passthrough in body:
            payload[passthrough] = body[passthrough]
    if model is not None:
        payload["model"] = model
    return GenerationRequest(
        route="chat", model=model, stream=stream, max_tokens=max_tokens,
        sequences=_sequences(body), prompts=1, user=user,
        tokenize_payloads=(payload,),
        estimate_text=tuple(_content_text(m.get("content"), "messages") for m in messages),
        message_count=len(messages),
    )


def _completions(body: Mapping[str, Any], model: str | None, user: str | None,
                 stream: bool) -> GenerationRequest:
    prompt = body.get("prompt")
    texts: list[str] = []
    counts: list[int] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        counts = [len(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(
        isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt
    ):
        counts = [len(p) for p in prompt]
    else:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids "
                         "or a list of such lists", "prompt")
    if len(texts) + len(counts) > MAX_PROMPTS:
        raise BadRequest(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if "max_tokens" in body and body["max_tokens"] is None:
        max_tokens = None
    else:
        max_tokens = _positive_int(body, "max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS
    extra: dict[str, Any] = {"model": model} if model else {}
    if isinstance(body.get("add_special_tokens"), bool):
        extra["add_special_tokens"] = body["add_special_tokens"]
    payloads = tuple({"prompt": t, **extra} for t in texts)
    return GenerationRequest(
        route="completions", model=model, stream=stream, max_tokens=max_tokens,
        sequences=_sequences(body), prompts=len(texts) + len(counts), user=user,
        tokenize_payloads=payloads, token_counts=tuple(counts),
        token_ids=tuple(prompt) if counts and not texts and isinstance(prompt, list)
        and prompt and _is_int(prompt[0]) else None,
        estimate_text=tuple(texts), message_count=0,
    )


def _responses(body: Mapping[str, Any], model: str | None, user: str | None,
               stream: bool) -> GenerationRequest:
    raw = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = _optional_str(body, "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw:
        for index, item in enumerate(raw):
            if not isinstance(item, dict):
                raise BadRequest(f"'input[{index}]' must be an object", f"input[{index}]")
            text = _content_text(item.get("content", item.get("text")), f"input[{index}]")
            role = item.get("role") if isinstance(item.get("role"), str) else "user"
            messages.append({"role": role, "content": text})
    else:
        raise BadRequest("'input' must be a string or a non-empty list of items", "input")
    max_tokens = _positive_int(body, "max_output_tokens")
    payload: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
    if model is not None:
        payload["model"] = model
    return GenerationRequest(
        route="responses", model=model, stream=stream, max_tokens=max_tokens, sequences=1,
        prompts=1, user=user, tokenize_payloads=(payload,),
        estimate_text=tuple(str(m["content"]) for m in messages),
        message_count=len(messages),
    )


def _anthropic_messages(body: Mapping[str, Any], model: str | None, user: str | None,
                        stream: bool) -> GenerationRequest:
    messages = _messages(body.get("messages"), "messages")
    max_tokens = _positive_int(body, "max_tokens")
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required", "max_tokens")
    converted: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        converted.append({"role": "system", "content": _content_text(system, "system")})
    converted += [{"role": m["role"], "content": _content_text(m.get("content"), "messages")}
                  for m in messages]
    payload: dict[str, Any] = {"messages": converted, "add_generation_prompt": True}
    if model is not None:
        payload["model"] = model
    metadata = body.get("metadata")
    anthropic_user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return GenerationRequest(
        route="messages", model=model, stream=stream, max_tokens=max_tokens, sequences=1,
        prompts=1, user=user or (anthropic_user if isinstance(anthropic_user, str) else None),
        tokenize_payloads=(payload,),
        estimate_text=tuple(str(m["content"]) for m in converted),
        message_count=len(converted),
    )


def estimate_tokens(texts: Sequence[str], messages: int) -> int:
    """The fallback when /tokenize fails: one token per 3 UTF-8 bytes (BPE vocabularies
    average 3.5-4.5 bytes per token in English, so this over-counts, which reserves on
    the safe side) plus 8 tokens of chat template per message."""
    # surrogatepass: JSON may carry lone surrogates ("\ud800"), which strict UTF-8 refuses.
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    return math.ceil(size / 3) + 8 * messages + 1
