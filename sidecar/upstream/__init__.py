"""The upstream vLLM server: its client, the forwarding pool, a metrics snapshot, and a
watcher."""

from sidecar.upstream.client import ModelInfo, Tokenized, UpstreamClient, UpstreamError
from sidecar.upstream.engine import Engine
from sidecar.upstream.forward_errors import (
    ForwardError,
    UpstreamBroke,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from sidecar.upstream.http1 import ForwardResponse, Http1Pool
from sidecar.upstream.server_metrics import CacheConfig, ServerMetrics, parse_server_metrics
from sidecar.upstream.watcher import UpstreamView, UpstreamWatcher

__all__ = [
    "CacheConfig",
    "Engine",
    "ForwardError",
    "ForwardResponse",
    "Http1Pool",
    "ModelInfo",
    "ServerMetrics",
    "Tokenized",
    "UpstreamBroke",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "UpstreamView",
    "UpstreamWatcher",
    "parse_server_metrics",
]
