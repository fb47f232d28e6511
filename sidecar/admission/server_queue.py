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

The server's `--max-num-seqs` is no refusal: vLLM runs that many sequences at once and
keeps the rest in its own first-come queue. Given it, kvgate forwards at most that many
sequences at once, counted as above, and keeps the rest in its own queue, where its order
(priority, fairness, deadlines) and its predicted waits hold. A request with more
sequences than the limit goes alone (vLLM runs its sequences in turns).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_REQUESTS = "max_num_queued_reqs"
MAX_PREFILL_TOKENS = "max_num_queued_tokens"
# The server's refusals (vLLM's reasons).
REASONS: tuple[str, ...] = (MAX_REQUESTS, MAX_PREFILL_TOKENS)
# What else holds a request back in kvgate: the sequences the server runs at once.
MAX_RUNNING = "max_num_seqs"

@dataclass(frozen=True)
class ServerQueueLimits:
    """The server's `--max-num-queued-reqs`, `--max-num-queued-tokens` and
    `--max-num-seqs` (None: none)."""

    max_requests: int | None = None
    max_prefill_tokens: int | None = None
    max_running: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("--max-num-queued-reqs", self.max_requests),
                            ("--max-num-queued-tokens", self.max_prefill_tokens)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_running}")

    @property
    def active(self) -> bool:
        return (self.max_requests is not None or self.max_prefill_tokens is not None
                or self.max_running is not None)

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

    def holding_back(self, requests: int, prefill_tokens: int, sequences: int) -> str | None:
        """The limit that keeps a new request of `sequences` in kvgate's queue while the
        server holds `requests` unfinished sequences of kvgate's and `prefill_tokens`
        prompt tokens in prefill: one the server would refuse it under (`refusal`), or
        the sequences it runs at once; None when it can go."""
        refused = self.refusal(requests, prefill_tokens, sequences)
        if refused is not None:
            return refused
        cap = self.max_running
        if cap is not None and requests > 0 and requests + min(sequences, cap) > cap:
            return MAX_RUNNING
        return None

    def describe(self, reason: str) -> str:
        if reason == MAX_RUNNING:
            return f"the server's --max-num-seqs {self.max_running}"
        if reason == MAX_REQUESTS:
            return f"the server's --max-num-queued-reqs {self.max_requests}"
        return f"the server's --max-num-queued-tokens {self.max_prefill_tokens}"

