"""A real Prometheus scrapes kvgate and a real vLLM CPU server during a load run;
every dashboard panel query and every alert expression is evaluated through its HTTP
API: each parses, and each panel query returns data. `promtool check metrics` finds
no naming problem in kvgate's /metrics."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from dashboards.queries import panel_targets, rule_expressions, substitute
from support.env import free_port
from support.load import burst
from support.prometheus import PrometheusError, PrometheusServer, promtool_path
from support.sidecar import Sidecar
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "kvgate.json"
RULES = ROOT / "deploy" / "prometheus" / "kvgate-rules.yaml"


def hostport(url: str) -> str:
    return url.removeprefix("http://")


def test_dashboard_and_alerts_against_real_prometheus(
    small_kv_vllm: VllmServer, tmp_path: Path
) -> None:
    # Subscribed to KV cache events nobody publishes: the events panels have data (stale,
    # never received) without a second server.
    events = f"ipc://{tmp_path / 'kv-events.sock'}"
    with Sidecar(small_kv_vllm.url, "--queue-max-length", "2",
                 "--kv-events-endpoint", events) as sidecar, PrometheusServer(
        free_port(), [hostport(sidecar.url), hostport(small_kv_vllm.url)], rule_files=[RULES]
    ) as prometheus:
        prometheus.wait_for("kvgate_upstream_up", timeout=30)
        prometheus.wait_for("vllm:num_requests_running", timeout=30)
        started = time.monotonic()
        # Two bursts a few seconds apart: admissions, queueing and queue-full rejections,
        # streamed so that TTFT/TPOT are observed, while Prometheus scrapes every second.
        results = asyncio.run(burst(sidecar.url, count=16, max_tokens=120))
        results += asyncio.run(burst(sidecar.url, count=12, max_tokens=60))
        assert any(r["status"] == 200 for r in results)
        assert any(r["status"] == 429 for r in results), "the load should fill the queue"
        time.sleep(max(0.0, 20 - (time.monotonic() - started)))

        empty = []
        for title, expr in panel_targets(DASHBOARD):
            query = substitute(expr)
            try:
                data = prometheus.query(query)
            except PrometheusError as exc:
                pytest.fail(f"panel {title!r}: {query!r} failed: {exc}")
            if not data:
                empty.append(f"{title}: {query}")
        assert not empty, "panels without data:\n" + "\n".join(empty)

        for expr in rule_expressions(RULES):
            prometheus.query(expr)  # raises on a parse or evaluation error
        rules = prometheus.rules()
        assert rules, "the rules file was not loaded"

        text = sidecar.metrics_text()
    check = subprocess.run([promtool_path(), "check", "metrics"], input=text,
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr
