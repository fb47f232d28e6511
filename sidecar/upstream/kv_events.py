"""vLLM's KV cache events: what the server's prefix cache holds, as it changes.

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "ipc:///run/kvgate/kv-events.sock", "topic": "kv"}'` publishes, on a
ZMQ PUB socket it binds (`ipc://...` or `tcp://*:PORT`), one multipart message per
engine step that changed the cache:

    [topic, sequence number (8 bytes, big-endian, from 0 at every start), payload]

The payload is msgpack, vLLM's `KVEventBatch` (msgspec, `array_like`):
`[timestamp, [event, ...], data_parallel_rank]`. vLLM 0.32 encodes each event as a
map tagged with its class name (msgspec `tag=True`, fields equal to their default left
out), e.g.

    {"type": "BlockStored", "block_hashes": [13045047976661668585, ...],
     "parent_block_hash": None, "token_ids": [87, 285, ...], "block_size": 32,
     "lora_id": None, "medium": "GPU", "lora_name": None,
     "extra_keys": [None, ...], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

Older releases sent the same events as tagged arrays (`["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]`); both are decoded.
Block hashes are 64-bit integers by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`)
or bytes; they stay opaque. One `BlockStored` covers consecutive blocks of one request:
the first block's parent is `parent_block_hash`, each following block's parent is the
hash before it, and `token_ids` holds `block_size` tokens per block (a partial block,
registered by hybrid models, is one hash with `block_size` its own token count).
Checked on vLLM 0.32 (CPU build): a request's prompt blocks are stored when it is
scheduled, the blocks its output fills as it decodes; a prefix hit sends nothing (unless
the request asks `kv_cache_report_mode: "full"`); evictions send `BlockRemoved`;
`AllBlocksCleared` (a prefix-cache reset) is published with the next engine step's
events, not at the reset. With data parallelism each rank publishes on its own endpoint
(tcp port + rank) with its own sequence: one subscriber per rank.

This module decodes (`decode_batch`, pure) and subscribes (`KVEventSubscriber`); what
the events mean for admission is the consumer's business. Events carry prompt token
ids, which are user data: subscribe over `ipc://` inside the pod, never publish on a
reachable interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import urlsplit

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventError",
    "KVEventSubscriber",
    "check_endpoint",
    "decode_batch",
]

log = logging.getLogger("kvgate.upstream.kv_events")

# Undecodable messages are logged at most this often (they are always counted).
WARNING_INTERVAL_S = 60.0
# Messages queued in the SUB socket before ZMQ drops (then a sequence gap shows it).
RECEIVE_HWM = 100_000
# Reconnect to a publisher that went away every 100 ms, backing off to 2 s.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2_000
# ZMTP heartbeats: a TCP peer that stops answering for 3 s is dropped and reconnected.
HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 3_000


class KVEventError(ValueError):
    """A KV event message that cannot be decoded; the message says what is wrong."""


@dataclass(frozen=True)
class BlockStored:
    """The server cached these consecutive full blocks (one request's, in order)."""

    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None  # the block before the first; None: a prefix start
    token_ids: tuple[int, ...]  # block_size tokens per block
    block_size: int  # tokens per block
    lora_id: int | None
    # One entry per block (None or a tuple: LoRA name, (mm identifier, offset) pairs,
    # cache salt, prompt-embedding digests), or None when no block has any.
    extra_keys: object | None
    group_idx: int  # KV cache group (0 when the server has one)
    medium: str | None  # "GPU" (the server's device pool, also on CPU builds), "CPU", ...


@dataclass(frozen=True)
class BlockRemoved:
    """The server evicted these blocks from its prefix cache."""

    block_hashes: tuple[Hashable, ...]
    medium: str | None
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The server dropped its whole prefix cache (e.g. /reset_prefix_cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# Field order of vLLM's structs, for the tagged-array encoding of older releases
# (fields were only ever appended).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_CLEARED_FIELDS: tuple[str, ...] = ()
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS,
           "AllBlocksCleared": _CLEARED_FIELDS}


# ------------------------------------------------------------------------ decoding


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one message's payload, in order. Event kinds this version does
    not know are skipped (a newer vLLM may add some); anything malformed raises
    `KVEventError`."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise KVEventError(f"payload is not msgpack ({type(exc).__name__}: {exc})") from exc
    if isinstance(batch, Mapping):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise KVEventError(f"batch must be [timestamp, events, rank], got {_kind(batch)}")
    if not isinstance(events, list):
        raise KVEventError(f"batch events must be an array, got {_kind(events)}")
    decoded: list[KVEvent] = []
    for index, raw in enumerate(events):
        try:
            event = _decode_event(raw)
        except KVEventError as exc:
            raise KVEventError(f"event {index}: {exc}") from None
        if event is not None:
            decoded.append(event)
    return decoded


def _decode_event(raw: object) -> KVEvent | None:
    fields: Mapping[Any, Any]
    if isinstance(raw, Mapping):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KVEventError(f"must be a tagged map or array, got {_kind(raw)}")
    if not isinstance(tag, str):
        raise KVEventError(f"event type must be a string, got {_kind(tag)}")
    if tag == "BlockStored":
        hashes = _hashes(fields, "block_hashes")
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise KVEventError(f"BlockStored token_ids must be integers, got {_kind(tokens)}")
        block_size = fields.get("block_size")
        if not _is_int(block_size) or block_size < 1:
            raise KVEventError(f"BlockStored block_size must be a positive integer, "
                               f"got {block_size!r}")
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_id=_optional_int(fields, "lora_id"),
            extra_keys=_extra_keys(fields.get("extra_keys")),
            group_idx=_optional_int(fields, "group_idx") or 0,
            medium=_optional_str(fields, "medium"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields, "block_hashes"),
            medium=_optional_str(fields, "medium"),
            group_idx=_optional_int(fields, "group_idx") or 0,
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _hash(value: object, name: str) -> Hashable:
    if isinstance(value, bytes) or _is_int(value):
        return value
    raise KVEventError(f"{name} must be bytes or an integer, got {_kind(value)}")


def _hashes(fields: Mapping[Any, Any], name: str) -> tuple[Hashable, ...]:
    value = fields.get(name)
    if not isinstance(value, list):
        raise KVEventError(f"{name} must be an array, got {_kind(value)}")
    return tuple(_hash(item, name) for item in value)


def _optional_int(fields: Mapping[Any, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None or _is_int(value):
        return value
    raise KVEventError(f"{name} must be an integer or nil, got {_kind(value)}")


def _optional_str(fields: Mapping[Any, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise KVEventError(f"{name} must be a string or nil, got {_kind(value)}")


def _freeze(value: object) -> object:
    if isinstance(value, list):
        return tuple(_freeze(item) for item in value)
    if isinstance(value, Mapping):
        return tuple(sorted(((_freeze(k), _freeze(v)) for k, v in value.items()), key=repr))
    return value


def _extra_keys(value: object) -> object | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise KVEventError(f"extra_keys must be an array or nil, got {_kind(value)}")
    if all(item is None for item in value):
        return None
    return _freeze(value)


# ---------------------------------------------------------------------- endpoints


def check_endpoint(endpoint: str) -> str:
    """`endpoint` if a subscriber can connect to it (`tcp://host:port`,
    `ipc:///absolute/path`), else ValueError saying why."""
    parts = urlsplit(endpoint)
    if parts.scheme == "ipc":
        if not endpoint.startswith("ipc:///") or len(endpoint) <= len("ipc:///"):
            raise ValueError("an ipc endpoint needs an absolute path, e.g. "
                             "ipc:///run/kvgate/kv-events.sock")
        return endpoint
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        host = parts.hostname
        if not host or host == "*" or "*" in endpoint:
            raise ValueError("a tcp endpoint needs the publisher's address, not a wildcard, "
                             "e.g. tcp://127.0.0.1:5557")
        if port is None or port == 0 or parts.path not in ("", "/") or parts.query:
            raise ValueError("a tcp endpoint is tcp://host:port, e.g. tcp://127.0.0.1:5557")
        return endpoint
    raise ValueError("must be tcp://host:port or ipc:///path, e.g. "
                     "ipc:///run/kvgate/kv-events.sock")


# --------------------------------------------------------------------- subscriber


class KVEventSubscriber:
    """Receives vLLM's KV events and hands each batch to `on_events`.

    `on_gap()` is called before a batch when batches may have been missed: its
    sequence number does not follow the previous one (the server restarted, or ZMQ
    dropped messages), the connection was lost since the previous batch, or a
    message could not be decoded. The consumer then drops its view of the server's
    cache and rebuilds it from the events that follow. The first batch received is
    not a gap: the consumer starts from nothing anyway.

    ZMQ reconnects by itself (every 100 ms, backing off to 2 s) to a publisher that
    went away or is not there yet, and re-sends the subscription; `connected` says
    whether a connection is up. Callbacks run on the event loop and must not block;
    one that raises is logged, and receiving goes on.
    """

    def __init__(
        self,
        endpoint: str,
        on_events: Callable[[Sequence[KVEvent]], None],
        on_gap: Callable[[], None],
        topic: str = "kv",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = check_endpoint(endpoint)
        self.topic = topic
        self._topic = topic.encode()
        self._on_events = on_events
        self._on_gap = on_gap
        self._clock = clock
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_seq: int | None = None
        self._lost_connection = False
        self._connected = False
        self._last_event_s: float | None = None
        self._batches = 0
        self._gaps = 0
        self._decode_errors = 0
        self._unlogged_errors = 0
        self._last_warning_s: float | None = None

    # ------------------------------------------------------------------ state
    @property
    def connected(self) -> bool:
        """A connection to the publisher is up (ZMTP handshake done)."""
        return self._connected

    @property
    def last_event_s(self) -> float | None:
        """Clock time of the last batch delivered; None before the first."""
        return self._last_event_s

    @property
    def batches(self) -> int:
        """Batches delivered to `on_events`."""
        return self._batches

    @property
    def gaps(self) -> int:
        """Times `on_gap` was called for a sequence gap or a lost connection."""
        return self._gaps

    @property
    def decode_errors(self) -> int:
        """Messages that could not be decoded (each also calls `on_gap`)."""
        return self._decode_errors

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Connect and start receiving; returns at once (the publisher may come later)."""
        if self._context is not None:
            raise RuntimeError("KVEventSubscriber already started")
        context = zmq.asyncio.Context()
        self._context = context
        try:
            sock = context.socket(zmq.SUB)
            self._socket = sock
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            self._monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.endpoint)
        except BaseException:
            await self.close()
            raise
        self._tasks = [
            asyncio.create_task(self._receive(), name=f"kv-events {self.endpoint}"),
            asyncio.create_task(self._watch(), name=f"kv-events monitor {self.endpoint}"),
        ]

    async def close(self) -> None:
        """Stop receiving and release the sockets and the context. Idempotent."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        sock, monitor, context = self._socket, self._monitor, self._context
        self._socket = self._monitor = self._context = None
        if sock is not None and monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        if monitor is not None:
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)
        if context is not None:
            context.term()
        self._connected = False

    # ------------------------------------------------------------- receiving
    async def _receive(self) -> None:
        assert self._socket is not None
        sock = self._socket
        while True:
            frames = await sock.recv_multipart()
            self.handle_message(frames)

    async def _watch(self) -> None:
        assert self._monitor is not None
        monitor = self._monitor
        while True:
            message = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(message)["event"]
            except (ValueError, KeyError, IndexError):
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                # One endpoint, one connection: what is published until the next is lost.
                self._connected = False
                self._lost_connection = True

    def handle_message(self, frames: Sequence[bytes]) -> None:
        """One received multipart message (public for tests and replay)."""
        if len(frames) != 3:
            self._undecodable(f"expected 3 frames (topic, sequence, payload), "
                              f"got {len(frames)}")
            return
        topic, seq_bytes, payload = frames
        if self._topic and topic != self._topic:
            return  # ZMQ subscriptions match prefixes: "kv" also lets "kv2" through
        if len(seq_bytes) != 8:
            self._undecodable(f"sequence number must be 8 bytes, got {len(seq_bytes)}")
            return
        seq = int.from_bytes(seq_bytes, "big")
        gap = self._last_seq is not None and (
            seq != self._last_seq + 1 or self._lost_connection)
        self._last_seq = seq
        self._lost_connection = False
        if gap:
            self._gaps += 1
            self._call(self._on_gap)
        try:
            events = decode_batch(payload)
        except KVEventError as exc:
            self._undecodable(f"batch {seq}: {exc}")
            return
        self._batches += 1
        self._last_event_s = self._clock()
        self._call(self._on_events, events)

    def _undecodable(self, reason: str) -> None:
        self._decode_errors += 1
        self._unlogged_errors += 1
        # The batch is lost to the consumer like a missed one.
        self._call(self._on_gap)
        now = self._clock()
        if self._last_warning_s is None or now - self._last_warning_s >= WARNING_INTERVAL_S:
            log.warning("KV events from %s: %d undecodable message(s) (%d in all), the last: "
                        "%s", self.endpoint, self._unlogged_errors, self._decode_errors, reason)
            self._last_warning_s = now
            self._unlogged_errors = 0

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("KV events from %s: the consumer failed", self.endpoint)
