"""Start and stop a real vLLM (CPU build) OpenAI server for tests.

Standard library only: importable from the project's own test venv, which has
no vllm.  The server runs under *another* interpreter (``python_exe``, the
vLLM venv's python) in its own process group, so stop()/kill() take down the
API server and its engine-core / worker children together.

    with VllmServer(VLLM_PY, model_dir, "tiny-llama", 18001, max_model_len=1024,
                    block_size=32, num_gpu_blocks_override=64) as srv:
        info = srv.kv_cache_info()       # parsed start-up KV figures
        requests.get(srv.url + "/v1/models")

Defaults chosen for a 2-core CPU box (measured, see the research notes):
``--enforce-eager`` (no torch.compile / dynamo; with an explicit KV size vLLM
then also skips the warm-up pass: ~16 s to healthy instead of ~42 s),
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``fast_start``: the model runs inside the
EngineCore process, no extra VLLM::Worker process: ~10 s and ~0.6 GB saved),
``VLLM_CPU_KVCACHE_SPACE=1`` unless a KV size is given (the auto size would
claim ~0.92 x the NUMA node's memory), thread binding left to vLLM's
``VLLM_CPU_OMP_THREADS_BIND=auto`` (1 OMP thread on core 0, core 1 reserved),
usage stats disabled, no hub look-ups (``HF_HUB_OFFLINE=1``), no AMX kernels
(``vllm_site/sitecustomize.py``: they die with SIGILL now and then on VMs that
advertise AMX; ``KVGATE_VLLM_AMX=1`` keeps them).  Everything else
is vLLM's own default (block size 128 on CPU unless ``block_size`` is given,
max_num_batched_tokens 2048, max_num_seqs 128).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["KvCacheStartupInfo", "VllmServer", "VllmServerError", "parse_kv_cache_log"]

DEFAULT_STARTUP_TIMEOUT = 180.0

# "CPU KV cache size: 2,048 tokens, Maximum concurrency for 1,024 tokens per
#  request: 2.00x"  (vllm/v1/core/kv_cache_utils.py update_kv_cache_capacity;
#  numbers use thousands separators, concurrency is "%.2f").
_KV_SIZE_RE = re.compile(
    r"(?P<device>[A-Za-z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, "
    r"Maximum concurrency for (?P<mml>[\d,]+) tokens per request: "
    r"(?P<conc>[\d,]+\.\d+)x"
)
# "Overriding num_gpu_blocks=7281 with num_gpu_blocks_override=64"
_OVERRIDE_RE = re.compile(
    r"Overriding num_gpu_blocks=(?P<computed>\d+) with "
    r"num_gpu_blocks_override=(?P<override>\d+)"
)
# Older vLLM: "# CPU blocks: 1234" / "# GPU blocks: 1234"
_NUM_BLOCKS_RE = re.compile(r"# (?:CPU|GPU|cpu|gpu) blocks: (?P<n>\d+)")
# cpu_worker.determine_available_memory
_EXPLICIT_KV_RE = re.compile(
    r"Explicitly set \((?P<kv>[\d.]+)/(?P<total>[\d.]+)\) GiB for KV cache"
)
_AUTO_KV_RE = re.compile(r"Auto set \((?P<kv>[\d.]+)/(?P<total>[\d.]+)\) GiB for KV cache")


class VllmServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class KvCacheStartupInfo:
    tokens: int                      # "KV cache size: N tokens"
    concurrency: float               # "Maximum concurrency ...: X.XXx" (2 decimals)
    concurrency_text: str            # exactly as printed, e.g. "2.00"
    max_model_len: int               # "for L tokens per request"
    device: str                      # "CPU" (or "GPU")
    line: str                        # the raw log line
    num_blocks_computed: int | None = None  # "Overriding num_gpu_blocks=A ..." -> A
    num_blocks_override: int | None = None  # "... num_gpu_blocks_override=B" -> B
    num_blocks_logged: int | None = None    # older vLLM "# CPU blocks: N"
    kv_cache_gib_logged: float | None = None  # "Explicitly/Auto set (X/...) GiB"

    @property
    def num_blocks(self) -> int | None:
        """Blocks in vLLM's pool (incl. its null block), if the log says so."""
        if self.num_blocks_override is not None:
            return self.num_blocks_override
        return self.num_blocks_logged


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def parse_kv_cache_log(text: str) -> KvCacheStartupInfo | None:
    """Parse the KV-cache figures vLLM prints at start-up (last occurrence)."""
    matches = list(_KV_SIZE_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    line_start = text.rfind("\n", 0, m.start()) + 1
    line_end = text.find("\n", m.end())
    line = text[line_start: line_end if line_end != -1 else len(text)].strip()
    computed = override = logged = None
    if om := list(_OVERRIDE_RE.finditer(text)):
        computed = int(om[-1]["computed"])
        override = int(om[-1]["override"])
    if nm := list(_NUM_BLOCKS_RE.finditer(text)):
        logged = int(nm[-1]["n"])
    gib = None
    if km := list(_EXPLICIT_KV_RE.finditer(text)) or list(_AUTO_KV_RE.finditer(text)):
        gib = float(km[-1]["kv"])
    conc_text = m["conc"].replace(",", "")
    return KvCacheStartupInfo(
        tokens=_int(m["tokens"]),
        concurrency=float(conc_text),
        concurrency_text=conc_text,
        max_model_len=_int(m["mml"]),
        device=m["device"],
        line=line,
        num_blocks_computed=computed,
        num_blocks_override=override,
        num_blocks_logged=logged,
        kv_cache_gib_logged=gib,
    )


class VllmServer:
    """A vLLM OpenAI API server subprocess bound to 127.0.0.1:port."""

    def __init__(
        self,
        python_exe: str,
        model_dir: str,
        served_name: str,
        port: int,
        max_model_len: int,
        block_size: int | None = 128,
        num_gpu_blocks_override: int | None = None,
        kv_cache_space_gib: int | str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        *,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        max_num_seqs: int | None = None,
        fast_start: bool = True,
        max_num_batched_tokens: int | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        host: str = "127.0.0.1",
    ) -> None:
        self.python_exe = python_exe
        self.model_dir = model_dir
        self.served_name = served_name
        self.port = int(port)
        self.host = host
        self.max_model_len = int(max_model_len)
        self.block_size = block_size
        self.num_gpu_blocks_override = num_gpu_blocks_override
        self.kv_cache_space_gib = kv_cache_space_gib
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.extra_args = list(extra_args)
        self.user_env = dict(env or {})
        self.enforce_eager = enforce_eager
        self.max_num_seqs = max_num_seqs
        self.fast_start = fast_start
        self.max_num_batched_tokens = max_num_batched_tokens
        self.startup_timeout = float(startup_timeout)
        # scripts/check and scripts/demo name a directory that is kept only on failure.
        self.log_path = log_path or os.path.join(
            os.environ.get("KVGATE_LOG_DIR") or tempfile.gettempdir(),
            f"vllm-{served_name}-{self.port}.log",
        )
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_offset = 0  # where the current run's output starts in the log
        self.startup_seconds: float | None = None

    # ------------------------------------------------------------------ props
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -------------------------------------------------------------- command
    def command(self) -> list[str]:
        cmd = [
            self.python_exe, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
        ]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.num_gpu_blocks_override is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        if self.kv_cache_memory_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.enforce_eager:
            cmd += ["--enforce-eager"]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        cmd += self.extra_args
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Never let a test server reach for a model hub or phone home.
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.setdefault("PYTHONUNBUFFERED", "1")
        # The project's venv may be active; the vLLM interpreter must not see it.
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        if env.get("KVGATE_VLLM_AMX") != "1":
            # No AMX kernels: see vllm_site/sitecustomize.py (SIGILL on some VMs).
            env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "vllm_site")
            env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        if self.fast_start:
            # In-process executor: no separate VLLM::Worker process.  Measured
            # on 2 cores: health in ~16 s instead of ~26 s, ~0.6 GB less RSS,
            # same decode speed and identical KV figures.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM's CPU platform copies VLLM_CPU_KVCACHE_SPACE (whole GiB) over
        # --kv-cache-memory-bytes (platforms/cpu.py:324), so set exactly one.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if self.kv_cache_space_gib == "auto":
            pass  # vLLM's own sizing: see research notes (needs RAM headroom)
        elif self.kv_cache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kv_cache_space_gib))
        elif self.kv_cache_memory_bytes is None:
            # An explicit KV size avoids the auto path (0.92 x the NUMA node's
            # MemTotal minus the engine's RSS: several GiB) and, with
            # --enforce-eager, lets vLLM skip its warm-up forward pass.
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env.update(self.user_env)
        return env

    # ------------------------------------------------------------ lifecycle
    def start(self, wait: bool = True) -> VllmServer:
        if self.is_running():
            raise VllmServerError(f"server on port {self.port} already running")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_offset = self._log_file.tell()
        started = time.strftime("%F %T")
        header = f"\n===== kvgate VllmServer start {started}: {' '.join(self.command())}\n"
        self._log_file.write(header.encode())
        self._log_offset += len(header.encode())
        self._t_start = time.monotonic()
        self._proc = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            start_new_session=True,  # own process group: killpg reaches children
        )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is None:
                raise VllmServerError("server not started")
            rc = self._proc.poll()
            if rc is not None:
                tail = self.log_tail()
                self._close_log()
                raise VllmServerError(
                    f"vLLM server exited with code {rc} during start-up "
                    f"(log {self.log_path}):\n{tail}"
                )
            if self._health_ok():
                self.startup_seconds = time.monotonic() - self._t_start
                return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise VllmServerError(
                    f"vLLM server not healthy after {timeout:.0f}s "
                    f"(log {self.log_path}):\n{tail}"
                )
            time.sleep(0.5)

    def _health_ok(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - should not happen
            self._proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``timeout``; wait. Returns rc."""
        if self._proc is None:
            return None
        rc = self._proc.poll()
        if rc is None:
            self._signal_group(signal.SIGTERM)
            try:
                rc = self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                rc = self._proc.wait(timeout=30)
        # Children (engine core, workers) may outlive the API server briefly.
        self._reap_group(timeout=10.0)
        self._close_log()
        return rc

    def kill(self) -> int | None:
        """SIGKILL the whole process group at once (fault-injection tests)."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGKILL)
        try:
            rc = self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover
            rc = None
        self._reap_group(timeout=10.0)
        self._close_log()
        return rc

    def restart(self, wait: bool = True) -> VllmServer:
        self.stop()
        self._proc = None
        return self.start(wait=wait)

    def _reap_group(self, timeout: float) -> None:
        """Make sure nothing of the process group is left (SIGKILL leftovers)."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    def _close_log(self) -> None:
        if self._log_file is not None:
            try:
                self._log_file.close()
            finally:
                self._log_file = None

    def __enter__(self) -> VllmServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # best effort: never leave a server behind
        try:
            if self._proc is not None and self._proc.poll() is None:
                self._signal_group(signal.SIGKILL)
        except Exception:
            pass

    # ------------------------------------------------------------------ logs
    def log_text(self, whole_file: bool = False) -> str:
        """Output of the current (last started) run; ``whole_file`` for all runs."""
        try:
            with open(self.log_path, "rb") as f:
                if not whole_file:
                    f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def kv_cache_info(self) -> KvCacheStartupInfo:
        info = parse_kv_cache_log(self.log_text())
        if info is None:
            raise VllmServerError(
                f"no 'KV cache size' line in {self.log_path}:\n{self.log_tail()}"
            )
        return info

    # --------------------------------------------------------------- helpers
    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def post_json(self, path: str, payload: dict, timeout: float = 60.0) -> tuple[int, str]:
        import json

        data = json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def metrics_text(self) -> str:
        status, body = self.get("/metrics")
        if status != 200:
            raise VllmServerError(f"/metrics returned {status}")
        return body

    def cache_config_info(self) -> dict[str, str]:
        """Labels of the ``vllm:cache_config_info`` gauge from /metrics."""
        for line in self.metrics_text().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = line[line.index("{") + 1: line.rindex("}")]
                return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        raise VllmServerError("vllm:cache_config_info not found in /metrics")
