"""The composition root: wire settings, model, admission, upstream, metrics and routes
into aiohttp applications, and run them with a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry

from sidecar import __version__, compiled_modules
from sidecar.model import ModelArchitecture, ModelError, read_architecture
from sidecar.server import access_log, admin, proxy
from sidecar.server.front import FrontConnection, FrontDoor
from sidecar.server.keys import SERVICES, SESSION
from sidecar.server.requests import ROUTES
from sidecar.server.services import Services, resolve_gpu
from sidecar.server.settings import ServeSettings
from sidecar.tokens import TokenizerFilesError, find_files
from sidecar.upstream import Http1Pool, UpstreamClient, UpstreamWatcher

log = logging.getLogger("kvgate")


class ListenError(OSError):
    """A port kvgate was told to listen on cannot be bound; the message names its flag."""

WATCHER_TASK = web.AppKey("watcher_task", asyncio.Task[None])
IDLE_TIMEOUT_S = 75.0


class QuietMalformedRequests(logging.Filter):
    """aiohttp logs every malformed request (a 400 from its HTTP parser) as an error
    with a traceback that quotes the offending bytes: noise any client can cause, and
    bytes that may be part of a prompt. Keep one DEBUG line without the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "refused a malformed request from %s (%s %s)"
            record.args = (remote, exc.code, exc.__class__.__name__)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            # The logger's own level was checked for ERROR: check again for DEBUG.
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def build_services(settings: ServeSettings, registry: CollectorRegistry) -> Services:
    """Resolve what can be resolved before the server answers (fails fast on bad input)."""
    arch: ModelArchitecture | None = None
    if settings.model:
        try:
            arch = read_architecture(settings.model)
        except ModelError as exc:
            raise ModelError(f"--model-config: {exc}") from exc
    if settings.tokenizer:
        try:
            find_files(settings.tokenizer)  # fails fast: the error names the problem
        except TokenizerFilesError as exc:
            raise TokenizerFilesError(f"--tokenizer: {exc}") from exc
    return Services(settings, registry, arch=arch, gpu=resolve_gpu(settings),
                    version=__version__)


async def _access_log_context(access: access_log.AccessLog,
                              app: web.Application) -> AsyncIterator[None]:
    """The access log's writer thread runs while the application does."""
    access.start()
    try:
        yield
    finally:
        access.close()


def build_app(services: Services, registry: CollectorRegistry) -> web.Application:
    settings = services.settings
    access = access_log.AccessLog(settings.access_log, settings.access_log_format)
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[
        access_log.middleware(access, (proxy.generation, proxy.passthrough), proxy.DRAIN_CUT),
        admin.admin_token])
    app[SERVICES] = services
    app[access_log.ACCESS_LOG] = access
    app.cleanup_ctx.append(functools.partial(_access_log_context, access))
    app.on_response_prepare.append(access_log.on_prepare)
    app[admin.REGISTRY] = registry
    app[proxy.RUNNING] = set()
    app.cleanup_ctx.append(_upstream_context)
    admin.add_admin_routes(app, introspection=settings.admin_port is None)
    for path in ROUTES:
        app.router.add_post(path, proxy.generation)
    app.router.add_route("*", "/{tail:.*}", proxy.passthrough)
    return app


def build_admin_app(services: Services, registry: CollectorRegistry) -> web.Application:
    app = web.Application(middlewares=[admin.admin_token])
    app[SERVICES] = services
    app[admin.REGISTRY] = registry
    app.on_response_prepare.append(access_log.on_prepare)
    admin.add_admin_routes(app, introspection=True)
    return app


