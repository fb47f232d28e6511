"""kvgate against a bare Python proxy and nginx, over a canned upstream, with wrk.

Run as `python bench/overhead.py --canned` (see that file). Everything on 127.0.0.1:
- the *canned upstream*: nginx answering vLLM's routes with fixed bodies (a completion,
  a stream of 8 SSE token events, /v1/models, /metrics with a KV cache too large to
  ever queue, /tokenize with the ids kvgate's local tokenizer gives the load's prompt),
  logging the path of every request it receives, so the run can count how many
  requests reach the server per client request;
- the targets in front of it: nginx as a reverse proxy, a bare aiohttp stream-through
  proxy (`bench/bare_proxy.py`), a proxy without a web framework (`bench/lean_proxy.py`:
  a raw asyncio protocol on uvloop in front of kvgate's forwarding client, what a
  leaner front end could bring kvgate to), and kvgate (`--event-loop uvloop` and
  `asyncio`);
- wrk (Debian's package) as the load: closed loop at a fixed number of connections,
  one thread, the same POST /v1/completions for every target, streaming and not.

Targets are rotated between repetitions; each cell reports the median over
repetitions of wrk's p50 latency and throughput, the p50 each proxy adds over the
canned upstream alone, and the requests the upstream received per client request.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import BenchError, Process, free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "bench-model"
EVENTS = 8
PROMPT = ("Summarise the following notes for an on-call engineer in three short bullet "
          "points, keeping numbers exact: the KV cache filled at 14:02, vLLM preempted "
          "requests for 40 s, latency p99 went from 2 s to 19 s, and the gateway kept "
          "admitting because its KV threshold lagged by one scrape.")
TARGETS = ("direct", "nginx", "bare-aiohttp", "lean-protocol", "kvgate-uvloop",
           "kvgate-asyncio")
# (streaming, unique prompts): identical prompts first, so kvgate's first checks of the
# shape meet the prompt the canned /tokenize answers for.
CASES = ((False, False), (True, False), (False, True))


def find_tool(name: str, package: str) -> str:
    found = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists()
                                   else None)
    if found is None:
        raise BenchError(f"{name} is not installed: apt-get install -y {package}")
    return found


def _event(text: str, finish: str | None) -> str:
    chunk = {"id": "cmpl-canned", "object": "text_completion", "created": 0,
             "model": MODEL_ID, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish}]}
    return "data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n"


def canned_bodies(prompt_ids: list[int]) -> dict[str, str]:
    words = [f" w{i}" for i in range(EVENTS)]
    completion = {"id": "cmpl-canned", "object": "text_completion", "created": 0,
                  "model": MODEL_ID,
                  "choices": [{"index": 0, "text": "".join(words), "logprobs": None,
                               "finish_reason": "length"}],
                  "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": EVENTS,
                            "total_tokens": len(prompt_ids) + EVENTS}}
    stream = "".join(_event(w, "length" if i == EVENTS - 1 else None)
                     for i, w in enumerate(words)) + "data: [DONE]\n\n"
    models = {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "root": None,
                                          "max_model_len": 4096}]}
    blocks = 1_000_000
    labels = (f'block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
              f'gpu_memory_utilization="0.9",kv_cache_size_tokens="{16 * blocks}",'
              f'num_gpu_blocks="{blocks}",sliding_window="None"')
    model = f'engine="0",model_name="{MODEL_ID}"'
    metrics = "\n".join([
        "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}}} 1.0",
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{model}}} 0.0",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{model}}} 0.0",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{model}}} 0.0",
        "# TYPE vllm:num_preemptions counter",
        f"vllm:num_preemptions_total{{{model}}} 0.0", ""])
    tokenize = {"count": len(prompt_ids), "max_model_len": 4096, "tokens": prompt_ids}
    return {"complete.json": json.dumps(completion), "stream.sse": stream,
            "models.json": json.dumps(models), "metrics.txt": metrics,
            "tokenize.json": json.dumps(tokenize)}


def _quoted(text: str) -> str:
    """`text` as an nginx string: quotes and backslashes escaped, newlines as \\n."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def upstream_config(directory: Path, port: int, bodies: dict[str, str]) -> str:
    """nginx answering vLLM's routes with `return` (no files: nothing for nginx's worker
    user to read)."""
    def answer(name: str, content_type: str) -> str:
        return f"default_type {content_type}; return 200 {_quoted(bodies[name])};"

    return f"""\
# Generated by bench/canned.py: a canned stand-in for vLLM's HTTP API.
worker_processes 1;
pid {directory}/upstream.pid;
error_log {directory}/upstream.error.log warn;
events {{ worker_connections 4096; }}
http {{
    log_format counted '$request_method $request_uri';
    access_log {directory}/upstream.requests.log counted;
    client_body_temp_path {directory}/upstream_body;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location = /v1/completions {{
            if ($http_x_canned = "stream") {{ rewrite ^ /canned-stream last; }}
            {answer("complete.json", "application/json")}
        }}
        location = /canned-stream {{ internal; {answer("stream.sse", "text/event-stream")} }}
        location = /v1/models {{ {answer("models.json", "application/json")} }}
        location = /metrics {{ {answer("metrics.txt", "text/plain")} }}
        location = /tokenize {{ {answer("tokenize.json", "application/json")} }}
        location = /health {{ return 200; }}
        location / {{ return 404; }}
    }}
}}
"""


