"""The running sidecar's objects and how they learn from the server.

`Services` is built once per process by the composition root (`app.py`). It owns
the admission controller (created when the server has told enough about itself:
served model, max_model_len, block size, KV blocks), turns each watcher
observation into the controller's `ServerState`, rebuilds the model when the
server comes back different, and answers the metrics collector.
"""

from __future__ import annotations

import asyncio
import logging
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from sidecar.admission import (
    AdmissionController,
    AdmissionSettings,
    CostModel,
    Mode,
    QueueLimits,
    ServerQueueLimits,
    ServerState,
    Ticket,
)
from sidecar.admission.cost import LatencySpread, ModelInputs, own_prefill_capped
from sidecar.admission.prefix import EventCache
from sidecar.admission.server_queue import MAX_REQUESTS
from sidecar.calibration import CalibrationStore, Calibrator, warning_kind
from sidecar.metrics import PrefixView, SidecarMetrics, StateView
from sidecar.model import (
    Deployment,
    Gpu,
    ModelArchitecture,
    ModelError,
    ServedModel,
    custom_gpu,
    find_gpu,
    read_architecture,
)
from sidecar.model.gpu import with_overrides
from sidecar.model.latency import LOAD_BUCKETS
from sidecar.model.served import KV_CACHE_DTYPES
from sidecar.server.prompt_tokens import PromptCounter
from sidecar.server.settings import ServeSettings
from sidecar.upstream import (
    CacheConfig,
    Engine,
    ModelInfo,
    ServerMetrics,
    UpstreamView,
    UpstreamWatcher,
)
from sidecar.upstream.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventSubscriber,
)

log = logging.getLogger("kvgate")

# Without GPU figures, predictions start from a fast generic device and calibrate
# down from the live server's own timings (efficiencies can only lower a peak).
GENERIC_DEVICE = custom_gpu(80, 8000, 2250, name="generic (no --gpu given)")
CALIBRATION_PERIOD_S = 1.0
# The spread's factors (p50, p90) move with every completed request; predictions take
# them at most this late: rebuilt at a completion or before a decision once this long
# has passed since the last rebuild (not at every completion).
SPREAD_PERIOD_S = 0.05
CALIBRATION_CHANGE = 0.02


def resolve_gpu(settings: ServeSettings) -> Gpu | None:
    """The GPU from the settings; raises ModelError for an unknown name."""
    if settings.gpu:
        return with_overrides(find_gpu(settings.gpu), settings.gpu_memory_gib,
                              settings.gpu_bandwidth_gbps, settings.gpu_tflops)
    figures = (settings.gpu_memory_gib, settings.gpu_bandwidth_gbps, settings.gpu_tflops)
    if all(value is not None for value in figures):
        memory, bandwidth, tflops = figures
        assert memory is not None and bandwidth is not None and tflops is not None
        return custom_gpu(memory, bandwidth, tflops)
    if any(value is not None for value in figures):
        raise ModelError("a custom GPU needs all of --gpu-memory-gib, --gpu-bandwidth-gbps "
                         "and --gpu-tflops")
    return None


def server_idle(view: UpstreamView) -> bool:
    """True when the server computed no token between the last two scrapes: it ran no
    engine step, so the gauges it updates per step (KV use, running, waiting) are
    stale (they keep the values of its last step)."""
    now, before = view.metrics, view.previous_metrics
    if now is None or before is None:
        return False
    pairs = ((now.prompt_tokens_total, before.prompt_tokens_total),
             (now.generation_tokens_total, before.generation_tokens_total))
    return all(a is not None and a == b for a, b in pairs)


@dataclass(frozen=True)
class LearnedServer:
    """What a model instance depends on; a change means rebuilding it."""

    model_id: str
    root: str | None
    max_model_len: int
    block_size: int | None  # None: the model's own (vLLM's choice for its layer kinds)
    num_blocks: int | None
    cache_dtype: str
    prefix_caching: bool = True
    reported_cache_dtype: str | None = None  # as the server reports it, when unknown


