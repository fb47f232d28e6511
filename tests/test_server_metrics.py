"""vLLM's /metrics read into a snapshot: only the lines of the families kvgate reads go
to the exposition parser (the histograms' buckets, most of the text, do not), and the
snapshot is the one the whole text gives, on a real scrape and on the variants vLLM
has served (older metric names, several engines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar.upstream.server_metrics import parse_server_metrics, read_lines

SCRAPE = (Path(__file__).parent / "data" / "vllm_metrics" / "cpu-0.32.0.txt").read_text()


def two_engines(text: str) -> str:
    """Every sample again for a second engine (data parallelism), its values doubled
    and the KV usage set apart, so that sums and the usage's mean can be told."""
    lines = []
    for line in text.splitlines():
        lines.append(line)
        if line.startswith("#") or 'engine="0"' not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        other = name_labels.replace('engine="0"', 'engine="1"')
        if "kv_cache_usage_perc" in line:
            lines.append(f"{other} 0.5")
        else:
            lines.append(f"{other} {float(value) * 2!r}")
    return "\n".join(lines) + "\n"


def older_names(text: str) -> str:
    """The names vLLM served before 0.10: GPU cache usage, time per output token."""
    return (text.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
            .replace("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
            .replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_"))


@pytest.mark.parametrize("variant", [lambda t: t, two_engines, older_names,
                                     lambda t: older_names(two_engines(t))],
                         ids=["as served", "two engines", "older names", "both"])
def test_reading_only_the_families_used_changes_nothing(variant) -> None:  # type: ignore[no-untyped-def]
    text = variant(SCRAPE)
    assert parse_server_metrics(text) == parse_server_metrics(text, all_lines=True)


def test_the_snapshot_is_what_the_scrape_says() -> None:
    metrics = parse_server_metrics(SCRAPE)

    def sample(name: str) -> float:
        found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", SCRAPE, re.MULTILINE)
        assert found is not None, name
        return float(found.group(1))

    assert metrics.prompt_tokens_total == sample("vllm:prompt_tokens_total") > 0
    assert metrics.generation_tokens_total == sample("vllm:generation_tokens_total") > 0
    assert metrics.histograms["prefill"].count == sample(
        "vllm:request_prefill_time_seconds_count") == 6
    assert metrics.histograms["itl"].sum == pytest.approx(
        sample("vllm:inter_token_latency_seconds_sum"))
    assert metrics.cache.block_size == 128 and metrics.cache.enable_prefix_caching is True
    assert metrics.running == 0 and metrics.kv_usage_ratio == 0.0
    doubled = parse_server_metrics(two_engines(SCRAPE))
    assert doubled.prompt_tokens_total == 3 * sample("vllm:prompt_tokens_total")
    assert doubled.kv_usage_ratio == pytest.approx(0.25)  # the mean over engines


def test_buckets_and_other_families_are_not_parsed() -> None:
    read = read_lines(SCRAPE)
    assert read is not None
    assert "_bucket" not in read and "vllm:prompt_tokens_by_source" not in read
    assert len(read) < len(SCRAPE) / 5


def test_text_that_is_not_an_exposition_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_server_metrics("<html><body>not metrics</body></html>")
    # An exposition without vLLM's families: nothing known, nothing invented.
    other = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n"
    assert parse_server_metrics(other) == parse_server_metrics(other, all_lines=True)
    assert parse_server_metrics(other).running is None