def wrk_script(directory: Path, stream: bool, unique: bool = False) -> Path:
    """The load: the same request every time, or (`unique`) the prompt followed by a
    request number, so that no two prompts are alike."""
    headers = {"Content-Type": "application/json"}
    if stream:
        headers["x-canned"] = "stream"
    lua_headers = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers.items())
    script = directory / f"{'stream' if stream else 'complete'}{'-unique' if unique else ''}.lua"
    if not unique:
        body = json.dumps({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": EVENTS,
                           "stream": stream})
        script.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n{lua_headers}')
        return script
    head = json.dumps({"model": MODEL_ID, "prompt": PROMPT})[:-2]  # ...PROMPT without '"}'
    tail = json.dumps({"max_tokens": EVENTS, "stream": stream})[1:]
    script.write_text(
        f'wrk.method = "POST"\n{lua_headers}local n = 0\n'
        f'request = function()\n  n = n + 1\n'
        f'  return wrk.format(nil, nil, nil, {json.dumps(head)} .. " #" .. n .. "\\", " .. '
        f'{json.dumps(tail)})\nend\n')
    return script


_DURATION_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise BenchError(f"unreadable wrk latency {text!r}")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_wrk(output: str) -> dict[str, Any]:
    percentiles = {int(p): _ms(v) for p, v in re.findall(r"^\s+(\d+)%\s+(\S+)\s*$", output,
                                                          re.MULTILINE)}
    requests = re.search(r"(\d+) requests in ([\d.]+)(\w+)", output)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), "
                              r"timeout (\d+)", output)
    if requests is None or rate is None or 50 not in percentiles:
        raise BenchError(f"unreadable wrk output:\n{output[-1500:]}")
    return {"requests": int(requests.group(1)), "throughput_rps": float(rate.group(1)),
            "p50_ms": percentiles[50], "p90_ms": percentiles.get(90),
            "p99_ms": percentiles.get(99),
            "non_2xx": int(errors.group(1)) if errors else 0,
            "socket_errors": sum(int(x) for x in socket_errors.groups()) if socket_errors
            else 0}


def run_wrk(wrk: str, url: str, script: Path, concurrency: int, duration_s: float) -> dict[
        str, Any]:
    argv = [wrk, "-t1", f"-c{concurrency}", f"-d{duration_s:g}s", "--latency", "-s",
            str(script), url + "/v1/completions"]
    completed = subprocess.run(argv, capture_output=True, text=True, check=False,
                               timeout=duration_s + 60)
    if completed.returncode != 0:
        raise BenchError(f"wrk failed: {completed.stderr[-1000:]}")
    return parse_wrk(completed.stdout)


