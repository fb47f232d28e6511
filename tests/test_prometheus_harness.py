"""The test harness starts a real Prometheus, scrapes, answers queries and stops."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

from support.prometheus import (
    PrometheusError,
    PrometheusServer,
    ToolMissing,
    prometheus_path,
    promtool_path,
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_binaries_are_installed() -> None:
    try:
        assert promtool_path().endswith("promtool")
        assert prometheus_path().endswith("prometheus")
    except ToolMissing as error:
        pytest.fail(str(error), pytrace=False)


def test_scrapes_itself_and_answers_queries() -> None:
    try:
        prometheus_path()
    except ToolMissing as error:
        pytest.fail(str(error), pytrace=False)
    port = _free_port()
    with PrometheusServer(port, targets=[f"127.0.0.1:{port}"], job="self") as prom:
        result = prom.wait_for('up{job="self"} == 1', timeout=12)
        assert result[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        assert result[0]["value"][1] == "1"
        # Its own metrics arrived with the scrape.
        build = prom.wait_for('prometheus_build_info{job="self"}', timeout=5)
        assert build[0]["metric"]["version"]
        assert prom.targets_health()[0]["health"] == "up"
        assert prom.query("1 + 1")[0]["value"][1] == "2"
        with pytest.raises(PrometheusError, match="parse error"):
            prom.query("sum(rate(")
        workdir = prom.workdir
        assert workdir is not None and (workdir / "data").is_dir()
    # Stopped: nothing listens, storage removed.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
    assert not workdir.exists()
    assert prom.workdir is None
    # SIGTERM stopped it: it did not have to be killed after the grace period.
    assert prom.exit_code == 0
