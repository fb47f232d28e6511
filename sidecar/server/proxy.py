"""The proxy: generation routes through admission, everything else untouched.

A generation request is read (bounded by --max-body-bytes), validated, its prompt
counted (the model's tokenizer, checked against the server's /tokenize; or the
documented fallback), admitted or rejected by the controller, and then sent upstream
on the forwarding pool (upstream/http1.py) and streamed back chunk by chunk.
The KV reservation is released in `finally`, whatever happens: success, upstream
failure, or the client going away (the front end, kvgate's lean one or aiohttp,
cancels the handler, which closes the upstream connection so vLLM aborts the request).
The same handlers serve requests read by either front end (server/front.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from multidict import MultiMapping

from sidecar.admission import AdmissionRequest, Rejected, Ticket
from sidecar.server import access_log
from sidecar.server.client_headers import PRIORITY, TENANT, TTFT_SLO, parse_steering
from sidecar.server.errors import error_response, rejection_response
from sidecar.server.keys import SERVICES
from sidecar.server.lean import LeanRequest
from sidecar.server.prefix_keys import prompt_keys, shares_prompt_blocks
from sidecar.server.requests import (
    BadRequest,
    GenerationRequest,
    parse_body,
    parse_generation,
)
from sidecar.server.services import Services
from sidecar.server.token_stream import EventAligner, TokenCounter
from sidecar.upstream import (
    ForwardError,
    ForwardResponse,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from sidecar.upstream.refusals import RefusalWatch

log = logging.getLogger("kvgate.proxy")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
# vLLM's header pinning a request to one data-parallel engine; a client's own is dropped
# (kvgate decides where the KV room is).
DATA_PARALLEL_RANK = "x-data-parallel-rank"
STEERING = frozenset({PRIORITY, TENANT, TTFT_SLO, DATA_PARALLEL_RANK})
# kvgate's figures on an admitted request's answer (the server's own of these names are
# replaced).
FIGURES = ("x-kvgate-queue-ms", "x-kvgate-predicted-ttft-ms", "x-kvgate-kv-blocks",
           "x-kvgate-prompt-tokens", "x-kvgate-kv-shared-blocks", "x-kvgate-cached-tokens",
           "x-kvgate-predicted-tpot-ms")
_NOT_WITH_FIGURES = HOP_BY_HOP | frozenset(FIGURES)
# The client's headers kvgate does not send on: hop-by-hop ones, its own steering, and
# the request id (kvgate sends the id it logs, see RequestRecord.upstream_headers).
_NOT_FORWARDED = HOP_BY_HOP | STEERING | frozenset({access_log.REQUEST_ID_HEADER.lower()})
# Proxied requests running now, which the drain cuts off at its end (with DRAIN_CUT).
RUNNING = web.AppKey("running", set[asyncio.Task[Any]])
DRAIN_CUT = "kvgate: drain timeout"
DRAINED_EVENT = (b'{"error": {"message": "the sidecar shut down before the stream ended '
                 b'(--drain-timeout-s)", "type": "api_error", "code": "draining", '
                 b'"param": null}}')
BROKEN_EVENT = (b'{"error": {"message": "the model server failed mid-stream", '
                b'"type": "api_error", "code": "upstream_failed", "param": null}}')


# Connection's options that name no header.
_CONNECTION_OPTIONS = frozenset({"", "close", "keep-alive"})


def _with_connection_named(headers: MultiMapping[str], drop: frozenset[str]
                           ) -> frozenset[str]:
    """`drop`, and the headers a Connection header names: those are hop-by-hop too, for
    this connection only (RFC 9110, 7.6.1), and a proxy does not pass them on."""
    values = headers.getall("Connection", None)
    if not values or (len(values) == 1 and values[0].lower() in _CONNECTION_OPTIONS):
        return drop  # the usual case: none, or a plain keep-alive / close
    named = {token.strip().lower() for value in values for token in value.split(",")}
    named -= _CONNECTION_OPTIONS
    return drop | named if named else drop


def _forward_headers(headers: MultiMapping[str], drop: frozenset[str]
                     ) -> list[tuple[str, str]]:
    """The client's headers less those in `drop` (lower-case names) and those its
    Connection header names, in their order."""
    drop = _with_connection_named(headers, drop)
    return [(name, value) for name, value in headers.items() if name.lower() not in drop]


def _response_headers(upstream: MultiMapping[str], ticket: Ticket | None, *,
                      head: bool = False) -> list[tuple[str, str]]:
    """The server's headers (less hop-by-hop ones, those its Connection header names and
    kvgate's own names), and kvgate's figures when admitted. The answer to a HEAD keeps
    the server's Content-Length: the length its GET would have, with no body here."""
    drop = _with_connection_named(upstream, HOP_BY_HOP if ticket is None else _NOT_WITH_FIGURES)
    headers = [(name, value) for name, value in upstream.items() if name.lower() not in drop]
    if head:
        length = upstream.get("Content-Length", "")
        if length.isdigit() and length.isascii():
            headers.append(("Content-Length", length))
    if ticket is not None:
        cost = ticket.cost
        values = (f"{ticket.queue_wait_s * 1000:.1f}", f"{ticket.predicted_ttft_s * 1000:.1f}",
                  str(cost.kv_blocks + cost.shared_blocks), str(cost.prompt_tokens),
                  str(cost.shared_blocks), str(cost.cached_tokens),
                  f"{ticket.predicted_tpot_s * 1000:.2f}")
        headers += zip(FIGURES, values, strict=True)
    return headers


