"""The server's own admission refusals (vLLM 0.29 and later), told apart from its other
answers.

vLLM's `--max-num-queued-reqs` and `--max-num-queued-tokens` refuse a request with a
503 whose OpenAI error body carries the message of `QueueOverflowError` or
`MaxQueuedTokensError` (vllm/exceptions.py, vLLM 0.32.0), e.g.

    {"error": {"message": "The engine is currently busy and cannot accept new requests.
     Please try again later or on a different instance.", "type": "Service Unavailable",
     "code": 503, "param": null}}

and count it in `vllm:admission_rejections_total{reason}` under the reasons below. A
streamed request the server takes at arrival but refuses when it adds it to the engine
answers 200 and carries the same error as its first event (`RefusalWatch`).
"""

from __future__ import annotations

MAX_REQUESTS = "max_num_queued_reqs"
MAX_PREFILL_TOKENS = "max_num_queued_tokens"
REFUSAL_REASONS: tuple[str, ...] = (MAX_REQUESTS, MAX_PREFILL_TOKENS)

# The first sentence of each refusal's message, by the reason vLLM counts it under.
REFUSAL_MESSAGES: dict[str, str] = {
    MAX_REQUESTS: "The engine is currently busy and cannot accept new requests.",
    MAX_PREFILL_TOKENS: "The engine has reached its prefill token backlog limit.",
}
# How a stream whose first event is an error begins (vLLM's json.dumps of its error).
STREAM_ERROR_EVENT = b'data: {"error": '
# How much of an error body is read to classify it (vLLM's is ~200 bytes).
REFUSAL_BODY_BYTES = 4096


def classify_refusal(status: int, body: bytes) -> str | None:
    """The reason of the server's admission refusal (a 503 carrying one of vLLM's two
    messages), or None for any other answer."""
    if status != 503:
        return None
    text = body[:REFUSAL_BODY_BYTES].decode("utf-8", "replace")
    for reason, message in REFUSAL_MESSAGES.items():
        if message in text:
            return reason
    return None


class RefusalWatch:
    """The first bytes of an answer the proxy passes on, to tell at its end whether it
    was the server's admission refusal: a 503, or a stream that answered 200 and then
    carried the refusal as its first event (vLLM 0.32 checks again when it adds the
    request to the engine, after a stream's headers went out; the event is
    `data: {"error": {..., "code": 503}}` followed by `data: [DONE]`)."""

    def __init__(self, status: int) -> None:
        self.status = status
        self._head = bytearray()

    def feed(self, chunk: bytes) -> None:
        room = REFUSAL_BODY_BYTES - len(self._head)
        if self.status in (200, 503) and room > 0:
            self._head += chunk[:room]

    def reason(self) -> str | None:
        head = bytes(self._head)
        if self.status == 200:
            if not head.lstrip().startswith(STREAM_ERROR_EVENT):
                return None
            return classify_refusal(503, head)
        return classify_refusal(self.status, head)
