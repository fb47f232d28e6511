"""Read vLLM's `/metrics` into a typed snapshot.

Parsed with `prometheus_client.parser`, never with regexes; only the lines of the
families read here are handed to it (histogram buckets, the bulk of the text, are
not), which makes a scrape several times cheaper. vLLM renamed some
metrics over time; each field lists the names it accepts, newest first:
`vllm:kv_cache_usage_perc` (older `vllm:gpu_cache_usage_perc`),
`vllm:inter_token_latency_seconds` (older `vllm:time_per_output_token_seconds`).
Samples are summed over engines (data-parallel ranks) and models.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class HistogramTotals:
    """A histogram's cumulative sum and count (rates come from two snapshots)."""

    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: HistogramTotals) -> HistogramTotals:
        return HistogramTotals(self.sum - earlier.sum, self.count - earlier.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True)
class CacheConfig:
    """The labels of `vllm:cache_config_info`."""

    block_size: int | None = None
    num_gpu_blocks: int | None = None
    cache_dtype: str | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    sliding_window: int | None = None
    enable_prefix_caching: bool | None = None


@dataclass(frozen=True)
class ServerMetrics:
    kv_usage_ratio: float | None = None
    running: int | None = None
    waiting: int | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_cache_queries_total: float | None = None  # prompt tokens looked up
    prefix_cache_hits_total: float | None = None  # of which found in the prefix cache
    cache: CacheConfig = field(default_factory=CacheConfig)
    histograms: dict[str, HistogramTotals] = field(default_factory=dict)

    @property
    def used_blocks(self) -> int | None:
        """Blocks in use: vLLM's usage is over num_gpu_blocks - 1 (the null block)."""
        blocks = self.cache.num_gpu_blocks
        if self.kv_usage_ratio is None or blocks is None:
            return None
        return round(self.kv_usage_ratio * max(0, blocks - 1))


# Canonical name -> accepted metric family names, newest first.
GAUGES = {
    "kv_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}
COUNTERS = {
    "preemptions_total": ("vllm:num_preemptions",),
    "prompt_tokens_total": ("vllm:prompt_tokens",),
    "generation_tokens_total": ("vllm:generation_tokens",),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "tpot": ("vllm:request_time_per_output_token_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "iteration_tokens": ("vllm:iteration_tokens_total",),
    "prompt_tokens": ("vllm:request_prompt_tokens",),
    "generation_tokens": ("vllm:request_generation_tokens",),
}


def _int(value: str | None) -> int | None:
    if value is None or value in ("None", ""):
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def _float(value: str | None) -> float | None:
    if value is None or value in ("None", ""):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _cache_config(labels: dict[str, str]) -> CacheConfig:
    prefix = labels.get("enable_prefix_caching")
    return CacheConfig(
        block_size=_int(labels.get("block_size")),
        num_gpu_blocks=_int(labels.get("num_gpu_blocks")),
        cache_dtype=labels.get("cache_dtype"),
        kv_cache_size_tokens=_int(labels.get("kv_cache_size_tokens")),
        kv_cache_max_concurrency=_float(labels.get("kv_cache_max_concurrency")),
        kv_cache_memory_bytes=_int(labels.get("kv_cache_memory_bytes")),
        gpu_memory_utilization=_float(labels.get("gpu_memory_utilization")),
        sliding_window=_int(labels.get("sliding_window")),
        enable_prefix_caching=None if prefix is None else prefix == "True",
    )


def _by_name(families: Iterable[Metric]) -> dict[str, Metric]:
    found: dict[str, Metric] = {}
    for family in families:
        found.setdefault(family.name, family)
    return found


def _total(family: Metric, suffix: str = "") -> float:
    # The parser strips `_total` from counter family names; untyped families keep it.
    wanted = {family.name + suffix, family.name} if suffix == "_total" else {family.name + suffix}
    return sum(s.value for s in family.samples if s.name in wanted)


INFO_FAMILIES = ("vllm:cache_config_info", "vllm:cache_config")


def _read_lines() -> tuple[frozenset[str], tuple[str, ...]]:
    """The family names whose `# HELP` / `# TYPE` lines are kept, and the starts of the
    sample lines kept: gauges and info whole, counters' `_total`, histograms' `_sum`
    and `_count`."""
    families: set[str] = set(INFO_FAMILIES)
    samples: set[str] = set(INFO_FAMILIES)
    for names in GAUGES.values():
        families.update(names)
        samples.update(names)
    for names in COUNTERS.values():
        for name in names:
            families.update((name, name + "_total"))
            samples.update((name, name + "_total"))
    for names in HISTOGRAMS.values():
        for name in names:
            families.add(name)
            samples.update((name + "_sum", name + "_count"))
    starts = tuple(sorted(f"{name}{sep}" for name in samples for sep in ("{", " ")))
    return frozenset(families), starts


_FAMILIES, _SAMPLE_STARTS = _read_lines()


def read_lines(text: str) -> str | None:
    """The lines of `text` that `parse_server_metrics` reads; None when no sample line
    is among them (not vLLM's metrics, or not an exposition at all)."""
    kept = []
    samples = 0
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[2] in _FAMILIES:
                kept.append(line)
        elif line.startswith(_SAMPLE_STARTS):
            kept.append(line)
            samples += 1
    if not samples:
        return None
    kept.append("")
    return "\n".join(kept)


def parse_server_metrics(text: str, *, all_lines: bool = False) -> ServerMetrics:
    """Parse vLLM's exposition text (only the lines read, unless `all_lines`). Raises
    ValueError on text that is not one."""
    read = None if all_lines else read_lines(text)
    # Without a line to read, the whole text is parsed: it raises if it is not an
    # exposition at all.
    families = _by_name(text_string_to_metric_families(text if read is None else read))
    values: dict[str, float | None] = {}
    for canonical, names in GAUGES.items():
        family = next((families[n] for n in names if n in families), None)
        values[canonical] = _total(family) if family is not None else None
    for canonical, names in COUNTERS.items():
        family = next((families[n] for n in names if n in families), None)
        values[canonical] = _total(family, "_total") if family is not None else None
    histograms = {}
    for canonical, names in HISTOGRAMS.items():
        family = next((families[n] for n in names if n in families), None)
        if family is not None:
            histograms[canonical] = HistogramTotals(_total(family, "_sum"),
                                                    _total(family, "_count"))
    cache = CacheConfig()
    info = families.get("vllm:cache_config_info") or families.get("vllm:cache_config")
    if info is not None and info.samples:
        cache = _cache_config(dict(info.samples[0].labels))
    # Usage is a ratio per engine: average, not sum, over engines.
    usage_family = next((families[n] for n in GAUGES["kv_usage_ratio"] if n in families), None)
    usage = None
    if usage_family is not None and usage_family.samples:
        usage = sum(s.value for s in usage_family.samples) / len(usage_family.samples)
    running, waiting = values["running"], values["waiting"]
    return ServerMetrics(
        kv_usage_ratio=usage,
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        preemptions_total=values["preemptions_total"],
        prompt_tokens_total=values["prompt_tokens_total"],
        generation_tokens_total=values["generation_tokens_total"],
        prefix_cache_queries_total=values["prefix_cache_queries_total"],
        prefix_cache_hits_total=values["prefix_cache_hits_total"],
        cache=cache,
        histograms=histograms,
    )
