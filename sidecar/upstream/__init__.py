"""The upstream vLLM server: its client, a metrics snapshot, and a watcher."""

from sidecar.upstream.client import ModelInfo, UpstreamClient, UpstreamError
from sidecar.upstream.server_metrics import CacheConfig, ServerMetrics, parse_server_metrics
from sidecar.upstream.watcher import UpstreamView, UpstreamWatcher

__all__ = [
    "CacheConfig",
    "ModelInfo",
    "ServerMetrics",
    "UpstreamClient",
    "UpstreamError",
    "UpstreamView",
    "UpstreamWatcher",
    "parse_server_metrics",
]
