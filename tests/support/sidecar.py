"""Run `kvgate serve` as a real process for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from support.access import read_access_log
from support.env import PYTHON, free_port

# The CPU these tests run on, as kvgate's custom device figures (calibration refines them).
CPU_DEVICE = ("--gpu-memory-gib", "24", "--gpu-bandwidth-gbps", "20", "--gpu-tflops", "0.5")
# The server these tests run: vLLM's CPU build, which schedules without asynchronous
# scheduling.
CPU_SERVER = ("--no-async-scheduling",)
# Every sidecar a test made, for the access-log check (`support.access`).
SIDECARS: list[Sidecar] = []


class Sidecar:
    def __init__(self, upstream: str, *args: str, port: int | None = None,
                 env: dict[str, str] | None = None,
                 device: Sequence[str] = CPU_DEVICE) -> None:
        """`device`: the device flags (default this CPU's figures; () for none: the
        generic device)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [PYTHON, "-m", "sidecar", "serve", "--upstream", upstream, "--host",
                     "127.0.0.1", "--port", str(self.port), *device, *CPU_SERVER, *args]
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(prefix="kvgate-", suffix=".log", delete=False)
        # The access log in a file of its own, unless the test says where it goes.
        self.access_log: str | None = None
        if "--access-log" not in args:
            self.access_log = self.log.name.removesuffix(".log") + ".access.log"
            self.args += ["--access-log", self.access_log]
        self.proc: subprocess.Popen[bytes] | None = None
        SIDECARS.append(self)

    def start(self, ready_timeout_s: float = 60.0, wait_ready: bool = True) -> Sidecar:
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env)
        if wait_ready:
            try:
                self.wait_ready(ready_timeout_s)
            except BaseException:
                self.stop()  # never leave a process behind that did not get ready
                raise
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate exited {self.proc.returncode}:\n{self.log_text()}")
            status, _ = self.get("/readyz")
            if status == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"kvgate not ready after {timeout_s} s:\n{self.log_text()}")

    def get(self, path: str, timeout: float = 5.0,
            headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def state(self) -> dict[str, Any]:
        status, body = self.get("/kvgate/v1/state")
        assert status == 200, body
        data: dict[str, Any] = json.loads(body)
        return data

    def metrics_text(self) -> str:
        return self.get("/metrics")[1]

    def metric(self, name: str, labels: str = "") -> float:
        return metric_value(self.metrics_text(), name, labels)

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until nothing is admitted or queued; return the final state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            admission = state["admission"]
            if admission["inflight"] == 0 and admission["queue"]["length"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"kvgate not idle: {admission}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.log.close()
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.log.close()

    def access_lines(self) -> list[dict[str, Any]]:
        """The access log's lines so far (written within ~50 ms of each request's end)."""
        assert self.access_log is not None, "the access log is not in a file"
        if not os.path.exists(self.access_log):
            return []
        return read_access_log(self.access_log)

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as handle:
            return handle.read()[-6000:]

    def __enter__(self) -> Sidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample, e.g. metric_value(t, "kvgate_requests_total",
    'outcome="admitted"'); summed over label sets when `labels` is empty."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series = head[len(name):]
        if series and not series.startswith("{"):
            continue
        if labels and labels not in series:
            continue
        total += float(value)
        found = True
    if not found:
        raise KeyError(f"{name}{{{labels}}} not in metrics")
    return total


def args(*pairs: Sequence[str]) -> list[str]:
    return [item for pair in pairs for item in pair]


def released(sidecar: Sidecar) -> bool:
    """Nothing reserved, admitted or queued in kvgate."""
    admission = sidecar.state()["admission"]
    return (admission["ledger"]["reserved_blocks"] == 0 and admission["inflight"] == 0
            and admission["queue"]["length"] == 0)


def running_on(server: Any) -> float:
    """vLLM's own count of running requests (a `VllmServer`)."""
    return metric_value(server.metrics_text(), "vllm:num_requests_running")


def generated_on(server: Any) -> float:
    """The tokens vLLM has generated so far, over all requests (a `VllmServer`). A
    request aborted mid-answer adds fewer than its max_tokens; vLLM counts an aborted
    request in no `vllm:request_success_total` reason."""
    return metric_value(server.metrics_text(), "vllm:generation_tokens_total")
