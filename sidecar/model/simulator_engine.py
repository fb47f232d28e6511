"""The engine simulator's scheduling loop: vLLM V1's, step by step, each step priced
by the roofline (`Roofline.step`). Pure: no I/O, no asyncio.

It follows `vllm/v1/core/sched/scheduler.py` (vLLM 0.32), one `schedule()` per step:

1. running requests first: every decoding request gets 1 token of the step's budget
   (`max_num_batched_tokens`), a request still prefilling gets the rest of its prompt
   up to what is left (chunked prefill), at most `long_prefill_token_threshold` of it
   while more than one request is running or waiting; each allocates the KV blocks its
   step needs;
2. when a running request cannot get its blocks, the lowest-priority running request
   (FCFS: the one admitted last; priority: the largest (priority, arrival)) is
   preempted: its blocks are freed and it goes back to the front of the waiting queue,
   to prefill its prompt and the tokens it generated again (recompute), less the
   whole blocks of them still in the prefix cache when it returns;
3. if nothing was preempted, waiting requests (FCFS, or by (priority, arrival)) are
   admitted while budget and `max_num_seqs` allow: a prefix-cache lookup first (whole
   blocks of its group's shared prefix, never the last token), then vLLM's admission
   check (the whole prompt must fit in the free blocks, `scheduler_reserve_full_isl`;
   a sliding window counted up to the window plus the tokens of the step in flight and
   of the step scheduled, `SlidingWindowSpec.max_admission_blocks_per_request`), then
   its first chunk (at most `long_prefill_token_threshold`, as above), which must fit
   too. The first request that does not fit stops admission.

vLLM schedules a step while the previous one runs (asynchronous scheduling, on by
default on GPUs): a request that finished in a step still holds its blocks and its place
in `max_num_seqs` while the next step is scheduled, and a window's blocks are freed on
the tokens processed before the step in flight. With `async_scheduling=False` (vLLM's
CPU build turns it off, `vllm/platforms/cpu.py`) each step's output is processed before
the next is scheduled: finished requests free their blocks first.

A request's fixed cost (`Efficiency.per_request_s`: the API server's HTTP exchange and
tokenizing) is a latency beside the steps, added to its first token and its end, as on a
GPU, whose host works while it computes. With `host_shares_device` (vLLM's CPU build,
whose API server runs on the cores that compute the steps) it is device time instead:
the step the request's first chunk runs in takes that much longer, for every request in
it, once per request.

Blocks per request come from the model's layout (`KVLayout.blocks_in_step`: the same
per-step holding `ServedModel.lifecycle` and the admission ledger use, sliding windows
freed on the processed tokens with one step in flight). Blocks a request frees stay
in the pool as an LRU cache: a prefix group's blocks are reused until evicted, the
oldest freed first, a prefix's tail before its head.

Speed: decoding requests are not visited every step. A decoding request advances one
token per step, so its progress is a global decode clock less an offset; the sum of
the batch's contexts is a counter; a request is visited only when its block count can
change (where one of its groups gains a block or frees one out of a window, tabulated
once per layout) or when it finishes, from two heaps keyed by the decode clock. Step
prices are memoised on (prefill tokens, their mean context, prefill chunks, decode
batch, mean decode context), the token figures rounded to `price_bits` significant
bits (0: exact).

Not modelled: speculative decoding, KV connectors, multimodal encoders, pipeline
parallelism, the watermark (0 by default), `long_prefill_token_threshold_adaptive`,
state groups' block-aligned chunks, prefix hits on layouts with sliding-window or state
groups, and the time the scheduler itself takes. Decodes are scheduled before
running chunked prefills (vLLM takes running requests in order; the two differ only when
the budget runs out between them).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

from sidecar.model.errors import ModelError
from sidecar.model.latency import Prefill, Roofline
from sidecar.model.planning import prefix_hit_tokens, shared_prefix_blocks
from sidecar.model.served import ServedModel
from sidecar.model.simulator_results import RequestRecord, SimulationResult
from sidecar.model.simulator_workload import SimRequest, Workload

Policy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM settings the scheduling loop follows."""

    max_num_seqs: int
    max_num_batched_tokens: int
    usable_blocks: int  # the pool less vLLM's null block
    policy: Policy = "fcfs"
    prefix_caching: bool = True
    async_scheduling: bool = True  # vLLM's default on GPUs; its CPU build turns it off
    # The API server's work per request is device time (vLLM's CPU build: one set of
    # cores for both), not a latency beside the steps (a GPU's host).
    host_shares_device: bool = False
    price_bits: int = 6  # significant bits of memoised step prices (0: exact)
    kv_samples: int = 400  # most (time, blocks) points kept
    # vLLM's --long-prefill-token-threshold: while more than one request is running or
    # waiting when a step is scheduled, no request gets more prompt tokens in it than
    # this (0: no cap).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.usable_blocks < 1:
            raise ModelError("the simulated engine needs max_num_seqs, "
                             "max_num_batched_tokens and KV blocks >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ModelError("long_prefill_token_threshold must be 0 or more, got "
                             f"{self.long_prefill_token_threshold}")
        if self.policy not in ("fcfs", "priority"):
            raise ModelError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")

    @staticmethod
    def of(served: ServedModel, policy: Policy = "fcfs", prefix_caching: bool = True,
           price_bits: int = 6, async_scheduling: bool | None = None) -> EngineConfig:
        """The settings of `served`'s server (`async_scheduling` None: as deployed)."""
        capacity = served.capacity
        if capacity is None:
            raise ModelError("the simulator needs the KV cache size: give a GPU, "
                             "--available-kv-gib or --num-gpu-blocks-override")
        return EngineConfig(served.max_num_seqs, served.max_num_batched_tokens,
                            capacity.usable_blocks, policy, prefix_caching,
                            served.deployment.schedules_async if async_scheduling is None
                            else async_scheduling,
                            served.deployment.host_shares_device, price_bits,
                            long_prefill_token_threshold=served.long_prefill_cap)


