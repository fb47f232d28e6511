"""Helpers shared by the benchmarks: processes, ports, CPU time, statistics, output.

Standard library only (the benchmarks' own clients and servers use aiohttp), so that
`bench/loadgen.py` starts fast in its own process.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# The project's machines allow these ports for benchmarks and tests.
PORT_RANGE = (20000, 20999)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """A benchmark cannot run (missing tool, server that does not start)."""


# ---- ports -----------------------------------------------------------------------------

_taken: set[int] = set()


def free_port(low: int = PORT_RANGE[0], high: int = PORT_RANGE[1]) -> int:
    """A loopback port in [low, high] nobody listens on (and not handed out before)."""
    candidates = list(range(low, high + 1))
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        if port in _taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise BenchError(f"no free port in {low}-{high}")


# ---- processes ---------------------------------------------------------------------------


class Process:
    """A child process in its own session (so stop() reaches its children), with its
    output in a log file. Use as a context manager: it is always stopped."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def start(self) -> Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"===== {time.strftime('%F %T')} {shlex.join(self.argv)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, cwd=self.cwd, start_new_session=True,
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL after the timeout; reap."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Children that outlived their parent (same process group).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> Process:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode("utf-8", "replace"))


def wait_http(url: str, process: Process | None = None, timeout_s: float = 30.0,
              ok: tuple[int, ...] = (200,)) -> None:
    """Poll `url` until it answers one of `ok`; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and not process.alive():
            raise BenchError(f"{process.name} exited during start-up (log {process.log_path}):\n"
                             f"{process.log_tail()}")
        if http_status(url) in ok:
            return
        if time.monotonic() > deadline:
            tail = process.log_tail() if process is not None else ""
            raise BenchError(f"{url} did not answer {ok} within {timeout_s:.0f} s\n{tail}")
        time.sleep(0.1)


# ---- CPU time ------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces.
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the name: state(0) ppid(1) ... utime(11) stime(12).
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for child in children.get(current, []):
            found.append(child)
            todo.append(child)
    return found


def tree_cpu_seconds(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def system_cpu_seconds() -> float:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


class OtherLoad:
    """The share of the machine's CPUs that other processes took between `start()` and
    `share()`: everything busy less this process, `pids` and all their descendants
    (each counted once). A run measured beside someone else's load measured the
    machine, not what it set out to."""

    def __init__(self, pids: Sequence[int] = ()) -> None:
        self.pids = (os.getpid(), *pids)
        self._started = (time.monotonic(), system_cpu_seconds(), self._own())

    def _own(self) -> float:
        own = set(self.pids)
        for pid in self.pids:
            own.update(descendants(pid))
        return tree_cpu_seconds(sorted(own))

    def start(self) -> None:
        self._started = (time.monotonic(), system_cpu_seconds(), self._own())

    def share(self) -> float:
        wall_before, machine_before, own_before = self._started
        wall = max(1e-9, time.monotonic() - wall_before)
        other = max(0.0, (system_cpu_seconds() - machine_before) - (self._own() - own_before))
        return other / wall / (os.cpu_count() or 1)


class QuietBudget:
    """A bounded total of waiting for a quiet machine, spent run by run."""

    def __init__(self, total_s: float, per_run_s: float, window_s: float = 2.0) -> None:
        self.remaining_s = max(0.0, total_s)
        self.per_run_s = per_run_s
        self.window_s = window_s

    def wait(self) -> float:
        waited = wait_quiet(min(self.per_run_s, self.remaining_s), window_s=self.window_s)
        self.remaining_s = max(0.0, self.remaining_s - waited)
        return waited


def wait_quiet(max_wait_s: float, threshold: float = 0.25, window_s: float = 2.0) -> float:
    """Wait (at most `max_wait_s`) until the machine's CPUs are busy less than
    `threshold` of the time over `window_s`: on a shared machine, other people's work
    would otherwise land in the measurement. Returns the seconds waited."""
    if max_wait_s <= 0:
        return 0.0
    started = time.monotonic()
    cores = os.cpu_count() or 1
    while True:
        before, at = system_cpu_seconds(), time.monotonic()
        time.sleep(window_s)
        busy = (system_cpu_seconds() - before) / ((time.monotonic() - at) * cores)
        waited = time.monotonic() - started
        if busy < threshold or waited >= max_wait_s:
            return waited


# ---- statistics ----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 = equal shares."""
    if not values:
        return None
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return None
    return float(sum(values) ** 2 / (len(values) * square_sum))


# ---- the record of a run ------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    return {
        "cpu_model": model,
        "cpu_cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def kvgate_revision(root: Path = ROOT) -> dict[str, Any]:
    """Which kvgate was measured (this checkout's, or `root`'s): the commit, whether
    sidecar/ differs from it, a hash of sidecar/'s Python sources (identifies
    uncommitted code too), and how many of its modules are built compiled in place
    (setup.py, KVGATE_COMPILE=1; 0: pure Python)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((root / "sidecar").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    info: dict[str, Any] = {"sidecar_sources_sha256": digest.hexdigest()[:16],
                            "compiled_modules": len(list((root / "sidecar").rglob("*.so")))}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                        text=True, capture_output=True,
                                        check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "sidecar"], cwd=root,
                                text=True, capture_output=True, check=True).stdout.strip()
        info["sidecar_uncommitted_changes"] = bool(status)
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(script: str) -> str:
    """The command that reproduces this run, as typed from the repository root."""
    return shlex.join(["python", script, *sys.argv[1:]])


def provenance(script: str) -> dict[str, Any]:
    """What every result file records: the command, when, on what, which kvgate."""
    return {"command": command_line(script), "date": now_utc(), "machine": machine_info(),
            "kvgate_revision": kvgate_revision()}


def benchmark_main(script: str, parse_args: Callable[[], Any],
                   benchmark: Callable[[Any], dict[str, Any]],
                   print_report: Callable[[dict[str, Any]], None]) -> int:
    """A benchmark's command: run it, write its JSON to `args.out`, print its tables;
    or, as `SCRIPT --report FILE`, print the tables of a result file again."""
    if len(sys.argv) == 3 and sys.argv[1] == "--report":
        print_report(json.loads(Path(sys.argv[2]).read_text()))
        return 0
    args = parse_args()
    try:
        report = benchmark(args)
    except BenchError as exc:
        sys.stderr.write(f"{script}: error: {exc}\n")
        return 1
    write_json(Path(args.out), report)
    print_report(report)
    print(f"\nwrote {args.out}")
    return 0


def provenance_line(report: Mapping[str, Any]) -> str:
    """The run record as one line: command, UTC date, machine, kvgate revision."""
    machine = report["machine"]
    return (f"{report['command']}  ({report['date']}, {machine['cpu_model']}, "
            f"{machine['cpu_cores']} cores, revision {report['kvgate_revision'].get('commit')})")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def render_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True))
             + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
              for row in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}" if abs(value) >= 100 \
            else f"{value:.1f}"
    return str(value)


@contextlib.contextmanager
def temporary_directory(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A scratch directory for configs and logs; kept if `keep` (for debugging)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