class Services:
    def __init__(
        self,
        settings: ServeSettings,
        registry: CollectorRegistry,
        *,
        arch: ModelArchitecture | None,
        gpu: Gpu | None,
        version: str,
    ) -> None:
        self.settings = settings
        self.clock = time.monotonic
        self.configured_arch = arch
        self.gpu = gpu
        self.metrics = SidecarMetrics(
            registry, self.state_view, gateway_metrics=settings.gateway_metrics,
            version=version, mode=settings.mode,
        )
        self.calibrator = (
            Calibrator(CalibrationStore(settings.calibration_file)) if settings.calibrate
            else None
        )
        self.controller: AdmissionController | None = None
        self.served: ServedModel | None = None
        self.learned: LearnedServer | None = None
        self.model_problem: str | None = None
        self.client: Engine | None = None
        self.watcher: UpstreamWatcher | None = None
        # The event loop serving requests, known once the upstream is attached. Passed to
        # asyncio's helpers on the request path: without it each asks for the running
        # loop, which costs a getpid system call (CPython's fork check) every time.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self._refusals_logged: set[str] = set()
        self.active_requests = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._typical_tokens: float | None = None
        self._calibration_applied_at = -math.inf
        self._spread_dirty = False
        self._spread_applied_at = -math.inf
        self._health_logged: set[str] = set()
        self.kv_events: KVEventSubscriber | None = None
        self.event_cache: EventCache | None = None
        self._events_started_s = self.clock()
        self.prompts = PromptCounter(self.metrics, check_every=settings.tokenizer_check_every,
                                     log_prompts=settings.log_prompts)
        # What the controller's server state was last derived from (see `refresh`).
        self._refreshed: tuple[object, ...] | None = None

    # ---- the model's tokenizer --------------------------------------------------------

    def start_tokenizer(self) -> None:
        """Count prompts locally when the tokenizer files are readable: --tokenizer, else
        the directory of --model-config (the server's path from /v1/models is tried when
        it is learned)."""
        for candidate in (self.settings.tokenizer, self.settings.model):
            if candidate and Path(candidate).expanduser().exists():
                self.prompts.load_from(candidate)
                return

    # ---- the server's KV cache events ---------------------------------------------

    async def start_kv_events(self) -> None:
        """Subscribe to the server's KV cache events (--kv-events-endpoint)."""
        endpoint = self.settings.kv_events_endpoint
        if endpoint is None or self.kv_events is not None:
            return
        self.kv_events = KVEventSubscriber(endpoint, self._on_kv_events, self._on_kv_gap)
        self._events_started_s = self.clock()
        self._ensure_event_cache()
        await self.kv_events.start()
        log.info("subscribed to the server's KV cache events at %s", endpoint)

    async def stop_kv_events(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.close()

    def _on_kv_events(self, events: Sequence[KVEvent]) -> None:
        if self.controller is not None:
            self.controller.sharing.events_arrived()
        cache = self.event_cache
        if cache is None:
            return
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium not in (None, "GPU"):
                    continue  # an offloaded copy: the server's device pool is what counts
                cache.stored(event.block_hashes, event.parent_block_hash, event.token_ids,
                             event.block_size, event.group_idx,
                             salted=event.lora_id is not None or event.extra_keys is not None)
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, "GPU"):
                    cache.removed(event.block_hashes, event.group_idx)
            elif isinstance(event, AllBlocksCleared):
                cache.cleared()
        self._update_prefix_source()

    def _ensure_event_cache(self) -> None:
        """The index of the server's cache, once both the events and the served model's
        block size are known (in either order)."""
        served = self.served
        block_size = served.layout.prefix_block_size if served is not None else None
        if self.kv_events is not None and block_size is not None and (
            self.event_cache is None or self.event_cache.block_size != block_size
        ):
            blocks = self.learned.num_blocks if self.learned else None
            self.event_cache = EventCache(block_size, max_blocks=4 * (blocks or 1 << 18))
        self._update_prefix_source()

    def _on_kv_gap(self) -> None:
        """Events were missed (or the server restarted): what it has cached is unknown."""
        if self.event_cache is not None:
            self.event_cache.cleared()

    def events_stale(self) -> bool:
        """kvgate sent the server prompt blocks it did not hold, and no event came since
        (vLLM publishes a request's new blocks when it schedules it, within a step)."""
        subscriber, controller = self.kv_events, self.controller
        if subscriber is None or controller is None:
            return False
        expected = controller.sharing.expects_events_since_s
        return expected is not None and self.clock() - expected > (
            self.settings.kv_events_stale_s)

    def _update_prefix_source(self) -> None:
        controller = self.controller
        if controller is None:
            return
        fresh = self.event_cache is not None and not self.events_stale()
        controller.sharing.use_events(self.event_cache if fresh else None)

    # ---- wiring -----------------------------------------------------------------

    def server_refused(self, reason: str) -> None:
        """The server's own admission refused a request kvgate forwarded (a 503 of vLLM's
        --max-num-queued-reqs / --max-num-queued-tokens): counted apart from kvgate's
        decisions; said once in the log when kvgate was not told the limit."""
        self.metrics.upstream_refusals.labels(reason).inc()
        limits = self.admission_settings().server_limits
        told = (limits.max_requests if reason == MAX_REQUESTS
                else limits.max_prefill_tokens) is not None
        if not told and reason not in self._refusals_logged:
            self._refusals_logged.add(reason)
            flag = "--" + reason.replace("_", "-")
            log.warning("the server refused a request with its own %s limit (503); give "
                        "kvgate the server's %s so that it keeps its requests within it",
                        flag, flag)

    def request_started(self) -> None:
        """Count a proxied request while it runs (the drain waits for zero); each is
        followed by one `request_ended` (a plain pair, not a context manager: it is on
        every request's path)."""
        self.active_requests += 1
        self.idle.clear()

    def request_ended(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self.idle.set()

    def attach(self, client: Engine, watcher: UpstreamWatcher) -> None:
        """Called in the event loop that will serve requests."""
        self.client = client
        self.watcher = watcher
        self.loop = asyncio.get_running_loop()

    def admission_settings(self) -> AdmissionSettings:
        s = self.settings
        return AdmissionSettings(
            mode=Mode(s.mode),
            kv_target_ratio=s.kv_target_ratio,
            limits=QueueLimits(s.queue_max_length, s.queue_max_wait_s),
            ordering=s.ordering,
            fairness=s.fairness,
            priority_bands=s.priority_bands,
            starvation_bound_s=s.starvation_bound_s,
            output_policy=s.output_policy,
            output_quantile=s.output_quantile,
            max_overcommit_ratio=s.max_overcommit_ratio,
            server_limits=ServerQueueLimits(
                s.max_num_queued_reqs, s.max_num_queued_tokens,
                # vLLM's --max-num-seqs is per engine: each data-parallel one runs as many.
                None if s.max_num_seqs is None else s.max_num_seqs * s.data_parallel_size),
            engines=s.data_parallel_size,
        )

    # ---- learning the server ---------------------------------------------------------

    def on_upstream(self, before: UpstreamView, after: UpstreamView) -> None:
        if after.up and after.model is not None:
            learned = self._learned(after.model, after)
            if learned is not None and learned != self.learned:
                self._rebuild(learned)
            root = after.model.root
            if (self.prompts.directory is None and not self.settings.tokenizer
                    and root and Path(root).is_dir()):
                self.prompts.load_from(root)
        if self.controller is not None:
            self.controller.set_prefix_caching(self._prefix_caching(after))
            self._update_prefix_source()
            self.controller.update_server(self._server_state(after))
            self._note_preemptions(before, after)
        if self.calibrator is not None and self.served is not None:
            if after.restarts > before.restarts:
                self.calibrator.server_restarted()
                if self.controller is not None:
                    self.controller.cost_model.spread = self._spread()
            running = after.metrics.running if after.metrics and after.metrics.running else 1
            slowdown = (self.controller.prefill_load.slowdown(self.clock(), running - 1)
                        if self.controller else 1.0)
            own = self.controller is not None and self.controller.inflight > 0
            self.calibrator.observe_server(before, after, self.served, slowdown,
                                           sidecar_traffic=own)
            self.apply_calibration()

    def _note_preemptions(self, before: UpstreamView, after: UpstreamView) -> None:
        """The server preempted requests since its last scrape while kvgate enforces:
        log what admission believed then (traffic that bypasses kvgate, a capacity that
        is not the server's, or a request priced wrong shows in it)."""
        old = before.metrics.preemptions_total if before.metrics else None
        new = after.metrics.preemptions_total if after.metrics else None
        controller = self.controller
        if (old is None or new is None or new <= old or controller is None
                or after.restarts != before.restarts
                or controller.settings.mode is not Mode.ENFORCE):
            return
        ledger = controller.ledger
        running = "; ".join(
            f"{r['prompt_tokens']} prompt + {r['output_tokens']}/{r['reserved_output_tokens']}"
            f" output tokens, {r['blocks_now']} blocks now, {r['peak_blocks']} at its peak"
            for r in controller.request_states(limit=32))
        used = after.metrics.used_blocks if after.metrics else None
        log.warning(
            "the server preempted %d request(s) since its last scrape: kvgate's view: "
            "capacity %s blocks (target %d), %d reserved, %d held by traffic kvgate does "
            "not see, %s used on the server, %d waiting in kvgate; %d running: %s",
            new - old, controller.capacity_blocks, ledger.target_blocks,
            ledger.reserved_blocks, controller.others_blocks, used, len(controller.queue),
            controller.inflight, running or "none")

    def _prefix_caching(self, view: UpstreamView) -> bool:
        setting = self.settings.prefix_caching
        if setting != "auto":
            return setting == "on"
        reported = view.metrics.cache.enable_prefix_caching if view.metrics else None
        return True if reported is None else reported

    def _learned(self, model: ModelInfo, view: UpstreamView) -> LearnedServer | None:
        """What the server says about itself; without its /metrics, the KV block count is
        the model's estimate (from --gpu) and the block size the setting."""
        cache = view.metrics.cache if view.metrics is not None else CacheConfig()
        max_len = model.max_model_len
        if max_len is None:
            self.model_problem = "the server's /v1/models reports no max_model_len"
            return None
        dtype = cache.cache_dtype if cache.cache_dtype in KV_CACHE_DTYPES else "auto"
        unknown_dtype = None if cache.cache_dtype in (None, dtype) else cache.cache_dtype
        return LearnedServer(
            model_id=model.id,
            root=model.root,
            max_model_len=max_len,
            block_size=cache.block_size or self.settings.block_size,
            num_blocks=cache.num_gpu_blocks,
            cache_dtype=dtype,
            prefix_caching=self._prefix_caching(view),
            reported_cache_dtype=unknown_dtype,
        )

    def _architecture(self, learned: LearnedServer) -> ModelArchitecture | None:
        if self.configured_arch is not None:
            return self.configured_arch
        candidates = [c for c in (learned.root, learned.model_id) if c]
        for candidate in candidates:
            if candidate == learned.root and not Path(candidate).exists():
                continue
            try:
                return read_architecture(candidate)
            except ModelError:
                continue
        self.model_problem = (
            f"cannot read the config of {learned.model_id!r} (model path {learned.root!r} is "
            "not readable here and the name is not a preset): give --model-config"
        )
        return None

    def _rebuild(self, learned: LearnedServer) -> None:
        if learned.num_blocks is None and self.gpu is None:
            self.model_problem = ("the KV capacity is unknown: the server's /metrics has no "
                                  "vllm:cache_config_info yet, and without --gpu it cannot be "
                                  "estimated")
            return
        arch = self._architecture(learned)
        if arch is None:
            log.error(self.model_problem)
            return
        deployment = Deployment(
            tp=self.settings.tp,
            kv_cache_dtype=learned.cache_dtype,
            max_model_len=learned.max_model_len,
            block_size=learned.block_size,
            max_num_batched_tokens=self.settings.max_num_batched_tokens,
            max_num_seqs=self.settings.max_num_seqs,
            num_gpu_blocks_override=learned.num_blocks,
            enable_prefix_caching=learned.prefix_caching,
            mamba_cache_mode=(None if self.settings.mamba_cache_mode == "auto"
                              else self.settings.mamba_cache_mode),
            mamba_cache_dtype=self.settings.mamba_cache_dtype,
            mamba_ssm_cache_dtype=self.settings.mamba_ssm_cache_dtype,
            num_speculative_tokens=self.settings.num_speculative_tokens,
            data_parallel_size=self.settings.data_parallel_size,
            speculative_method=self.settings.speculative_method,
            attention_backend=self.settings.attention_backend,
            async_scheduling=self.settings.async_scheduling,
            long_prefill_token_threshold=self.settings.long_prefill_token_threshold,
        )
        try:
            served = ServedModel(arch, deployment, self.gpu or GENERIC_DEVICE)
            if self.calibrator is not None:
                served = served.with_efficiency(self.calibrator.efficiency(served))
            served.layout  # noqa: B018 - fail here, not on the first request
        except ModelError as exc:
            self.model_problem = f"the served model cannot be modelled: {exc}"
            log.error(self.model_problem)
            return
        if learned.block_size is None:
            log.warning("the server reports no KV block size: kvgate takes %d, vLLM's "
                        "choice for this model (give --block-size if it was started with "
                        "another)", served.block_size)
        if learned.reported_cache_dtype is not None:
            log.warning("the server reports KV cache dtype %r, which kvgate does not know: "
                        "modelled as auto", learned.reported_cache_dtype)
        if self.learned is not None:
            log.info("the server changed (%s -> %s); re-learned its model", self.learned,
                     learned)
        self.learned = learned
        self.served = served
        self.model_problem = None
        cost_model = self._cost_model(served)
        if self.controller is None:
            self.controller = AdmissionController(
                cost_model, self.admission_settings(), listener=self.metrics
            )
        else:
            self.controller.set_cost_model(cost_model)
        self._ensure_event_cache()
        self.metrics.set_model(learned.model_id)

    def apply_calibration(self, *, force: bool = False) -> None:
        """Use the calibrated efficiencies for every prediction, at most once a second
        and only when one of them moved by more than 2%."""
        if self.calibrator is None or self.served is None or self.controller is None:
            return
        now = self.clock()
        if not force and now - self._calibration_applied_at < CALIBRATION_PERIOD_S:
            return
        self._calibration_applied_at = now
        efficiency = self.calibrator.efficiency(self.served)
        current = self.served.efficiency.as_dict()
        moved = any(
            abs(new - current[name]) > CALIBRATION_CHANGE * max(abs(current[name]), 1e-9)
            for name, new in efficiency.as_dict().items()
        )
        if moved:
            self.served = self.served.with_efficiency(efficiency)
            cost_model = self._cost_model(self.served)
            # The spread's ratios, taken against the model just replaced, are taken
            # again against this one (see calibration.spread).
            self.calibrator.spread.rebase(
                lambda quantity, inputs: cost_model.model_s(quantity, inputs)
                if isinstance(inputs, ModelInputs) else None)
            cost_model.spread = self._spread()
            self.controller.set_cost_model(cost_model)
            self._log_health()

    def _cost_model(self, served: ServedModel) -> CostModel:
        return CostModel(served, self._spread(), self.settings.deadline_quantile)

    def _spread(self) -> LatencySpread:
        """The p50 and p90 factors calibration measured (the priors without it)."""
        self._spread_dirty = False
        if self.calibrator is None:
            return LatencySpread()
        spread = self.calibrator.spread
        ttft = [spread.factors("ttft", b) for b in range(LOAD_BUCKETS)]
        tpot = [spread.factors("tpot", b) for b in range(LOAD_BUCKETS)]
        return LatencySpread(tuple(f.p50 for f in ttft), tuple(f.p90 for f in ttft),
                             tuple(f.p50 for f in tpot), tuple(f.p90 for f in tpot))

    def calibration_status(self) -> dict[str, object] | None:
        if self.calibrator is None or self.served is None:
            return None
        return self.calibrator.status(self.served, device_named=self.gpu is not None)

    def _log_health(self) -> None:
        """Say once in the log what the calibration finds implausible about the server."""
        status = self.calibration_status()
        checked = status.get("health") if status else None
        warnings = checked.get("warnings", []) if isinstance(checked, dict) else []
        for warning in warnings:
            kind = warning_kind(warning)
            if kind not in self._health_logged:
                self._health_logged.add(kind)
                log.warning("calibration: %s", warning)

    def _freshness(self, view: UpstreamView, now: float) -> tuple[bool, bool]:
        """(the scrape's figures are fresh, the server went idle since the scrape
        before): what, with the scrape itself, the server state is derived from."""
        fresh = view.metrics_age_s(now) <= self.settings.metrics_stale_s
        return fresh, fresh and view.metrics is not None and self._idle(view)

    def _server_state(self, view: UpstreamView,
                      freshness: tuple[bool, bool] | None = None) -> ServerState:
        fresh, idle = freshness or self._freshness(view, self.clock())
        metrics = view.metrics if fresh else None
        num_blocks = self.learned.num_blocks if self.learned else None
        if idle:
            # No engine step since the last scrape: vLLM's gauges still hold the last
            # step's values, while its requests are done and their blocks free.
            return ServerState(available=view.up, num_blocks=num_blocks, used_blocks=0,
                               running=0, waiting=0)
        return ServerState(
            available=view.up,
            num_blocks=num_blocks,
            used_blocks=metrics.used_blocks if metrics else None,
            running=metrics.running if metrics else None,
            waiting=metrics.waiting if metrics else None,
            scraped_from_s=view.metrics_sent_at if metrics else None,
        )

    def _idle(self, view: UpstreamView) -> bool:
        """The server computed nothing since the last scrape and nothing kvgate sent it
        is running (a long step of kvgate's own requests keeps the observed use)."""
        return (self.controller is None or self.controller.inflight == 0) and server_idle(view)

    def _apply_spread(self, now: float) -> None:
        """The spread's latest factors on the predictions, when they moved and the last
        rebuild is SPREAD_PERIOD_S old."""
        if (self._spread_dirty and self.controller is not None
                and now - self._spread_applied_at >= SPREAD_PERIOD_S):
            self.controller.cost_model.spread = self._spread()
            self._spread_applied_at = now

    def refresh(self) -> None:
        """Re-evaluate staleness between scrapes (called before decisions that matter)."""
        now = self.clock()
        self._apply_spread(now)
        controller, watcher = self.controller, self.watcher
        if watcher is None or controller is None:
            return
        self._update_prefix_source()
        view = watcher.view
        freshness = self._freshness(view, now)
        # The state is derived again only when what it is derived from changed: another
        # scrape, the figures going stale, the server going idle (once per request
        # otherwise: a decision's hot path).
        derived_from = (controller, view, self.learned, controller.server, *freshness)
        if self._refreshed is not None and all(
                map(operator.is_, self._refreshed, derived_from)):
            return
        state = self._server_state(view, freshness)
        # The server's figures are re-read only when a scrape (or their staleness,
        # or the server going idle) changed them: they describe the scrape's moment.
        if state != controller.server:
            controller.update_server(state)
        self._refreshed = (controller, view, self.learned, controller.server, *freshness)

    # ---- observations ----------------------------------------------------------------

    def observe_completion(
        self,
        ticket: Ticket,
        *,
        streamed: bool,
        arrived_at: float,
        sent_at: float,
        first_token_at: float | None,
        ended_at: float,
        output_tokens: int,
        batch_at_start: int,
    ) -> None:
        """Predicted vs observed for a completed request: metrics and calibration.

        Observed TTFT runs from the request's arrival at kvgate to its first streamed
        token, as the client sees it; the prediction (`ticket.predicted_ttft_s`) is
        what was known at admission (prompt counting, queue wait) plus the predicted
        prefill. The calibration fits the part after admission, which the model
        predicts. TPOT is the time per token after the first. The metrics take every
        completed streamed request (a non-streamed one has no first-token time); the
        calibration (fit and spread) a sample above 50 a second
        (`Calibrator.learns_from`).
        """
        self._observe_request_size(ticket.request.prompt_tokens + output_tokens)
        if not streamed or first_token_at is None:
            return
        cost = ticket.cost
        # What was known at admission (counting the prompt, the queue wait) and the
        # predicted prefill after it: the p90 keeps the known part.
        known_s = ticket.predicted_ttft_s - cost.prefill_s
        ttft = first_token_at - arrived_at
        self.metrics.observed("ttft", ttft, ticket.predicted_ttft_s, known_s + cost.prefill_p90_s)
        tpot = (ended_at - first_token_at) / (output_tokens - 1) if output_tokens >= 2 else None
        if tpot is not None:
            self.metrics.observed("tpot", tpot, ticket.predicted_tpot_s, cost.tpot_p90_s)
        calibrator, served = self.calibrator, self.served
        if calibrator is None or served is None or not calibrator.learns_from(ended_at):
            return
        # The spread of observed around the model's own prediction, as clients see it.
        calibrator.spread.observe("ttft", ttft - known_s, cost.prefill_model_s, cost.load_bucket,
                                  cost.model_inputs)
        if tpot is not None:
            calibrator.spread.observe("tpot", tpot, cost.tpot_model_s, cost.load_bucket,
                                      cost.model_inputs)
        self._spread_dirty = True
        self._apply_spread(self.clock())
        # Deflate by the others' prefill load: the lines fit the engine's own speed.
        load = self.controller.prefill_load if self.controller else None
        now_running = self.controller.inflight if self.controller else 0
        others = max(0, (batch_at_start + now_running) // 2)
        slowdown = load.slowdown(ended_at, others) if load else 1.0
        context = ticket.request.prompt_tokens + output_tokens // 2
        # Only the tokens it prefilled (prefix-cache hits were predicted as not
        # computed), after those of the prompts ahead of it.
        inputs = ticket.cost.model_inputs
        ahead = inputs.ahead_tokens if inputs is not None else 0
        prefilled = ticket.request.prompt_tokens - ticket.cost.cached_tokens + ahead
        # The others running when it was sent (the count includes itself), whose steps
        # it waited for unless prompts were ahead of it; in the form `CostModel` priced
        # it (`ModelInputs`): with prompts ahead, their tokens and its own together, at
        # the whole budget or over `ahead_steps` under a long-prefill threshold.
        calibrator.observe_prefill(served, prefilled, max(0, batch_at_start - 1),
                                   context, (first_token_at - ticket.admitted_s) / slowdown,
                                   waited=not ahead,
                                   capped=own_prefill_capped(ticket.request.sequences),
                                   in_steps=inputs.ahead_steps if inputs is not None else 0)
        if tpot is not None:
            calibrator.observe_decode(served, others + 1, context, tpot / slowdown)
        self.apply_calibration()

    def _observe_request_size(self, tokens: int) -> None:
        if self._typical_tokens is None:
            self._typical_tokens = float(tokens)
        else:
            self._typical_tokens += 0.05 * (tokens - self._typical_tokens)

    # ---- readiness and state ----------------------------------------------------------

    @property
    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        view = self.watcher.view if self.watcher else None
        if view is None or not view.up:
            reason = view.last_error if view and view.last_error else "not reached yet"
            return False, f"upstream unavailable: {reason}"
        if self.controller is None or self.controller.capacity_blocks is None:
            return False, self.model_problem or "KV capacity not known yet"
        return True, "ready"

    def state_view(self) -> StateView:
        view = self.watcher.view if self.watcher else None
        controller = self.controller
        now = self.clock()
        if controller is None:
            return StateView(0, 0, None, 0, None, 0.0, math.inf, None,
                             bool(view and view.up),
                             view.metrics_age_s(now) if view else math.inf, None)
        forecast = controller.forecast()
        fresh = view is not None and view.metrics_age_s(now) <= self.settings.metrics_stale_s
        metrics = view.metrics if view and fresh else None
        return StateView(
            queue_requests=len(controller.queue),
            inflight_requests=controller.inflight,
            capacity_blocks=controller.capacity_blocks,
            reserved_blocks=controller.ledger.reserved_blocks,
            used_blocks=(0 if view is not None and self._idle(view) else metrics.used_blocks)
            if metrics else None,
            forecast_peak_ratio=forecast.peak_ratio,
            forecast_exhaustion_s=forecast.exhaustion_s,
            recommended_max_concurrency=self.recommended_concurrency(),
            upstream_up=bool(view and view.up),
            upstream_metrics_age_s=view.metrics_age_s(now) if view else math.inf,
            server_waiting=metrics.waiting if metrics else None,
            prefix=self.prefix_view(view, metrics),
            others_blocks=controller.others_blocks if metrics else None,
            queue_waiting_on=controller.blockage.current,
            queue_blocked_s=controller.blockage.seconds(controller.clock()),
        )

    def prefix_view(self, view: UpstreamView | None,
                    metrics: ServerMetrics | None) -> PrefixView | None:
        """The prefix cache's figures; the server's from `metrics`, its last scrape while
        fresh (None when stale or down: not known, as every server figure)."""
        controller = self.controller
        if controller is None:
            return None
        prefix = controller.sharing.index
        subscriber = self.kv_events
        last_event = subscriber.last_event_s if subscriber else None
        return PrefixView(
            source=controller.prefix_source,
            server_prefix_caching=metrics.cache.enable_prefix_caching if metrics else None,
            held_blocks=controller.ledger.held_prompt_blocks,
            saved_blocks=sum(t.cost.shared_blocks for t in controller.tickets()),
            query_tokens=prefix.query_tokens if prefix else 0,
            predicted_hit_tokens=prefix.hit_tokens if prefix else 0,
            server_query_tokens=metrics.prefix_cache_queries_total if metrics else None,
            server_hit_tokens=metrics.prefix_cache_hits_total if metrics else None,
            events_configured=subscriber is not None,
            events_connected=bool(subscriber and subscriber.connected),
            events_decode_errors=subscriber.decode_errors if subscriber else 0,
            events_age_s=None if last_event is None else self.clock() - last_event,
            events_stale=self.events_stale(),
            events_gaps=subscriber.gaps if subscriber else 0,
        )

    def recommended_concurrency(self) -> int | None:
        controller = self.controller
        if controller is None or self._typical_tokens is None:
            return None
        per_request = controller.cost_model.blocks(max(1, round(self._typical_tokens)))
        if per_request <= 0:
            return None
        return controller.ledger.target_blocks // per_request