def upstream_requests(directory: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    log = directory / "upstream.requests.log"
    if log.exists():
        for line in log.read_text().splitlines():
            path = line.split(" ", 1)[-1]
            counts[path] = counts.get(path, 0) + 1
    return counts


def local_prompt_ids(tokenizer_dir: Path) -> list[int]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from sidecar.tokens import LocalTokenizer

    return list(LocalTokenizer.load(tokenizer_dir).tokenize({"prompt": PROMPT}))


def canned_comparison(args: Any, tmp: Path, provenance: dict[str, Any]) -> dict[str, Any]:
    nginx, wrk = find_tool("nginx", "nginx"), find_tool("wrk", "wrk")
    tokenizer_dir = Path(args.tokenizer).expanduser()
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise BenchError(f"--tokenizer {tokenizer_dir}: no tokenizer.json (the tiny models "
                         "that `bash scripts/check` builds have one)")
    bodies = canned_bodies(local_prompt_ids(tokenizer_dir))
    upstream_port = free_port()
    (tmp / "upstream.conf").write_text(upstream_config(tmp, upstream_port, bodies))
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    from bench.overhead import nginx_config

    proxy_port, bare_port, lean_port = free_port(), free_port(), free_port()
    (tmp / "proxy.conf").write_text(nginx_config(tmp, proxy_port, upstream_port, "1"))
    ports = {"kvgate-uvloop": free_port(), "kvgate-asyncio": free_port()}
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVGATE_")}
    kvgate_argv = {
        target: [sys.executable, "-m", "sidecar", "serve", "--upstream", upstream_url,
                 "--model-config", "Qwen/Qwen3-0.6B", "--tokenizer", str(tokenizer_dir),
                 "--host", "127.0.0.1", "--port", str(port), "--mode", "enforce",
                 "--event-loop", target.removeprefix("kvgate-"),
                 # The canned /tokenize knows one prompt: no sampled checks of the others.
                 "--tokenizer-check-every", "0"]
        for target, port in ports.items()}
    processes = [
        Process("canned upstream", [nginx, "-p", str(tmp), "-e", str(tmp / "upstream.err"),
                                    "-c", str(tmp / "upstream.conf"), "-g", "daemon off;"],
                tmp / "upstream.out"),
        Process("nginx", [nginx, "-p", str(tmp), "-e", str(tmp / "error.log"), "-c",
                          str(tmp / "proxy.conf"), "-g", "daemon off;"], tmp / "nginx.out"),
        Process("bare aiohttp proxy", [sys.executable, str(ROOT / "bench" / "bare_proxy.py"),
                                       "--port", str(bare_port), "--upstream", upstream_url],
                tmp / "bare.log"),
        Process("lean protocol proxy", [sys.executable, str(ROOT / "bench" / "lean_proxy.py"),
                                        "--port", str(lean_port), "--upstream", upstream_url],
                tmp / "lean.log"),
        *(Process(target, argv, tmp / f"{target}.log", env=env, cwd=ROOT)
          for target, argv in kvgate_argv.items()),
    ]
    urls = {"direct": upstream_url, "nginx": f"http://127.0.0.1:{proxy_port}",
            "bare-aiohttp": f"http://127.0.0.1:{bare_port}",
            "lean-protocol": f"http://127.0.0.1:{lean_port}",
            **{t: f"http://127.0.0.1:{p}" for t, p in ports.items()}}
    cells: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    try:
        for process in processes:
            process.start()
        wait_http(upstream_url + "/health", processes[0])
        wait_http(urls["nginx"] + "/health", processes[1])
        wait_http(urls["bare-aiohttp"] + "/health", processes[2])
        wait_http(urls["lean-protocol"] + "/health", processes[3])
        for target, process in zip(ports, processes[4:], strict=True):
            wait_http(urls[target] + "/readyz", process, timeout_s=60)
        for stream, unique in CASES:
            script = wrk_script(tmp, stream, unique)
            for target in TARGETS:  # warm every path up (connections, the first checks)
                run_wrk(wrk, urls[target], script, args.canned_concurrency, 1)
            samples: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
            for rep in range(args.reps):
                shift = rep % len(TARGETS)
                for target in TARGETS[shift:] + TARGETS[:shift]:
                    args.quiet.wait()
                    before = upstream_requests(tmp)
                    result = run_wrk(wrk, urls[target], script, args.canned_concurrency,
                                     args.canned_duration)
                    after = upstream_requests(tmp)
                    result["upstream_generations"] = (after.get("/v1/completions", 0)
                                                      - before.get("/v1/completions", 0))
                    result["upstream_tokenize"] = (after.get("/tokenize", 0)
                                                   - before.get("/tokenize", 0))
                    samples[target].append(result)
                    runs.append({"mode": "streaming" if stream else "non-streaming",
                                 "prompts": "unique" if unique else "identical",
                                 "target": target, "repetition": rep, **result})
                    sys.stderr.write(
                        f"  {'stream' if stream else 'json':>6} "
                        f"{'unique' if unique else 'same':>6} {target:<15} "
                        f"{result['throughput_rps']:>8.0f} req/s  p50 {result['p50_ms']:.2f} ms"
                        f"  upstream got {result['upstream_generations']} generations, "
                        f"{result['upstream_tokenize']} /tokenize\n")
            cells.append(_cell(stream, unique, args.canned_concurrency, samples))
    finally:
        for process in reversed(processes):
            process.stop()
    return {
        "benchmark": "overhead_canned", **provenance,
        "setup": {
            "upstream": "nginx with canned bodies (bench/canned.py): a completion of "
                        f"{EVENTS} tokens, or {EVENTS} SSE events and [DONE]",
            "load": {"tool": "wrk, 1 thread", "concurrency": args.canned_concurrency,
                     "prompts": "identical (every request the same), or unique (the prompt "
                                "and a request number): kvgate tokenizes identical prompts "
                                "once (its cache of recent prompts), unique ones every time",
                     "duration_s": args.canned_duration, "repetitions": args.reps,
                     "request": "POST /v1/completions, a 300-character prompt, max_tokens "
                                f"{EVENTS}", "order": "targets rotated per repetition"},
            "kvgate": {t: ["kvgate", *argv[3:]] for t, argv in kvgate_argv.items()},
        },
        "cells": cells, "runs": runs,
    }


def _cell(stream: bool, unique: bool, concurrency: int,
          samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    targets: dict[str, dict[str, Any]] = {}
    for target, results in samples.items():
        requests = sum(r["requests"] for r in results)
        targets[target] = {
            "p50_ms": round(statistics.median(r["p50_ms"] for r in results), 3),
            "p99_ms": round(statistics.median(r["p99_ms"] or 0 for r in results), 3),
            "throughput_rps": round(statistics.median(r["throughput_rps"] for r in results), 1),
            "requests": requests,
            "errors": sum(r["non_2xx"] + r["socket_errors"] for r in results),
            "upstream_generations_per_request": round(
                sum(r["upstream_generations"] for r in results) / requests, 4)
            if requests else None,
            "upstream_tokenize_per_request": round(
                sum(r["upstream_tokenize"] for r in results) / requests, 4)
            if requests else None,
        }
    direct = targets["direct"]["p50_ms"]
    for values in targets.values():
        values["added_p50_ms"] = round(values["p50_ms"] - direct, 3)
    bare = targets["bare-aiohttp"]
    for name in ("lean-protocol", "kvgate-uvloop", "kvgate-asyncio"):
        kvgate = targets[name]
        kvgate["added_p50_over_bare_ms"] = round(kvgate["added_p50_ms"] - bare["added_p50_ms"],
                                                 3)
        kvgate["throughput_vs_bare"] = round(kvgate["throughput_rps"] / bare["throughput_rps"],
                                             3) if bare["throughput_rps"] else None
    return {"mode": "streaming" if stream else "non-streaming",
            "prompts": "unique" if unique else "identical", "concurrency": concurrency,
            "targets": targets, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                             time.gmtime())}
