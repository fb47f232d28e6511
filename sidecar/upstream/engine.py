"""The seam between kvgate and the model server: everything kvgate asks of it.

`Engine` is what the server wiring depends on; `UpstreamClient` (client.py) is vLLM's
implementation over HTTP. Another server, or a test's in-memory stand-in, implements
the same few calls instead of patching the HTTP client.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from sidecar.upstream.client import ModelInfo, Tokenized
from sidecar.upstream.http1 import ForwardResponse
from sidecar.upstream.server_metrics import ServerMetrics


class Engine(Protocol):
    """What kvgate asks of the model server behind it."""

    base_url: str

    def url(self, path: str) -> str:
        """The address of one of the server's routes (for logs and errors)."""
        ...

    async def models(self) -> list[ModelInfo]:
        """The served models (id, path, context length)."""
        ...

    async def tokenize(self, payload: Mapping[str, Any],
                       request_id: str | None = None) -> Tokenized:
        """The token ids the server gives a prompt or chat messages."""
        ...

    async def metrics(self) -> ServerMetrics:
        """The server's metrics as a typed snapshot: KV cache configuration and use,
        running and waiting requests, preemptions, prefix-cache hits."""
        ...

    async def version(self) -> str | None:
        """The server's version, when it says."""
        ...

    def connections(self) -> dict[str, int] | None:
        """Connections to the server in use and idle (leak indicators), when known."""
        ...

    async def forward(self, method: str, path_qs: str, body: bytes | None,
                      headers: Iterable[tuple[str, str]],
                      read_timeout_s: float | None) -> ForwardResponse:
        """Send a client's request on; the caller streams the response and closes it.
        Raises a `ForwardError` (http1.py) when no usable answer comes."""
        ...
