"""The upstream vLLM server: its client, a metrics snapshot, and a watcher."""

from sidecar.upstream.client import ModelInfo, Tokenized, UpstreamClient, UpstreamError
from sidecar.upstream.engine import Engine
from sidecar.upstream.server_metrics import CacheConfig, ServerMetrics, parse_server_metrics
from sidecar.upstream.watcher import UpstreamView, UpstreamWatcher

__all__ = [
    "CacheConfig",
    "Engine",
    "ModelInfo",
    "ServerMetrics",
    "Tokenized",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamView",
    "UpstreamWatcher",
    "parse_server_metrics",
]