def _engine_pinned(headers: list[tuple[str, str]], services: Services,
                   ticket: Ticket | None) -> list[tuple[str, str]]:
    """With data parallelism, the request goes to the engine whose KV pool kvgate
    reserved it on (vLLM's `X-data-parallel-rank`), not where vLLM's balancer would
    put it by load. (A client's own is not forwarded: it is among STEERING.)"""
    controller = services.controller
    if ticket is not None and controller is not None and controller.ledger.engines > 1:
        headers.append((DATA_PARALLEL_RANK, str(ticket.reservation.engine)))
    return headers


def _unavailable(message: str) -> web.Response:
    return error_response(503, message, code="unavailable", retry_after_s=5.0)


def _drain_cut(exc: asyncio.CancelledError) -> bool:
    """True for the drain's own cut-off, which the request then answers (no longer
    cancelled); False for any other cancellation (e.g. the client went away)."""
    if not (exc.args and exc.args[0] == DRAIN_CUT):
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True


def _draining(services: Services) -> web.Response:
    return error_response(503, "the sidecar is shutting down", code="draining",
                          retry_after_s=services.settings.drain_timeout_s)


def _upstream_failed(services: Services, exc: ForwardError) -> web.Response:
    """No response from the server: 504 when it stayed silent longer than
    --read-timeout-s, 502 for an answer that is not HTTP, else 503 (refused, reset,
    connect timeout)."""
    if services.watcher is not None:
        services.watcher.poke()
    name = exc.__class__.__name__
    if isinstance(exc, UpstreamTimeout):
        services.metrics.upstream_errors.labels("timeout").inc()
        timeout_s = services.settings.read_timeout_s
        return error_response(504, f"the model server did not answer within {timeout_s:g} s "
                              "(--read-timeout-s)", code="upstream_timeout", retry_after_s=5.0)
    if isinstance(exc, UpstreamProtocolError):
        services.metrics.upstream_errors.labels("protocol").inc()
        return error_response(502, f"the model server answered something unusable ({name})",
                              code="upstream_failed", retry_after_s=5.0)
    services.metrics.upstream_errors.labels("connect").inc()
    return _unavailable(f"the model server is unavailable ({name})")


# A request as aiohttp reads it, or as kvgate's lean front end does (server/front.py).
Incoming = web.Request | LeanRequest


def _record(request: Incoming) -> access_log.RequestRecord:
    return request.record if isinstance(request, LeanRequest) else access_log.record(request)


async def _read_body(request: Incoming) -> bytes | web.Response:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SERVICES].settings.max_body_bytes
        return error_response(
            413, f"request body is larger than the limit of {limit} bytes",
            code="body_too_large",
        )


async def generation(request: Incoming) -> web.StreamResponse:
    services = request.app[SERVICES]
    services.request_started()
    try:
        return await _generation(request, services)
    finally:
        services.request_ended()


