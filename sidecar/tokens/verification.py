"""When to check the local tokenizer against the server, and what a mismatch costs.

Requests are grouped by *shape*: what decides how a prompt is rendered (a completion
prompt or chat messages; for chat, the roles, whether content comes as parts, tools,
the template kwargs named, generation-prompt flags, a request's own template). Per
shape:
- the first `first_checks` requests are counted by the server, and the local count is
  compared with its answer (`check_now`); a check still waiting for the server counts
  toward them, so a burst of a new shape sends `first_checks` requests to the server's
  /tokenize, not the whole burst (the others are counted locally);
- after that, local counts are used, and one request in `every` is compared in the
  background (`check_later`);
- one mismatch sends the shape to the server for good (`server`): prefix-aware
  admission hashes these ids, so a shape whose ids differ from the server's is never
  counted locally again.

Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

MAX_SHAPES = 4096


class Plan(Enum):
    LOCAL = "local"  # count locally
    CHECK_NOW = "check_now"  # ask the server, compare, use the server's answer
    CHECK_LATER = "check_later"  # count locally, compare in the background
    SERVER = "server"  # the server counts this shape


def _digest(parts: list[Any]) -> str:
    encoded = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha1(encoded).hexdigest()[:16]


# A prompt's shape is one of two (every request of a completions route has one).
_PROMPT_SHAPES = {special: _digest(["prompt", special]) for special in (True, False)}


def shape_of(payload: Mapping[str, Any]) -> str:
    """A short key for what decides how the payload is rendered (never its text)."""
    if "prompt" in payload:
        return _PROMPT_SHAPES[bool(payload.get("add_special_tokens", True))]
    messages = payload.get("messages")
    roles = []
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, Mapping):
            content = message.get("content")
            roles.append((str(message.get("role")), type(content).__name__,
                          "tool_calls" in message, "name" in message))
    kwargs = payload.get("chat_template_kwargs")
    template = payload.get("chat_template")
    parts = [
        "chat", sorted(set(roles)),
        payload.get("tools") is not None,
        sorted(kwargs) if isinstance(kwargs, Mapping) else None,
        bool(payload.get("add_generation_prompt", True)),
        bool(payload.get("continue_final_message", False)),
        bool(payload.get("add_special_tokens", False)),
        hashlib.sha1(template.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        if isinstance(template, str) else None,
    ]
    return _digest(parts)


@dataclass
class _Shape:
    checked: int = 0
    pending: int = 0  # CHECK_NOW plans not yet settled
    since_check: int = 0
    mismatched: bool = False


class Verification:
    def __init__(self, *, first_checks: int = 3, every: int = 100) -> None:
        if first_checks < 1 or every < 0:
            raise ValueError("first_checks must be >= 1 and every >= 0")
        self.first_checks = first_checks
        self.every = every  # 0: no sampled checks after the first ones
        self._shapes: dict[str, _Shape] = {}
        self.matches = 0
        self.mismatches = 0

    def plan(self, shape: str) -> Plan:
        state = self._shapes.get(shape)
        if state is None:
            if len(self._shapes) >= MAX_SHAPES:  # bounded: forget settled shapes first
                for key in [k for k, s in self._shapes.items() if not s.mismatched]:
                    del self._shapes[key]
            state = self._shapes[shape] = _Shape()
        if state.mismatched:
            return Plan.SERVER
        if state.checked + state.pending < self.first_checks:
            state.pending += 1
            return Plan.CHECK_NOW
        state.since_check += 1
        if self.every and state.since_check >= self.every:
            state.since_check = 0
            return Plan.CHECK_LATER
        return Plan.LOCAL

    def settle(self, shape: str) -> None:
        """A CHECK_NOW plan is over, whatever its outcome (a comparison recorded, or
        the server did not answer): it no longer holds one of the first checks."""
        state = self._shapes.get(shape)
        if state is not None and state.pending > 0:
            state.pending -= 1

    def record(self, shape: str, matched: bool) -> None:
        """The outcome of one comparison with the server."""
        state = self._shapes.setdefault(shape, _Shape())
        state.checked += 1
        if matched:
            self.matches += 1
        else:
            self.mismatches += 1
            state.mismatched = True
