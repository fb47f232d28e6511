"""Count generated tokens from a response as it passes through, without parsing
whole bodies.

Streaming (SSE): vLLM sends one `data:` event per generated token per sequence
(its default stream interval), so events carrying choices count tokens; a final
`usage` object, when the client asked for one, gives the exact count.
Non-streaming: the JSON body ends with `usage.completion_tokens`; only a bounded
tail of the body is kept to find it.
"""

from __future__ import annotations

import re

_USAGE = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')
_TAIL_BYTES = 64 * 1024


class TokenCounter:
    def __init__(self, *, stream: bool, sequences: int) -> None:
        self.stream = stream
        self.sequences = max(1, sequences)
        self.events = 0
        self.usage_tokens: int | None = None
        self._partial = b""
        self._tail = b""

    @property
    def tokens(self) -> int:
        """Output tokens per sequence so far."""
        if self.usage_tokens is not None:
            return max(1, self.usage_tokens // self.sequences) if self.usage_tokens else 0
        return self.events // self.sequences

    def feed(self, chunk: bytes) -> int:
        """Consume a chunk; return how many token events it completed."""
        if not self.stream:
            # A body's first chunk is usually all of it: kept as it is, no copy.
            self._tail = (chunk if not self._tail and len(chunk) <= _TAIL_BYTES
                          else (self._tail + chunk)[-_TAIL_BYTES:])
            return 0
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > _TAIL_BYTES:  # a pathological line: stop tracking it
            self._partial = b""
        before = self.events
        # Each `data:` line is searched whole: its prefix and the blanks around its
        # payload hold none of the quoted names, so nothing matches there ("[DONE]" and
        # an empty payload match nothing either), and no copy of the payload is made.
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            if b'"usage"' in line:
                usage = _USAGE.search(line)
                if usage is not None and b'"choices":[]' in line.replace(b" ", b""):
                    self.usage_tokens = int(usage.group(1))
                    continue
            if b'"delta"' in line or b'"choices"' in line:
                self.events += 1
        return self.events - before

    def finish(self) -> None:
        if not self.stream:
            found = _USAGE.findall(self._tail)
            if found:
                self.usage_tokens = int(found[-1])


class EventAligner:
    """Pass a text/event-stream on in whole events (up to `limit` bytes of a partial
    one are held back), so that an event kvgate adds after an upstream failure starts
    on an event boundary instead of completing half an event."""

    def __init__(self, limit: int = _TAIL_BYTES) -> None:
        self.limit = limit
        self._pending = b""
        self._at_boundary = True  # everything passed on so far ended an event

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to pass on now (whole events)."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end >= 0:
            end += 2
        else:  # events may also end in CRLF CRLF (vLLM's end in LF LF)
            end = data.rfind(b"\r\n\r\n")
            end = end + 4 if end >= 0 else -1
        if end < 0:
            if len(data) <= self.limit:
                self._pending = data
                return b""
            self._pending = b""  # a pathological event: pass it on as it is
            self._at_boundary = False
            return data
        self._pending = data[end:]
        self._at_boundary = True
        return data[:end]

    def flush(self) -> bytes:
        """What is left at the end of a complete stream."""
        data, self._pending = self._pending, b""
        return data

    def error_event(self, event: bytes) -> bytes:
        """`event`, to send after a failure: a held partial event is dropped."""
        self._pending = b""
        return event if self._at_boundary else b"\n\n" + event
