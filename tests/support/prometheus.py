"""Start and stop a real Prometheus server (and find promtool) for tests.

Standard library only. Prometheus and promtool come from the distribution's
``prometheus`` package (Debian: ``apt-get install prometheus``; ``scripts/check``
installs it). Nothing here skips: a missing binary raises ``ToolMissing``, whose
message says how to install it.

    with PrometheusServer(19090, targets=["127.0.0.1:8080"]) as prom:
        prom.wait_for("kvgate_upstream_up")          # first scrape landed
        result = prom.query("sum(kvgate_inflight_requests)")

The server listens on 127.0.0.1 only, scrapes every target every second (job
``kvgate`` unless given), keeps its TSDB in a temporary directory removed on stop,
and can load rule files (evaluated every second) so alert expressions can be
checked through the HTTP API as well.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "PrometheusError",
    "PrometheusServer",
    "ToolMissing",
    "prometheus_path",
    "promtool_path",
]

DEFAULT_STARTUP_TIMEOUT = 30.0
INSTALL_HINT = (
    "run `bash scripts/check` once (it installs the distribution's `prometheus` package, "
    "which provides prometheus and promtool), or `apt-get install prometheus`"
)


class ToolMissing(RuntimeError):
    """prometheus or promtool is not installed."""


class PrometheusError(RuntimeError):
    """The server did not start, or a query failed."""


def _find(name: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/bin") / name, Path("/usr/local/bin") / name) if p.exists()),
        None,
    )
    if found is None:
        raise ToolMissing(f"{name} not found on PATH: {INSTALL_HINT}")
    return found


def promtool_path() -> str:
    """Absolute path of promtool; raises ToolMissing with install instructions."""
    return _find("promtool")


def prometheus_path() -> str:
    """Absolute path of the prometheus server; raises ToolMissing likewise."""
    return _find("prometheus")


def _scrape_config(
    targets: Sequence[str], job: str, metrics_path: str, rule_files: Sequence[Path]
) -> str:
    # JSON is YAML: no YAML library needed.
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": metrics_path,
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }
    return json.dumps(config, indent=2)


class PrometheusServer:
    """A Prometheus server on 127.0.0.1:``port``, for the duration of a ``with`` block."""

    def __init__(
        self,
        port: int,
        targets: Sequence[str],
        *,
        job: str = "kvgate",
        metrics_path: str = "/metrics",
        rule_files: Sequence[str | Path] = (),
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.targets = list(targets)
        self.job = job
        self.metrics_path = metrics_path
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.startup_timeout = startup_timeout
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        # How the last server exited: 0 when SIGTERM stopped it cleanly, -9 when it
        # had to be killed.
        self.exit_code: int | None = None
        self._log_path: Path | None = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> PrometheusServer:
        if self._proc is not None:
            raise PrometheusError("already started")
        binary = prometheus_path()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-prometheus-")
        workdir = Path(self._tmp.name)
        config = workdir / "prometheus.yml"
        config.write_text(
            _scrape_config(self.targets, self.job, self.metrics_path, self.rule_files),
            encoding="utf-8",
        )
        self._log_path = workdir / "prometheus.log"
        command = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self._log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"prometheus not ready on {self.url} after {self.startup_timeout:.0f}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and remove its storage."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc is not None:
            self.exit_code = proc.returncode
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def workdir(self) -> Path | None:
        """The temporary directory with config, log and TSDB (None when stopped)."""
        return Path(self._tmp.name) if self._tmp is not None else None

    def log_tail(self, lines: int = 30) -> str:
        if self._log_path is None or not self._log_path.exists():
            return "(no log)"
        text = self._log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # --- HTTP API ----------------------------------------------------------------------

    def api(self, endpoint: str, **params: str) -> Any:
        """GET /api/v1/<endpoint>; returns ``data`` of a success, raises otherwise."""
        url = f"{self.url}/api/v1/{endpoint}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            # Bad queries answer 400/422 with an error body.
            with error:
                body = json.load(error)
        if body.get("status") != "success":
            raise PrometheusError(
                f"{endpoint} {params}: {body.get('errorType')}: {body.get('error')}"
            )
        return body["data"]

    def query(self, expr: str, time_: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the ``result`` list (vector) or ``[result]`` (scalar, string)."""
        params = {"query": expr}
        if time_ is not None:
            params["time"] = f"{time_:.3f}"
        data = self.api("query", **params)
        result = data["result"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return list(result)

    def query_range(
        self, expr: str, start: float, end: float, step: str = "1s"
    ) -> list[dict[str, Any]]:
        """Range query; the ``result`` matrix."""
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=step
        )
        return list(data["result"])

    def wait_for(self, expr: str, timeout: float = 15.0) -> list[dict[str, Any]]:
        """Poll an instant query until it returns data.

        Prometheus 2.x hands new targets to the scrape loop after its 5 s discovery
        throttle: the first scrape lands about 5 s after start.
        """
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"no data for {expr!r} after {timeout:.0f}s")
            time.sleep(0.2)

    def targets_health(self) -> list[dict[str, Any]]:
        """The active scrape targets (``health``, ``lastError``, ``scrapeUrl``...)."""
        return list(self.api("targets")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        """The loaded rule groups with their rules' health and last errors."""
        return list(self.api("rules")["groups"])