async def _generation(request: Incoming, services: Services) -> web.StreamResponse:
    arrived_at = time.monotonic()
    raw = await _read_body(request)
    if isinstance(raw, web.Response):
        return raw
    try:
        body = parse_body(raw)
        gen = parse_generation(request.path, body)
        steering = parse_steering(request.headers, gen.user, services.settings.priority_bands)
    except BadRequest as exc:
        return error_response(400, str(exc), code="invalid_request", param=exc.param)
    if services.draining:
        return _draining(services)
    controller = services.controller
    if controller is None:
        reason = services.ready[1]
        return _unavailable(f"not ready to admit requests: {reason}")
    if services.settings.log_prompts:
        log.info("prompt %s: %s", request.path, body)
    prompt_tokens, token_ids = await services.prompts.count(gen, services.client,
                                                            access_log.REQUEST_ID.get())
    services.refresh()
    shares = shares_prompt_blocks(body, gen)
    admission = AdmissionRequest(
        block_keys=prompt_keys(controller, body, gen, token_ids,
                               services.learned.model_id if services.learned else None,
                               shares=shares),
        prompt_tokens=prompt_tokens,
        max_tokens=gen.max_tokens,
        sequences=gen.sequences * gen.prompts,
        forks_share=shares,
        band=steering.band,
        tenant=steering.tenant,
        ttft_slo_s=steering.ttft_slo_s,
    )
    _record(request).admission = admission
    try:
        ticket = await controller.admit(admission)
    except Rejected as rejected:
        return rejection_response(rejected.decision)
    # Known so far (counting the prompt, waiting in the queue) plus the predicted prefill.
    ticket.predicted_ttft_s = (time.monotonic() - arrived_at) + ticket.cost.prefill_s
    services.metrics.predicted(ticket.predicted_ttft_s, ticket.predicted_tpot_s)
    return await forward(request, raw, services, ticket=ticket, gen=gen, arrived_at=arrived_at)


async def passthrough(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES]
    services.request_started()
    try:
        raw = await _read_body(request)
        if isinstance(raw, web.Response):
            return raw
        if services.draining:
            return _draining(services)
        return await forward(request, raw, services)
    finally:
        services.request_ended()


async def forward(
    request: Incoming,
    raw: bytes,
    services: Services,
    *,
    ticket: Ticket | None = None,
    gen: GenerationRequest | None = None,
    arrived_at: float | None = None,
) -> web.StreamResponse:
    """Send the request upstream and stream the answer back; settle the ticket."""
    client = services.client
    assert client is not None
    counter = TokenCounter(stream=bool(gen and gen.stream), sequences=gen.sequences if gen else 1)
    relay = _Relay(counter, ticket)
    sent_at = time.monotonic()
    batch_at_start = services.controller.inflight if services.controller else 0
    record = _record(request)
    record.forwarding(ticket, stream=gen.stream if gen else None)
    task = asyncio.current_task(services.loop)
    running = request.app[RUNNING]
    if task is not None:
        running.add(task)
    try:
        try:
            upstream = await client.forward(
                request.method,
                request.rel_url.raw_path_qs,  # as the client encoded it
                raw or None,
                record.upstream_headers(_engine_pinned(
                    _forward_headers(request.headers, _NOT_FORWARDED), services, ticket)),
                services.settings.read_timeout_s,
            )
        except ForwardError as exc:
            return record.upstream_failed(_upstream_failed(services, exc))
        except asyncio.CancelledError as exc:
            if not _drain_cut(exc):
                raise
            record.end = access_log.END_DRAIN
            return _draining(services)  # no answer yet at the end of the drain
        record.upstream_status = upstream.status
        try:
            return await _relay_response(request, upstream, services, record, relay,
                                         gen, ticket)
        finally:
            upstream.close()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        # The client went away while we wrote to it.
        return web.Response(status=499)
    finally:
        if task is not None:
            running.discard(task)
        if ticket is not None:
            counter.finish()
            tokens = counter.tokens
            ticket.finish(tokens if tokens else None, completed=relay.completed)
            if relay.completed:
                _observe(services, ticket, gen, arrived_at or sent_at, sent_at, relay.first_at,
                         tokens, batch_at_start)


class _Relay:
    """What passes through on its way to the client: tokens counted as they arrive, the
    first one's time, the server's own refusals, and whether the answer was complete."""

    __slots__ = ("completed", "counter", "first_at", "refusal", "ticket")

    def __init__(self, counter: TokenCounter, ticket: Ticket | None) -> None:
        self.counter = counter
        self.ticket = ticket
        self.first_at: float | None = None
        self.completed = False
        self.refusal = RefusalWatch(0)  # watches nothing until the answer's status is known

    def feed(self, chunk: bytes) -> None:
        self.refusal.feed(chunk)
        ticket = self.ticket
        if ticket is not None and self.counter.feed(chunk):
            if self.first_at is None:
                self.first_at = time.monotonic()
                ticket.first_token()
            ticket.progress(self.counter.tokens)