@dataclass(frozen=True)
class KvgateGate:
    """kvgate in front of the engine, simplified: a request is sent to the engine only
    when the blocks reserved for the requests it sent (each at its lifecycle peak,
    `lifecycle.peak_blocks`, a prefix group's shared prompt blocks once) fit in
    target_ratio x usable blocks; the others wait in arrival order. A request whose
    peak alone does not fit is refused (never_fits)."""

    target_ratio: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 < self.target_ratio <= 1.0:
            raise ModelError(f"KV target ratio must be in (0, 1], got {self.target_ratio}")


def _bucket(value: int, bits: int) -> int:
    """`value` rounded to `bits` significant bits (the middle of its bucket)."""
    if bits <= 0 or value < (1 << bits):
        return value
    shift = value.bit_length() - bits
    return ((value >> shift) << shift) + (1 << (shift - 1))


class _Group:
    """A prefix group's blocks in the pool: `cached` prefix blocks, held while any
    member runs (`refs`), else an LRU entry."""

    __slots__ = ("cached", "entry", "refs")

    def __init__(self) -> None:
        self.cached = 0
        self.refs = 0
        self.entry: list[object] | None = None


class _Req:
    __slots__ = (
        "arrival",
        "cache_entry",
        "cache_from",
        "cache_valid",
        "computed",
        "d_base",
        "decoding",
        "dropped",
        "gate_own",
        "gate_shared",
        "gen_base",
        "generated",
        "group",
        "last_chunk",
        "last_step",
        "last_token_s",
        "num_tokens",
        "origin",
        "output",
        "own",
        "peak",
        "prefix_tokens",
        "priority",
        "prompt",
        "rec",
        "run_seq",
        "running",
        "seq",
        "shared",
        "version",
    )

    def __init__(self, seq: int, spec: SimRequest, rec: RequestRecord,
                 origin: SimRequest) -> None:
        self.seq = seq
        self.rec = rec
        self.origin = origin  # as the workload sent it (`spec`: what the server serves)
        self.arrival = spec.arrival_s
        self.prompt = spec.prompt_tokens
        self.output = spec.output_tokens
        self.priority = spec.priority
        self.group: _Group | None = None
        self.prefix_tokens = spec.prefix_tokens
        self.generated = 0
        self.computed = 0
        self.num_tokens = spec.prompt_tokens  # to prefill: prompt + tokens generated
        self.own = 0  # blocks held, its group's shared blocks aside
        self.shared = 0  # prefix blocks it uses from its group
        # 1 when an MTP drafter made it give up the last of its group's blocks in its hit:
        # it holds its own copy of that block, the group's blocks less one before it.
        self.dropped = 0
        self.last_chunk = 0
        self.last_step = -2
        self.decoding = False
        self.gen_base = 0
        self.d_base = 0
        self.version = 0
        self.run_seq = 0
        self.running = False
        self.last_token_s = 0.0
        self.peak = 0
        self.gate_own = 0  # blocks kvgate reserved for it, shared prompt blocks aside
        self.gate_shared = 0  # prompt blocks kvgate reserves once for its prefix group
        # After a preemption: its freed blocks in the LRU, the prefix block they start
        # at and how many of them hold whole computed blocks (reusable on its return).
        self.cache_entry: list[object] | None = None
        self.cache_from = 0
        self.cache_valid = 0