def upstream_session(settings: ServeSettings) -> aiohttp.ClientSession:
    """Connections for kvgate's own questions to the server (models, metrics, token
    ids), idle ones closed before the server closes them (`--upstream-keepalive-s`)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0,
                                     keepalive_timeout=settings.upstream_keepalive_s)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False)


def forwarding_pool(settings: ServeSettings) -> Http1Pool:
    """The connections forwarded requests take: unbounded (admission bounds what is
    sent), idle ones closed before the server closes them (`--upstream-keepalive-s`)."""
    return Http1Pool(settings.upstream, connect_timeout_s=settings.connect_timeout_s,
                     keepalive_s=settings.upstream_keepalive_s)


async def _upstream_context(app: web.Application) -> AsyncIterator[None]:
    services = app[SERVICES]
    settings = services.settings
    async with upstream_session(settings) as session:
        app[SESSION] = session
        pool = forwarding_pool(settings)
        client = UpstreamClient(settings.upstream, session, pool,
                                control_timeout_s=max(2.0, settings.connect_timeout_s))
        watcher = UpstreamWatcher(client, interval_s=settings.metrics_interval_s,
                                  on_update=services.on_upstream)
        services.attach(client, watcher)
        services.start_tokenizer()
        await services.start_kv_events()
        task = asyncio.create_task(watcher.run(), name="kvgate-upstream-watcher")
        app[WATCHER_TASK] = task
        try:
            yield
            await services.stop_kv_events()
            await services.prompts.aclose()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            await pool.close()


async def serve(settings: ServeSettings, *, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `stop`), then drain and exit 0."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, QuietMalformedRequests) for f in server_log.filters):
        server_log.addFilter(QuietMalformedRequests())
    registry = CollectorRegistry()
    services = build_services(settings, registry)
    app = build_app(services, registry)
    runners: list[web.AppRunner] = []
    app[admin.RUNNERS] = runners
    # The drain has given running requests their time already: at shutdown aiohttp
    # waits up to twice this long before it cancels the ones left. Idle connections
    # (also ones that never send a request) close after 75 s, not aiohttp's hour.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=1.0, keepalive_timeout=IDLE_TIMEOUT_S)
    runners.append(runner)
    lean_connections: set[FrontConnection] = set()
    if settings.front_end == "lean":
        app[admin.FRONT_CONNECTIONS] = lean_connections  # (the app is frozen once set up)
    await runner.setup()
    front: FrontDoor | None = None
    # What listens where, started in this order: (the flag that set the port, port, start).
    listeners: list[tuple[str, int, Callable[[], Awaitable[None]]]] = []
    if settings.front_end == "lean":
        assert runner.server is not None
        front = FrontDoor(app, proxy.generation, runner.server, access=app[access_log.ACCESS_LOG],
                          routes=frozenset(ROUTES), max_body_bytes=settings.max_body_bytes,
                          idle_timeout_s=IDLE_TIMEOUT_S, drain_cut=proxy.DRAIN_CUT,
                          connections=lean_connections)
        listeners.append(("--port", settings.port, functools.partial(
            front.start, settings.host, settings.port, backlog=4096)))
    else:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=4096)
        listeners.append(("--port", settings.port, site.start))
    admin_runner: web.AppRunner | None = None
    if settings.admin_port is not None:
        admin_app = build_admin_app(services, registry)
        admin_app[admin.RUNNERS] = runners
        if front is not None:
            admin_app[admin.FRONT_CONNECTIONS] = lean_connections
        admin_runner = web.AppRunner(admin_app, access_log=None,
                                     keepalive_timeout=IDLE_TIMEOUT_S)
        runners.append(admin_runner)
        await admin_runner.setup()
        admin_site = web.TCPSite(admin_runner, settings.host, settings.admin_port)
        listeners.append(("--admin-port", settings.admin_port, admin_site.start))
    for flag, port, start in listeners:
        try:
            await start()
        except OSError as exc:
            raise ListenError(f"cannot listen on {settings.host}:{port} ({flag}): "
                              f"{exc.strerror or exc}") from exc
    compiled = len(compiled_modules())
    log.info("kvgate %s (%s) listening on %s:%d, upstream %s, mode %s", __version__,
             f"{compiled} modules compiled" if compiled else "pure Python", settings.host,
             settings.port, settings.upstream, settings.mode)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        await drain(services, settings.drain_timeout_s, app[proxy.RUNNING])
    finally:
        if front is not None:
            await front.stop(timeout_s=1.0)
        await runner.cleanup()
        if admin_runner is not None:
            await admin_runner.cleanup()
    log.info("kvgate stopped")
    return 0


async def drain(services: Services, timeout_s: float,
                running: set[asyncio.Task[Any]] | None = None) -> None:
    """Refuse new work, let running requests finish within the timeout, then end
    the ones left (streams get an error event)."""
    log.info("draining: %d requests in flight, up to %.0f s", services.active_requests,
             timeout_s)
    services.draining = True
    if services.controller is not None:
        services.controller.drain(timeout_s)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(services.idle.wait(), timeout_s)
    if services.active_requests:
        log.warning("drain timeout: %d requests still running are cut off",
                    services.active_requests)
        left = list(running or ())
        for task in left:
            task.cancel(proxy.DRAIN_CUT)
        if left:
            await asyncio.wait(left, timeout=2.0)
