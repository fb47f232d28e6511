"""vLLM's own admission (0.29 and later): the server's queue limits, which kvgate keeps
the requests it forwards within, so that the server never refuses one of them.

vLLM's API server checks every new request before it reaches the engine
(`AsyncLLM.check_admission`, vLLM 0.32.0):
- `--max-num-queued-reqs N`: refused when the server's unfinished requests (waiting or
  running, from arrival until their last output; a request with `n` sequences counts
  `n`) plus the new request's sequences exceed N;
- `--max-num-queued-tokens T`: refused when the prompt tokens of its requests still in
  prefill (each one's whole prompt, until its first output) are already T or more; the
  new request's own prompt is not counted, so one long prompt still gets in.
Both answer 503 with an OpenAI error body (`sidecar.upstream.refusals` tells them
apart from the server's other 503s), send no Retry-After,
and count `vllm:admission_rejections_total{reason}` with the reasons below.

kvgate counts the requests it forwarded that have not ended yet, and the prompts of
those that have not streamed a first token. It sees a request end after the server
does (the last output comes before the end of the response) and its first token after
the server does, so for kvgate's own traffic its counts are never below the server's.
A non-streamed response shows no first token before it ends: its prompt is counted
until then, which holds such requests back longer than vLLM would.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REQUESTS = "max_num_queued_reqs"
MAX_PREFILL_TOKENS = "max_num_queued_tokens"
REASONS: tuple[str, ...] = (MAX_REQUESTS, MAX_PREFILL_TOKENS)

@dataclass(frozen=True)
class ServerQueueLimits:
    """The server's `--max-num-queued-reqs` and `--max-num-queued-tokens` (None: none)."""

    max_requests: int | None = None
    max_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("--max-num-queued-reqs", self.max_requests),
                            ("--max-num-queued-tokens", self.max_prefill_tokens)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def active(self) -> bool:
        return self.max_requests is not None or self.max_prefill_tokens is not None

    def never_admits(self, sequences: int) -> str | None:
        """The limit under which the server refuses a request of `sequences` however
        idle it is, or None."""
        if self.max_requests is not None and sequences > self.max_requests:
            return MAX_REQUESTS
        if self.max_prefill_tokens == 0:
            return MAX_PREFILL_TOKENS
        return None

    def refusal(self, requests: int, prefill_tokens: int, sequences: int) -> str | None:
        """The limit the server refuses a new request of `sequences` with, while it holds
        `requests` unfinished sequences and `prefill_tokens` prompt tokens in prefill;
        None when it takes the request."""
        if self.max_requests is not None and requests + sequences > self.max_requests:
            return MAX_REQUESTS
        if self.max_prefill_tokens is not None and prefill_tokens >= self.max_prefill_tokens:
            return MAX_PREFILL_TOKENS
        return None

    def describe(self, reason: str) -> str:
        if reason == MAX_REQUESTS:
            return f"the server's --max-num-queued-reqs {self.max_requests}"
        return f"the server's --max-num-queued-tokens {self.max_prefill_tokens}"

