"""The vLLM client: what the sidecar asks the server about itself, and the requests it
forwards (vLLM's implementation of `engine.Engine`).

The questions about the server go through one `aiohttp.ClientSession`; forwarded
requests through the lean HTTP/1.1 pool of http1.py (every admitted request takes that
path). Both are owned by the server's composition root and passed in; every call has
explicit timeouts and raises `UpstreamError` (or, forwarding, a `ForwardError`) naming
what failed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from sidecar.upstream.http1 import ForwardResponse, Http1Pool
from sidecar.upstream.server_metrics import ServerMetrics, parse_server_metrics


class UpstreamError(Exception):
    """The server could not be reached or answered something unusable."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # connect | timeout | status | protocol


@dataclass(frozen=True)
class ModelInfo:
    """One entry of GET /v1/models."""

    id: str
    root: str | None
    max_model_len: int | None


@dataclass(frozen=True)
class Tokenized:
    """A prompt as the server tokenizes it: its count, and its ids when returned."""

    count: int
    token_ids: tuple[int, ...] | None


class UpstreamClient:
    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        forwarding: Http1Pool,
        *,
        control_timeout_s: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.forwarding = forwarding
        self._timeout = aiohttp.ClientTimeout(total=control_timeout_s)

    def url(self, path: str) -> str:
        return self.base_url + path

    async def _request(
        self, method: str, path: str, payload: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        try:
            async with self.session.request(
                method, self.url(path), json=payload, timeout=self._timeout, headers=headers
            ) as response:
                # A byte that is not UTF-8 (a label, a model name) costs its character,
                # not the whole reply.
                text = await response.text(errors="replace")
                if response.status >= 400:
                    raise UpstreamError(
                        "status", f"{method} {path} answered {response.status}: {text[:200]}"
                    )
                return text
        except TimeoutError as exc:
            raise UpstreamError("timeout", f"{method} {path} timed out") from exc
        except aiohttp.ClientConnectionError as exc:
            raise UpstreamError("connect", f"{method} {path}: {exc}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError("protocol", f"{method} {path}: {exc}") from exc

    async def _json(self, method: str, path: str,
                    payload: Mapping[str, Any] | None = None,
                    headers: Mapping[str, str] | None = None) -> Any:
        text = await self._request(method, path, payload, headers)
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UpstreamError("protocol", f"{method} {path}: not JSON") from exc

    async def models(self) -> list[ModelInfo]:
        data = await self._json("GET", "/v1/models")
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise UpstreamError("protocol", "GET /v1/models: no 'data' list")
        models = []
        for entry in entries:
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                length = entry.get("max_model_len")
                root = entry.get("root")
                models.append(ModelInfo(
                    entry["id"],
                    root if isinstance(root, str) else None,
                    length if isinstance(length, int) and not isinstance(length, bool) else None,
                ))
        return models

    async def metrics(self) -> ServerMetrics:
        text = await self._request("GET", "/metrics")
        try:
            return await asyncio.to_thread(parse_server_metrics, text)
        except ValueError as exc:
            raise UpstreamError("protocol", f"GET /metrics: {exc}") from exc

    async def tokenize(self, payload: Mapping[str, Any],
                       request_id: str | None = None) -> Tokenized:
        """The token ids the server will see for a prompt or chat messages (the server
        logs the call as `tokenize-<request_id>`)."""
        headers = {"X-Request-Id": request_id} if request_id else None
        data = await self._json("POST", "/tokenize", payload, headers)
        count = data.get("count") if isinstance(data, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise UpstreamError("protocol", "POST /tokenize: no 'count'")
        tokens = data.get("tokens")
        if not (isinstance(tokens, list) and len(tokens) == count
                and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
            return Tokenized(count, None)
        return Tokenized(count, tuple(tokens))

    async def forward(self, method: str, path_qs: str, body: bytes | None,
                      headers: Iterable[tuple[str, str]],
                      read_timeout_s: float | None) -> ForwardResponse:
        """Send a client's request on as it is; the response's body is not read: the
        caller streams it back and closes it."""
        return await self.forwarding.request(method, path_qs, headers, body, read_timeout_s)

    def connections(self) -> dict[str, int]:
        """Connections to the server, in use and idle: the forwarding pool's and those
        of kvgate's own questions (token ids, metrics, models) together."""
        forwarding = self.forwarding.counts()
        connector = self.session.connector
        # aiohttp keeps no public count: its pool's in-use set and idle lists.
        acquired = getattr(connector, "_acquired", ())
        idle = getattr(connector, "_conns", {})
        return {"active": forwarding["active"] + len(acquired),
                "idle": forwarding["idle"] + sum(len(c) for c in idle.values())}

    async def version(self) -> str | None:
        """The server's version (vLLM's GET /version), or None if it does not say."""
        try:
            data = await self._json("GET", "/version")
        except UpstreamError:
            return None
        version = data.get("version") if isinstance(data, dict) else None
        return version if isinstance(version, str) else None