class Engine:
    """One run of the scheduling loop over a workload (`simulate` is the entry point)."""

    def __init__(self, served: ServedModel, config: EngineConfig,
                 gate: KvgateGate | None) -> None:
        roofline = served.roofline
        if roofline is None:
            raise ModelError("the simulator prices steps by roofline: give a GPU (--gpu)")
        self.served = served
        self.roofline: Roofline = roofline
        self.config = config
        self.layout = served.layout
        self.recycles = self.layout.recycles_blocks
        self.async_scheduling = config.async_scheduling
        self.gaps = self._change_gaps(served)
        block = self.layout.prefix_block_size
        shareable = self.layout.prefix_groups
        self.prefix_on = (config.prefix_caching and block is not None and shareable > 0
                          and shareable == len(self.layout.groups))
        self.prefix_block = block or 1
        self.prefix_units = shareable
        # An MTP drafter: vLLM gives up the last block of every hit (computes it again).
        self.drops_last_hit = served.deployment.drops_last_prefix_hit
        # The API server's work per request (`Efficiency.per_request_s`): beside the
        # steps on a GPU (a latency added to the first token and to the end), or, where
        # the host shares the device (vLLM's CPU build), device time the step a request
        # is first scheduled in takes longer by (`host_due_s`), for every request in it.
        per_request_s = served.efficiency.per_request_s
        self.per_request_s = 0.0 if config.host_shares_device else per_request_s
        self.host_per_request_s = per_request_s if config.host_shares_device else 0.0
        self.host_due_s = 0.0
        self.usable = config.usable_blocks
        self.budget = config.max_num_batched_tokens
        # vLLM's admission check counts a recycling group (a sliding window) up to its
        # window plus `VllmConfig.max_in_flight_tokens`: max_concurrent_batches x
        # max_num_batched_tokens, 2 batches with asynchronous scheduling (the step in
        # flight that the holdings here keep and the step being scheduled), else 1.
        self.admission_in_flight = (2 if config.async_scheduling else 1) * self.budget
        self.gate = gate
        self.gate_cap = int(self.usable * gate.target_ratio) if gate else 0
        # time and queues
        self.now = 0.0
        # With asynchronous scheduling, when the step in flight started (None: the engine
        # was idle): vLLM scheduled the next step then, so requests arriving since wait
        # for the one after it (`_arrive`).
        self.step_started: float | None = None
        self.arrivals: list[tuple[float, int, SimRequest]] = []
        self.arrival_seq = 0
        self.gate_queue: deque[_Req] = deque()
        # Requests the gate sent on, and when: the engine takes them in as it takes
        # arrivals in (`_arrive`).
        self.handoff: deque[tuple[float, _Req]] = deque()
        self.gate_groups: dict[str, list[int]] = {}  # admitted members, shared blocks
        self.reserved = 0
        self.fcfs: deque[_Req] = deque()
        self.prio: list[tuple[int, float, int, _Req]] = []
        self.running: dict[int, _Req] = {}
        self.releasing: list[_Req] = []  # finished, blocks freed after the next schedule
        self.prefilling: dict[int, _Req] = {}
        self.run_counter = 0
        # decoding requests: a decode clock, a context counter, two event heaps
        self.tick = 0
        self.n_dec = 0
        self.ctx0 = 0  # sum over decoders of prompt + gen_base - 1 - d_base
        self.grow: list[tuple[int, int, int, _Req]] = []
        self.finish: list[tuple[int, int, int, _Req]] = []
        self.last_tick_end = 0.0
        # KV pool
        self.held = 0
        self.evictable = 0
        self.lru: deque[list[object]] = deque()
        self.groups: dict[str, _Group] = {}
        # memos
        self._x_blocks: dict[int, int] = {}
        self._full_blocks: dict[int, int] = {}
        self._prices: dict[tuple[int, int, int, int, int], float] = {}
        # outputs
        self.records: list[RequestRecord] = []
        self.steps = 0
        self.preemptions = 0
        self.preempted_in_step = False
        self.peak = 0
        self.kv_times: list[float] = []
        self.kv_blocks: list[int] = []
        self.itl: list[tuple[float, int]] = []
        self.busy = 0.0
        self.kv_area = 0.0

    # ---- the run ---------------------------------------------------------------

    def run(self, workload: Workload) -> SimulationResult:
        self.workload = workload
        for spec in workload.initial():
            self._push_arrival(spec)
        stalled = 0
        while True:
            self._arrive()
            if not self.running and not self.fcfs and not self.prio:
                for req in self.releasing:  # the engine is idle: outputs are processed
                    self._release(req)
                self.releasing.clear()
                self.step_started = None
                self._arrive()
                if self.fcfs or self.prio:
                    continue
                if not self.arrivals:
                    break
                self.now = max(self.now, self.arrivals[0][0])
                continue
            if self._step():
                stalled = 0
            elif not self.running:
                self._refuse_head()  # cannot be admitted even into an empty engine
            else:
                stalled += 1
                if stalled > 2:
                    raise RuntimeError("the simulated engine scheduled nothing three times")
        return self._result()

    def _push_arrival(self, spec: SimRequest) -> None:
        heapq.heappush(self.arrivals, (spec.arrival_s, self.arrival_seq, spec))
        self.arrival_seq += 1

    def _arrive(self) -> None:
        """Requests that arrived by the time the next step is scheduled: now, or with
        asynchronous scheduling and the engine busy, when the step in flight started
        (vLLM takes new requests in when it schedules, and it scheduled the next step
        then)."""
        arrivals = self.arrivals
        cutoff = self.now if self.step_started is None else self.step_started
        # The gate sees a request as it arrives (here: by now), the engine when it sent on.
        seen = self.now if self.gate else cutoff
        while arrivals and arrivals[0][0] <= seen:
            _, seq, sent = heapq.heappop(arrivals)
            served = self._within_context(sent)
            rec = RequestRecord(sent if served is None else served)
            self.records.append(rec)
            if served is None:
                rec.rejected = "longer than max_model_len"
                self._after(sent, self.now)
                continue
            spec = served
            req = _Req(seq, spec, rec, sent)
            limit = self.gate_cap if self.gate else self.usable
            if self.gate or self._full(spec.prompt_tokens + spec.output_tokens) > limit:
                req.peak = self.served.lifecycle.peak_blocks(spec.prompt_tokens,
                                                             spec.output_tokens)
            if req.peak > limit:
                rec.rejected = "never_fits"
                self._after(sent, self.now)
                continue
            if spec.prefix_group is not None and spec.prefix_tokens and self.prefix_on:
                req.group = self.groups.setdefault(spec.prefix_group, _Group())
            if self.gate and spec.prefix_group is not None and self.config.prefix_caching:
                req.gate_shared = shared_prefix_blocks(self.served, spec.prefix_tokens,
                                                       spec.prompt_tokens)
            if self.gate:
                self.gate_queue.append(req)
            else:
                rec.admitted_s = spec.arrival_s
                self._enqueue(req, front=False)
        if self.gate:
            self._gate_admit()
            handoff = self.handoff
            while handoff and handoff[0][0] <= cutoff:
                self._enqueue(handoff.popleft()[1], front=False)

    def _gate_admit(self) -> None:
        """Send queued requests while their reservations fit. As kvgate's ledger does,
        a prefix group's shared prompt blocks are reserved once, while any of its
        requests is admitted; each request reserves its peak less them."""
        queue = self.gate_queue
        while queue:
            req = queue[0]
            spec = req.rec.request
            group = (self.gate_groups.get(spec.prefix_group)
                     if req.gate_shared and spec.prefix_group is not None else None)
            if group is not None and group[0] > 0:
                own, shared = req.peak - min(req.gate_shared, group[1]), 0
            else:
                own, shared = req.peak - req.gate_shared, req.gate_shared
            if self.reserved + own + shared > self.gate_cap:
                break
            queue.popleft()
            req.gate_own = own
            self.reserved += own + shared
            if req.gate_shared:
                assert spec.prefix_group is not None
                entry = self.gate_groups.setdefault(spec.prefix_group, [0, 0])
                if entry[0] == 0:
                    entry[1] = shared
                entry[0] += 1
            req.rec.admitted_s = self.now
            self.handoff.append((self.now, req))

    def _gate_release(self, req: _Req) -> None:
        self.reserved -= req.gate_own
        if req.gate_shared:
            entry = self.gate_groups[str(req.rec.request.prefix_group)]
            entry[0] -= 1
            if entry[0] == 0:
                self.reserved -= entry[1]
        self._gate_admit()

    def _refuse_head(self) -> None:
        req = self._peek_waiting()
        if req is None:
            return
        self._pop_waiting()
        req.rec.rejected = "never_fits"
        if self.gate:
            self._gate_release(req)
        self._after(req.origin, self.now)

    def _within_context(self, spec: SimRequest) -> SimRequest | None:
        """What the server serves of `spec`: vLLM 0.32 generates up to max_model_len,
        so the output is cut there. It refuses a prompt that fills the context and a
        max_tokens above max_model_len itself: None."""
        limit = self.served.max_model_len
        room = limit - spec.prompt_tokens
        if spec.output_tokens <= room:
            return spec
        if room < 1 or spec.output_tokens > limit:
            return None
        return replace(spec, output_tokens=room)

    def _after(self, spec: SimRequest, when: float) -> None:
        follow = self.workload.after(spec, when)
        if follow is not None:
            self._push_arrival(follow)

    def _enqueue(self, req: _Req, front: bool) -> None:
        if self.config.policy == "priority":
            heapq.heappush(self.prio, (req.priority, req.arrival, req.seq, req))
        elif front:
            self.fcfs.appendleft(req)
        else:
            self.fcfs.append(req)

    # ---- one engine step ---------------------------------------------------------

    def _step(self) -> bool:
        """Schedule, price and run one step; False when nothing could be scheduled."""
        budget = self.budget
        self.preempted_in_step = False
        finished, self.releasing = self.releasing, []
        if not self.async_scheduling:  # their output was processed before this schedule
            for req in finished:
                self._release(req)
            finished = []
        tick = self.tick + 1
        if self.n_dec > budget:
            self._skip_decoders(budget, tick)
        self._grow_decoders(tick)
        n_dec = min(self.n_dec, budget)
        budget -= n_dec
        cap = self._prefill_cap(len(finished))
        chunks: list[tuple[_Req, int, int]] = []
        for req in list(self.prefilling.values()):
            if budget <= 0:
                break
            if not req.running:
                continue
            size = min(req.num_tokens - req.computed, budget, cap)
            in_flight = req.last_step == self.steps - 1 and self.async_scheduling
            settled = req.computed - (req.last_chunk if in_flight else 0)
            delta = self._held(req.computed, size, settled) - req.shared * self.prefix_units \
                - req.own
            if delta > 0 and not self._make_room(delta, req):
                break
            self.held += delta
            req.own += delta
            self._extend_group(req, req.computed + size)
            chunks.append((req, size, req.computed))
            budget -= size
        if not self.preempted_in_step:
            budget = self._admit_waiting(budget, chunks, len(finished), cap)
        for req in finished:
            self._release(req)
        if not chunks and n_dec == 0:
            return bool(finished)  # an empty step: their blocks are free for the next
        # price and run
        prefill_tokens = sum(size for _, size, _ in chunks)
        prefill_context = sum(start for _, _, start in chunks)
        mean_context = (self.ctx0 + self.n_dec * tick) // self.n_dec if self.n_dec else 0
        seconds = self._price(prefill_tokens, prefill_context, len(chunks), n_dec,
                              mean_context) + self.host_due_s
        self.host_due_s = 0.0
        if self.async_scheduling:
            self.step_started = self.now
        self.now += seconds
        self.busy += seconds
        self.kv_area += self.held * seconds
        self.steps += 1
        held = self.held
        self.kv_times.append(self.now)
        self.kv_blocks.append(held)
        self.peak = max(self.peak, held)
        if self.n_dec:
            self.tick = tick
            self.last_tick_end = self.now
            self.itl.append((seconds, n_dec))
        for req, size, _ in chunks:
            if req.running:
                self._chunk_done(req, size)
        finish = self.finish
        while finish and finish[0][0] <= self.tick:
            _, _, version, req = heapq.heappop(finish)
            if version == req.version and req.decoding:
                self._finish(req)
        return True

    def _price(self, prefill_tokens: int, prefill_context: int, chunks: int, n_dec: int,
               dec_context: int) -> float:
        """One step: `chunks` prefill chunks of `prefill_tokens` in all after
        `prefill_context` cached tokens in all, and `n_dec` decodes at a mean context
        of `dec_context` tokens."""
        bits = self.config.price_bits
        tokens = _bucket(prefill_tokens, bits)
        context = _bucket(prefill_context // chunks, bits) if chunks else 0
        decode = _bucket(dec_context, bits) if n_dec else 0
        key = (tokens, context, chunks, n_dec, decode)
        price = self._prices.get(key)
        if price is None:
            prefills = [Prefill(max(1, tokens // chunks), context)] * chunks if chunks else []
            price = self.roofline.step(prefills, (decode,) * n_dec).seconds
            self._prices[key] = price
        return price

    # ---- decoding requests -------------------------------------------------------

    def _decoder_context0(self, req: _Req) -> int:
        return req.prompt + req.gen_base - 1 - req.d_base

    def _start_decoding(self, req: _Req) -> None:
        req.decoding = True
        req.gen_base = req.generated
        req.d_base = self.tick
        req.version += 1
        self.n_dec += 1
        self.ctx0 += self._decoder_context0(req)
        heapq.heappush(self.grow, (req.d_base + 1, req.seq, req.version, req))
        heapq.heappush(self.finish, (req.d_base + req.output - req.gen_base, req.seq,
                                     req.version, req))

    def _stop_decoding(self, req: _Req) -> None:
        req.generated = req.gen_base + self.tick - req.d_base
        if self.tick > req.d_base:
            req.last_token_s = self.last_tick_end
        self.n_dec -= 1
        self.ctx0 -= self._decoder_context0(req)
        req.decoding = False
        req.version += 1

    def _skip_decoders(self, budget: int, tick: int) -> None:
        """More decoding requests than tokens in the budget: those past it in running
        order sit this step out."""
        seen = 0
        for req in list(self.running.values()):
            if not req.decoding:
                continue
            seen += 1
            if seen <= budget:
                continue
            self._stop_decoding(req)
            self.n_dec += 1
            req.decoding = True
            req.gen_base = req.generated
            req.d_base = tick
            self.ctx0 += self._decoder_context0(req)
            heapq.heappush(self.grow, (tick + 1, req.seq, req.version, req))
            heapq.heappush(self.finish, (tick + req.output - req.gen_base, req.seq,
                                         req.version, req))

    def _grow_decoders(self, tick: int) -> None:
        """Blocks for the decoding requests whose block count changes at `tick`."""
        grow = self.grow
        fired: list[_Req] = []
        while grow and grow[0][0] <= tick:
            _, _, version, req = heapq.heappop(grow)
            if version == req.version and req.decoding:
                fired.append(req)
        if len(fired) > 1:
            fired.sort(key=lambda r: r.run_seq)
        for req in fired:
            if not req.decoding:
                continue  # preempted for an earlier one
            produced = req.gen_base + tick - 1 - req.d_base
            computed = req.prompt + produced - 1
            in_flight = ((req.last_chunk if produced == req.gen_base else 1)
                         if self.async_scheduling else 0)
            blocks = self._held(computed, 1, computed - in_flight)
            delta = blocks - req.shared * self.prefix_units - req.own
            if delta > 0 and not self._make_room(delta, req):
                continue
            self.held += delta
            req.own += delta
            gaps = self.gaps
            step = 1 if produced == req.gen_base or not gaps else gaps[(computed + 1) % len(gaps)]
            heapq.heappush(grow, (tick + step, req.seq, req.version, req))

    # ---- KV blocks -----------------------------------------------------------------

    def _change_gaps(self, served: ServedModel) -> list[int]:
        """For a decoding request whose step covers token x (x = computed + 1): how many
        steps until its block count can next change, indexed by x mod the period.

        Every group's count is a step function of x with the period of its block
        size (a full block more, or one more fell out of the window), so over the
        lcm of the block sizes the changes fall on fixed residues: those where the
        count changes once decoding is steady (found by evaluating one period past
        max_model_len) and 1 (a growing group's new block). The first two steps after
        a prefill are visited anyway (its last chunk is still in flight). Windows free
        on the tokens processed before the step in flight (asynchronous scheduling) or
        before this step. Empty: visit every step (periods too long to tabulate)."""
        lag = 1 if self.async_scheduling else 0
        period = 1
        for group in self.layout.groups:
            period = math.lcm(period, group.block_size)
        if period > 65_536:
            return []
        start = period * (served.max_model_len // period + 4)
        layout = self.layout
        residues = {1 % period}
        previous = layout.blocks_in_step(start - 1, 1, start - 1 - lag)
        for x in range(start + 1, start + period + 1):
            now = layout.blocks_in_step(x - 1, 1, x - 1 - lag)
            if now != previous:
                residues.add(x % period)
            previous = now
        gaps = []
        for residue in range(period):
            gap = 1
            while (residue + gap) % period not in residues:
                gap += 1
            gaps.append(gap)
        return gaps

    def _held(self, computed: int, new: int, settled: int) -> int:
        if self.recycles:
            return self.layout.blocks_in_step(computed, new, max(0, settled))
        x = computed + new
        blocks = self._x_blocks.get(x)
        if blocks is None:
            blocks = self._x_blocks[x] = self.layout.blocks_in_step(computed, new, settled)
        return blocks

    def _full(self, tokens: int) -> int:
        """Blocks vLLM's admission check reserves for a sequence of `tokens` tokens, at
        least the most it holds: `allocate_slots(full_sequence_must_fit=True)` asks
        `get_num_blocks_to_allocate(apply_admission_cap=True)`, which caps a sliding
        window's blocks at `SlidingWindowSpec.max_admission_blocks_per_request`
        (window - 1 + max_in_flight_tokens, in blocks, + 1). With a step in flight a
        window's chunked prefill holds two chunks past it: a cap of one chunk admits a
        request whose next chunk cannot get its blocks, which then preempts itself,
        returns, and does it again."""
        blocks = self._full_blocks.get(tokens)
        if blocks is None:
            blocks = self._full_blocks[tokens] = self.layout.blocks_for_request(
                tokens, self.admission_in_flight)
        return blocks

    def _make_room(self, need: int, req: _Req) -> bool:
        """Preempt until `need` blocks are free; False when `req` itself was preempted."""
        while self.usable - self.held < need:
            victim = self._victim()
            self._preempt(victim)
            if victim is req:
                return False
        if self.usable - self.held - self.evictable < need:
            self._take(need)
        return True

    def _victim(self) -> _Req:
        if self.config.policy == "priority":
            return max(self.running.values(), key=lambda r: (r.priority, r.arrival, r.run_seq))
        return next(reversed(self.running.values()))

    def _take(self, need: int) -> None:
        """Make `need` blocks empty, evicting cached blocks (oldest first) if needed."""
        deficit = need - (self.usable - self.held - self.evictable)
        lru = self.lru
        while deficit > 0 and lru:
            entry = lru[0]
            units = entry[1]
            assert isinstance(units, int)
            if units == 0:  # reused since it was freed
                lru.popleft()
                continue
            take = min(units, deficit)
            entry[1] = units - take
            self.evictable -= take
            deficit -= take
            group = entry[0]
            if isinstance(group, _Group):
                group.cached = (units - take) // self.prefix_units
                if units - take == 0:
                    group.entry = None
            if units - take == 0:
                lru.popleft()

    def _release(self, req: _Req, computed_tokens: int | None = None) -> None:
        """Free a request's blocks into the LRU cache. With `computed_tokens` (a
        preemption) its whole computed blocks stay reusable by its own return."""
        if req.own > 0:
            self.held -= req.own
            self.evictable += req.own
            entry: list[object] = [None, req.own]
            self.lru.append(entry)
            if computed_tokens is not None and self.prefix_on:
                req.cache_entry = entry
                req.cache_from = req.shared
                req.cache_valid = max(0, computed_tokens // self.prefix_block - req.shared)
        req.own = 0
        group = req.group
        if group is not None:
            group.refs -= 1
            if group.refs == 0 and group.cached > 0:
                units = group.cached * self.prefix_units
                self.held -= units
                self.evictable += units
                shared_entry: list[object] = [group, units]
                self.lru.append(shared_entry)
                group.entry = shared_entry
        req.shared = 0
        req.dropped = 0

    # ---- waiting requests ----------------------------------------------------------

    def _peek_waiting(self) -> _Req | None:
        if self.config.policy == "priority":
            return self.prio[0][3] if self.prio else None
        return self.fcfs[0] if self.fcfs else None

    def _pop_waiting(self) -> None:
        if self.config.policy == "priority":
            heapq.heappop(self.prio)
        else:
            self.fcfs.popleft()

    def _prefill_cap(self, finishing: int) -> int:
        """The most prompt tokens one request gets in the step being scheduled: vLLM's
        long_prefill_token_threshold while more than one request is running or waiting
        (a request alone gets the whole budget), else no cap beyond the budget. The
        `finishing` requests, whose last output vLLM has not processed yet, still count
        as running."""
        cap = self.config.long_prefill_token_threshold
        if cap <= 0:
            return self.budget
        waiting = len(self.prio) if self.config.policy == "priority" else len(self.fcfs)
        return cap if len(self.running) + finishing + waiting > 1 else self.budget

    def _admit_waiting(self, budget: int, chunks: list[tuple[_Req, int, int]],
                       finishing: int, cap: int) -> int:
        pg = self.prefix_units
        while budget > 0 and len(self.running) + finishing < self.config.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                break
            group = req.group
            hit = 0
            if group is not None:
                eligible = min(group.cached * self.prefix_block, req.prefix_tokens)
                hit = prefix_hit_tokens(eligible, req.num_tokens, self.prefix_block)
            hit_blocks = hit // self.prefix_block
            own_hit = self._own_hit(req, hit_blocks)
            dropped = 0
            # An MTP drafter: the hit gives up its last block, computed again into the
            # request's own. (The group's copy of that block stays held with the group's
            # while it has requests, where vLLM frees it when its writer ends: at most
            # one block per prefix group held too long.)
            if self.drops_last_hit:
                if own_hit:
                    own_hit -= 1
                elif hit_blocks:
                    hit_blocks -= 1
                    hit = hit_blocks * self.prefix_block
                    dropped = 1
            full = self._full(req.num_tokens)
            joining = group.cached * pg if group is not None and group.refs == 0 else 0
            free = self.usable - self.held
            if full - hit_blocks * pg + joining > free:
                break  # vLLM's check that the whole prompt fits
            hit = (hit_blocks + own_hit) * self.prefix_block if own_hit else hit
            size = min(req.num_tokens - hit, budget, cap)
            own = self._held(hit, size, hit) - hit_blocks * pg
            if own + joining > free:
                break  # and that this step's chunk does (a window's prefill peak)
            self._pop_waiting()
            if req.cache_entry is not None:
                reused = own_hit * pg
                req.cache_entry[1] = int(req.cache_entry[1]) - reused  # type: ignore[call-overload]
                self.evictable -= reused
                self.held += reused
                req.cache_entry = None
            if group is not None:
                if group.refs == 0:
                    entry = group.entry
                    if entry is not None:
                        units = entry[1]
                        assert isinstance(units, int)
                        self.evictable -= units
                        entry[1] = 0
                        group.entry = None
                    self.held += group.cached * pg
                group.refs += 1
            req.shared = hit_blocks
            req.dropped = dropped
            fresh = own - own_hit * pg
            self._take(fresh)
            self.held += fresh
            req.own = own
            req.computed = hit
            rec = req.rec
            if rec.preemptions == 0:
                rec.cached_tokens = hit
                self.host_due_s += self.host_per_request_s
            else:
                rec.recomputed_tokens += req.num_tokens - hit
            req.running = True
            req.last_step = -2
            self.run_counter += 1
            req.run_seq = self.run_counter
            self.running[req.seq] = req
            self.prefilling[req.seq] = req
            self._extend_group(req, hit + size)
            chunks.append((req, size, hit))
            budget -= size
        return budget

    def _extend_group(self, req: _Req, tokens: int) -> None:
        """vLLM caches a chunk's whole blocks when it allocates them: a request that
        writes its group's prefix past what the group holds extends it, and requests
        admitted later in the same step already find those blocks."""
        group = req.group
        # (A hit an MTP drafter cut short still follows on from the group's last block.)
        if group is None or req.shared + req.dropped != group.cached:
            return
        frontier = min(tokens, req.prefix_tokens) // self.prefix_block
        if frontier > group.cached:
            gained = frontier - group.cached
            group.cached = frontier
            req.shared += gained
            req.own -= gained * self.prefix_units

    def _own_hit(self, req: _Req, group_hit_blocks: int) -> int:
        """Prefix blocks a preempted request finds of its own freed blocks, past its
        group's: whole computed blocks not yet evicted (a tail goes first), following
        on from the group's hit, never its last token."""
        entry = req.cache_entry
        if entry is None:
            return 0
        units = entry[1]
        assert isinstance(units, int)
        remaining = min(req.cache_valid, units // self.prefix_units)
        if remaining <= 0 or group_hit_blocks < req.cache_from:
            return 0
        end = prefix_hit_tokens((req.cache_from + remaining) * self.prefix_block,
                                req.num_tokens, self.prefix_block) // self.prefix_block
        return max(0, end - group_hit_blocks)

    # ---- state changes -----------------------------------------------------------

    def _chunk_done(self, req: _Req, size: int) -> None:
        req.computed += size
        req.last_chunk = size
        req.last_step = self.steps - 1
        if req.computed < req.num_tokens:
            return
        del self.prefilling[req.seq]
        req.generated += 1
        rec = req.rec
        if rec.first_token_s is None:
            rec.first_token_s = self.now + self.per_request_s
        else:
            self.itl.append((self.now - req.last_token_s, 1))
        req.last_token_s = self.now
        if req.generated >= req.output:
            self._finish(req)
        else:
            self._start_decoding(req)

    def _finish(self, req: _Req) -> None:
        """The request sampled its last token in the step just run. With asynchronous
        scheduling vLLM schedules the next step before it processes this one's output:
        the request still counts against max_num_seqs and holds its blocks while the
        next step is scheduled (`releasing`); without, they are freed before it."""
        if req.decoding:
            self._stop_decoding(req)
        self.releasing.append(req)
        req.running = False
        del self.running[req.seq]
        self.prefilling.pop(req.seq, None)
        req.rec.finish_s = self.now + self.per_request_s
        if self.gate:
            self._gate_release(req)
        self._after(req.origin, req.rec.finish_s)

    def _preempt(self, req: _Req) -> None:
        self.preemptions += 1
        self.preempted_in_step = True
        req.rec.preemptions += 1
        if req.decoding:
            self._stop_decoding(req)
            computed = req.prompt + req.generated - 1
        else:
            computed = req.computed
        self._release(req, computed)
        req.running = False
        del self.running[req.seq]
        self.prefilling.pop(req.seq, None)
        req.num_tokens = req.prompt + req.generated
        req.computed = 0
        req.last_chunk = 0
        self._enqueue(req, front=True)

    # ---- results -------------------------------------------------------------------

    def _result(self) -> SimulationResult:
        times, blocks = self.kv_times, self.kv_blocks
        points = self.config.kv_samples
        if len(times) > points > 0:
            # At most `points`, evenly spaced, ending with the last (and, with two or more,
            # starting with the first).
            last = len(times) - 1
            picks = sorted({last - round(i * last / max(1, points - 1)) for i in range(points)})
            samples = [(times[i], blocks[i]) for i in picks]
        else:
            samples = list(zip(times, blocks, strict=True))
        return SimulationResult(
            records=self.records,
            steps=self.steps,
            preemptions=self.preemptions,
            usable_blocks=self.usable,
            kv_samples=samples,
            peak_blocks=self.peak,
            itl_samples=self.itl,
            busy_s=self.busy,
            mean_blocks=self.kv_area / self.busy if self.busy > 0 else 0.0,
        )