async def _relay_response(request: Incoming, upstream: ForwardResponse,
                          services: Services, record: access_log.RequestRecord,
                          relay: _Relay, gen: GenerationRequest | None,
                          ticket: Ticket | None) -> web.StreamResponse:
    relay.refusal = RefusalWatch(upstream.status)
    headers = _response_headers(upstream.headers, ticket, head=request.method == "HEAD")
    # Streams are passed on in whole events, so that the error event below is never
    # glued to half an event.
    events = (EventAligner() if gen is not None and gen.stream
              and upstream.content_type == "text/event-stream" else None)
    if events is None and upstream.received_whole:
        # The whole body came with the head (the usual plain answer): one write.
        body = upstream.take_received()
        relay.feed(body)
        response: web.StreamResponse = web.Response(
            status=upstream.status, reason=upstream.reason, body=body, headers=headers)
        _settle(services, upstream, relay)
        return response
    length = upstream.body_length
    # The body that came with the head goes out with it; the last of it with the end of
    # the answer: one write each where the server's answer was already there.
    first = upstream.take_received()
    if first:
        relay.feed(first)
        first = events.feed(first) if events is not None else first
    whole = upstream.received_whole
    if whole and events is not None:
        first += events.flush()
    response = await _start_stream(request, upstream.status, upstream.reason, headers,
                                   length if length is not None and not (gen and gen.stream)
                                   else None, first, end=whole)
    if whole:
        _settle(services, upstream, relay)
        return response
    last = b""
    try:
        while chunk := await upstream.read_chunk():
            relay.feed(chunk)
            out = events.feed(chunk) if events is not None else chunk
            if upstream.received_whole:
                last = out  # the end of the body: written with the end of the answer
                break
            if out:
                await response.write(out)
    except aiohttp.ClientConnectionResetError:
        raise  # writing to the client failed: it went away (handled by the caller)
    except asyncio.CancelledError as exc:
        if events is None or not _drain_cut(exc):
            raise
        # Still streaming at the end of the drain: end with an error event.
        record.end = access_log.END_DRAIN
        response.force_close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(response.write(events.error_event(
                b"data: " + DRAINED_EVENT + b"\n\n")), 1.0)
        return response
    except ForwardError as exc:
        # The server died or stalled mid-response: end the stream with an error the
        # client can see instead of leaving it hanging.
        kind = "timeout" if isinstance(exc, UpstreamTimeout) else "disconnect"
        services.metrics.upstream_errors.labels(kind).inc()
        record.broke(kind)
        if services.watcher is not None:
            services.watcher.poke()
        if events is not None:
            await response.write(events.error_event(b"data: " + BROKEN_EVENT + b"\n\n"))
        else:
            # A body cut short: only closing the connection says so, before the end of
            # the answer is written (a chunked answer's last chunk would pass it as whole).
            response.force_close()
            if request.transport is not None:
                request.transport.close()  # what was written is still sent first
        return response
    if events is not None:
        last += events.flush()
    await response.write_eof(last)
    _settle(services, upstream, relay)
    return response


async def _start_stream(request: Incoming, status: int, reason: str | None,
                        headers: list[tuple[str, str]], length: int | None, first: bytes,
                        *, end: bool) -> web.StreamResponse:
    """A streamed answer, its head sent with `first` (under `length` when the server gave
    one for a body that is not a stream), and ended with `end`."""
    if isinstance(request, LeanRequest):
        return request.start_stream(status, reason, headers, length, first, end=end)
    response = web.StreamResponse(status=status, reason=reason, headers=headers)
    if length is not None:
        response.content_length = length
    await response.prepare(request)
    if end:
        await response.write_eof(first)
    elif first:
        await response.write(first)
    return response


def _settle(services: Services, upstream: ForwardResponse, relay: _Relay) -> None:
    """The whole answer was passed on: count server errors and refusals."""
    refused = relay.refusal.reason()
    relay.completed = upstream.status < 400 and refused is None
    if upstream.status >= 500:
        services.metrics.upstream_errors.labels("status").inc()
    if refused is not None:
        services.server_refused(refused)


def _observe(services: Services, ticket: Ticket, gen: GenerationRequest | None,
             arrived_at: float, sent_at: float, first_at: float | None, output_tokens: int,
             batch_at_start: int) -> None:
    services.observe_completion(
        ticket,
        streamed=bool(gen and gen.stream),
        arrived_at=arrived_at,
        sent_at=sent_at,
        first_token_at=first_at,
        ended_at=time.monotonic(),
        output_tokens=output_tokens,
        batch_at_start=batch_at_start,
    )
