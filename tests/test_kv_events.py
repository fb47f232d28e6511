"""vLLM's KV cache events: decoding (real-shaped payloads and broken ones), sequence
gaps, the subscriber's sockets (ipc and tcp, a publisher that restarts), and a real
vLLM CPU server publishing with `--kv-events-config`."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from sidecar.server.settings import SettingsError, load_settings
from sidecar.upstream.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventError,
    KVEventSubscriber,
    check_endpoint,
    decode_batch,
)

from support.env import free_port, model_dir, vllm_python
from support.vllm_server import VllmServer

BLOCK = 32

# Exactly what vLLM 0.32 (CPU build) sent for a 231-token prompt: one BlockStored with
# 7 full blocks, 64-bit integer hashes, tagged maps, defaults left out.
STORED_0_32: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [13045047976661668585, 16711096143798668083, 10356036646808016443],
    "parent_block_hash": None,
    "token_ids": list(range(3 * BLOCK)),
    "block_size": BLOCK,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}


def pack(events: list[Any], ts: float = 1796039568.5, rank: int | None = 0) -> bytes:
    batch: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    payload: bytes = msgpack.packb(batch)
    return payload


def frames(seq: int, events: list[Any], topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), pack(events)]


# ------------------------------------------------------------------------ decoding


def test_decodes_what_vllm_0_32_sends() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [16711096143798668083],
               "medium": "GPU", "group_idx": 0}
    events = decode_batch(pack([STORED_0_32, removed, {"type": "AllBlocksCleared"}]))
    assert events == [
        BlockStored(
            block_hashes=(13045047976661668585, 16711096143798668083, 10356036646808016443),
            parent_block_hash=None,
            token_ids=tuple(range(3 * BLOCK)),
            block_size=BLOCK,
            lora_id=None,
            extra_keys=None,  # a None per block: no block has extra keys
            group_idx=0,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(16711096143798668083,), medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]
    assert hash(events[0]) == hash(decode_batch(pack([STORED_0_32]))[0])


def test_missing_optional_fields_and_bytes_hashes() -> None:
    parent, first, second = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    minimal = {"type": "BlockStored", "block_hashes": [first, second],
               "parent_block_hash": parent, "token_ids": list(range(2 * BLOCK)),
               "block_size": BLOCK}
    removed = {"type": "BlockRemoved", "block_hashes": [first]}
    stored, gone = decode_batch(pack([minimal, removed], rank=None))
    assert stored == BlockStored((first, second), parent, tuple(range(2 * BLOCK)), BLOCK,
                                 lora_id=None, extra_keys=None, group_idx=0, medium=None)
    assert gone == BlockRemoved((first,), medium=None, group_idx=0)


def test_extra_keys_stay_per_block() -> None:
    salted = dict(STORED_0_32, lora_id=3, lora_name="adapter", group_idx=1,
                  extra_keys=[["adapter", "salt"], None, ["adapter", ["mm-1", 16]]])
    (event,) = decode_batch(pack([salted]))
    assert isinstance(event, BlockStored)
    assert event.extra_keys == (("adapter", "salt"), None, ("adapter", ("mm-1", 16)))
    assert (event.lora_id, event.group_idx) == (3, 1)
    hash(event)  # frozen all the way down


def test_tagged_arrays_of_older_releases() -> None:
    stored = ["BlockStored", [7, 8], 6, list(range(2 * BLOCK)), BLOCK, None, "GPU"]
    removed = ["BlockRemoved", [7], "GPU"]
    assert decode_batch(pack([stored, removed, ["AllBlocksCleared"]])) == [
        BlockStored((7, 8), 6, tuple(range(2 * BLOCK)), BLOCK, None, None, 0, "GPU"),
        BlockRemoved((7,), "GPU", 0),
        AllBlocksCleared(),
    ]


def test_unknown_event_kinds_are_skipped() -> None:
    assert decode_batch(pack([{"type": "BlockPinned", "block_hashes": [1]},
                              {"type": "AllBlocksCleared"}])) == [AllBlocksCleared()]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1.0}), "events must be an array"),
        (msgpack.packb("hello"), "batch must be"),
        (pack([{"type": "BlockStored", "token_ids": [], "block_size": 32}]),
         "event 0: block_hashes must be an array"),
        (pack([{"type": "AllBlocksCleared"}, dict(STORED_0_32, block_hashes=["a"])]),
         "event 1: block_hashes must be bytes or an integer, got str"),
        (pack([dict(STORED_0_32, parent_block_hash=[1])]),
         "parent_block_hash must be bytes or an integer, got list"),
        (pack([dict(STORED_0_32, token_ids=[1, "2"])]), "token_ids must be integers"),
        (pack([dict(STORED_0_32, block_size=0)]), "block_size must be a positive integer"),
        (pack([dict(STORED_0_32, medium=1)]), "medium must be a string or nil"),
        (pack([dict(STORED_0_32, lora_id="x")]), "lora_id must be an integer or nil"),
        (pack([dict(STORED_0_32, extra_keys="salt")]), "extra_keys must be an array or nil"),
        (pack([{"type": 3}]), "event type must be a string"),
        (pack([42]), "must be a tagged map or array"),
    ],
    ids=["not-msgpack", "map-without-events", "not-a-batch", "no-hashes", "str-hash",
         "list-parent", "str-token", "zero-block-size", "int-medium", "str-lora",
         "str-extra-keys", "int-type", "int-event"],
)
def test_malformed_payloads_say_what_is_wrong(payload: bytes, message: str) -> None:
    with pytest.raises(KVEventError, match=message):
        decode_batch(payload)


# ----------------------------------------------------------------- gaps and errors


class Recorder:
    """The consumer's side: what arrived, in order ("gap" or a list of events)."""

    def __init__(self) -> None:
        self.log: list[str | list[KVEvent]] = []

    def on_events(self, events: Sequence[KVEvent]) -> None:
        self.log.append(list(events))

    def on_gap(self) -> None:
        self.log.append("gap")

    @property
    def batches(self) -> list[list[KVEvent]]:
        return [entry for entry in self.log if isinstance(entry, list)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def subscriber(recorder: Recorder, clock: Callable[[], float] = time.monotonic,
               endpoint: str = "tcp://127.0.0.1:5557") -> KVEventSubscriber:
    return KVEventSubscriber(endpoint, recorder.on_events, recorder.on_gap, clock=clock)


def test_a_sequence_gap_calls_on_gap_before_the_batch() -> None:
    recorder, clock = Recorder(), FakeClock()
    sub = subscriber(recorder, clock)
    cleared = [{"type": "AllBlocksCleared"}]
    assert sub.last_event_s is None
    for seq in (3, 4, 5):  # joining mid-stream is not a gap: there is nothing to drop
        sub.handle_message(frames(seq, cleared))
    assert recorder.log == [[AllBlocksCleared()]] * 3 and sub.gaps == 0
    clock.now = 101.0
    sub.handle_message(frames(9, cleared))  # 6, 7, 8 were lost
    assert recorder.log[-2:] == ["gap", [AllBlocksCleared()]]
    sub.handle_message(frames(10, cleared))
    sub.handle_message(frames(0, [STORED_0_32]))  # the server restarted
    assert recorder.log[-3:] == [[AllBlocksCleared()], "gap", decode_batch(pack([STORED_0_32]))]
    assert (sub.gaps, sub.batches, sub.decode_errors, sub.last_event_s) == (2, 6, 0, 101.0)


def test_a_lost_connection_is_a_gap_even_when_the_numbers_follow() -> None:
    recorder = Recorder()
    sub = subscriber(recorder)
    sub.handle_message(frames(0, []))
    sub._lost_connection = True  # what the monitor records on EVENT_DISCONNECTED
    sub.handle_message(frames(1, []))
    sub.handle_message(frames(2, []))
    assert recorder.log == [[], "gap", [], []] and sub.gaps == 1


def test_other_topics_are_ignored() -> None:
    recorder = Recorder()
    sub = subscriber(recorder)
    sub.handle_message(frames(0, [], topic=b"kv-other"))  # a SUB prefix match
    assert recorder.log == [] and sub.batches == 0


def test_undecodable_messages_are_counted_lost_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder, clock = Recorder(), FakeClock()
    sub = subscriber(recorder, clock)
    caplog.set_level(logging.WARNING, logger="kvgate.upstream.kv_events")
    sub.handle_message(frames(0, []))
    sub.handle_message([b"kv", (1).to_bytes(8, "big"), b"\xc1"])
    clock.now += 30
    sub.handle_message([b"kv", b"\x00", b""])
    sub.handle_message([b"kv"])
    sub.handle_message(frames(2, []))  # 1 was undecodable: no second gap for it
    assert sub.decode_errors == 3 and sub.gaps == 0 and sub.batches == 2
    assert recorder.log == [[], "gap", "gap", "gap", []]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "batch 1: payload is not msgpack" in warnings[0]
    clock.now += 31
    sub.handle_message([b"kv", (3).to_bytes(8, "big"), pack([42])])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "3 undecodable message(s) (4 in all)" in warnings[1], warnings[1]
    assert "batch 3: event 0: must be a tagged map or array" in warnings[1]


def test_a_failing_consumer_does_not_stop_the_stream(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    def on_events(events: Sequence[KVEvent]) -> None:
        seen.append(len(events))
        raise RuntimeError("consumer bug")

    sub = KVEventSubscriber("ipc:///tmp/kv.sock", on_events, lambda: None)
    with caplog.at_level(logging.ERROR, logger="kvgate.upstream.kv_events"):
        sub.handle_message(frames(0, []))
        sub.handle_message(frames(1, [STORED_0_32]))
    assert seen == [0, 1] and sub.batches == 2
    assert "the consumer failed" in caplog.text


# ------------------------------------------------------------------------ endpoints


@pytest.mark.parametrize(
    "endpoint", ["ipc:///run/kvgate/kv-events.sock", "tcp://127.0.0.1:5557",
                 "tcp://vllm.local:5557", "tcp://[::1]:5557"])
def test_endpoints_a_subscriber_can_reach(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("tcp://*:5557", "not a wildcard"),
        ("tcp://127.0.0.1", "tcp://host:port"),
        ("tcp://127.0.0.1:0", "tcp://host:port"),
        ("tcp://127.0.0.1:5557/x", "tcp://host:port"),
        ("ipc://relative.sock", "absolute path"),
        ("ipc:///", "absolute path"),
        ("inproc://kv", "tcp://host:port or ipc:///path"),
        ("127.0.0.1:5557", "tcp://host:port or ipc:///path"),
    ],
)
def test_endpoints_refused(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_endpoint(endpoint)
    with pytest.raises(ValueError, match=message):
        KVEventSubscriber(endpoint, lambda events: None, lambda: None)


def test_the_setting_is_validated() -> None:
    base = {"upstream": "http://127.0.0.1:8000"}
    assert load_settings(base, environ={}).kv_events_endpoint is None
    settings = load_settings(
        base, environ={"KVGATE_KV_EVENTS_ENDPOINT": "ipc:///run/kvgate/kv-events.sock"})
    assert settings.kv_events_endpoint == "ipc:///run/kvgate/kv-events.sock"
    with pytest.raises(SettingsError) as error:
        load_settings({**base, "kv_events_endpoint": "tcp://*:5557"}, environ={})
    assert error.value.lines == [
        "--kv-events-endpoint: a tcp endpoint needs the publisher's address, not a wildcard, "
        "e.g. tcp://127.0.0.1:5557 (got 'tcp://*:5557')"
    ]


# -------------------------------------------------------------- sockets, in-process


class Publisher:
    """A PUB socket that speaks vLLM's framing."""

    def __init__(self, endpoint: str, topic: bytes = b"kv") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)
        self.topic = topic
        self.seq = 0

    def send(self, events: list[Any]) -> None:
        self.socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), pack(events)])
        self.seq += 1

    async def send_until_received(self, sub: KVEventSubscriber, events: list[Any]) -> None:
        """PUB drops what it sends before the subscription arrives: send until one lands."""
        before = sub.batches
        deadline = time.monotonic() + 10
        while sub.batches == before:
            assert time.monotonic() < deadline, "nothing received in 10 s"
            self.send(events)
            await asyncio.sleep(0.05)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def until(condition: Callable[[], bool], within_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        await asyncio.sleep(0.02)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for ipc sockets (a socket path has ~100 bytes at most)."""
    with tempfile.TemporaryDirectory(prefix="kvgate-", dir="/tmp") as path:
        yield Path(path)


async def test_ipc_subscriber_waits_for_and_follows_a_restarting_publisher(
    short_dir: Path,
) -> None:
    endpoint = f"ipc://{short_dir}/kv-events.sock"
    recorder = Recorder()
    sub = subscriber(recorder, endpoint=endpoint)
    await sub.start()
    try:
        await asyncio.sleep(0.3)  # no publisher yet: ZMQ keeps trying
        assert not sub.connected
        first = Publisher(endpoint)
        try:
            await until(lambda: sub.connected, what="a connection")
            await first.send_until_received(sub, [STORED_0_32])
            first.send([{"type": "AllBlocksCleared"}])
            await until(lambda: recorder.log[-1] == [AllBlocksCleared()], what="the next batch")
        finally:
            first.close()
        await until(lambda: not sub.connected, what="the disconnect")
        assert sub.gaps == 0 and "gap" not in recorder.log

        second = Publisher(endpoint)  # the server restarted: numbers start at 0 again
        try:
            await until(lambda: sub.connected, what="the reconnection")
            await second.send_until_received(sub, [STORED_0_32])
        finally:
            second.close()
        assert sub.gaps == 1
        gap = recorder.log.index("gap")
        assert recorder.log[gap - 1] == [AllBlocksCleared()]
        assert recorder.log[gap + 1] == decode_batch(pack([STORED_0_32]))
    finally:
        await sub.close()
    assert not sub.connected


async def test_tcp_loopback_and_close_leaves_nothing_behind() -> None:
    port = free_port()
    recorder = Recorder()
    sub = subscriber(recorder, endpoint=f"tcp://127.0.0.1:{port}")
    tasks_before = asyncio.all_tasks()
    await sub.start()
    publisher = Publisher(f"tcp://127.0.0.1:{port}")
    try:
        await publisher.send_until_received(sub, [STORED_0_32])
        assert sub.connected and sub.last_event_s is not None
        assert recorder.batches[-1] == decode_batch(pack([STORED_0_32]))
        with pytest.raises(RuntimeError, match="already started"):
            await sub.start()
    finally:
        publisher.close()
        await sub.close()
        await sub.close()  # idempotent
    assert asyncio.all_tasks() == tasks_before
    assert sub._socket is None and sub._context is None


# ---------------------------------------------------------------- a real vLLM server


@pytest.fixture(scope="module", params=["tcp", "ipc"])
def kv_events_vllm(request: pytest.FixtureRequest) -> Iterator[tuple[VllmServer, str]]:
    """One real vLLM CPU server per transport, publishing KV events: (server, the
    endpoint a subscriber connects to). tcp: vLLM binds `tcp://*:PORT` (it binds only
    wildcard addresses), the subscriber connects to 127.0.0.1; ipc: a socket file."""
    with tempfile.TemporaryDirectory(prefix="kvgate-", dir="/tmp") as directory:
        if request.param == "tcp":
            port = free_port()
            published, subscribed = f"tcp://*:{port}", f"tcp://127.0.0.1:{port}"
        else:
            published = subscribed = f"ipc://{directory}/kv-events.sock"
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": published, "topic": "kv"}
        server = VllmServer(
            vllm_python(), str(model_dir("tiny-llama")), "tiny-llama", free_port(),
            max_model_len=1024, block_size=BLOCK, num_gpu_blocks_override=64,
            extra_args=["--kv-events-config", json.dumps(config)],
            # POST /reset_prefix_cache (AllBlocksCleared) is a development route.
            env={"VLLM_SERVER_DEV_MODE": "1"},
        )
        server.start()
        try:
            yield server, subscribed
        finally:
            server.stop()


def unique_prompt(words: int) -> str:
    """A prompt no earlier request shares a block with (prefix caching would skip it):
    ~4 tokens a word under 100 words, 5 above."""
    return uuid.uuid4().hex[:8] + " " + " ".join(f"word{i}" for i in range(words))


async def tokenize(server: VllmServer, prompt: str) -> list[int]:
    status, body = await asyncio.to_thread(
        server.post_json, "/tokenize", {"model": "tiny-llama", "prompt": prompt})
    assert status == 200, body
    tokens: list[int] = json.loads(body)["tokens"]
    return tokens


async def complete(server: VllmServer, prompt: str, max_tokens: int) -> None:
    status, body = await asyncio.to_thread(
        server.post_json, "/v1/completions",
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
         "ignore_eos": True, "temperature": 0})
    assert status == 200, body


def stored(recorder: Recorder) -> list[BlockStored]:
    return [e for batch in recorder.batches for e in batch if isinstance(e, BlockStored)]


def chain(events: list[BlockStored]) -> tuple[list[Any], list[int]]:
    """The hashes and tokens of consecutive BlockStored events, checking each event's
    parent is the block before it."""
    hashes: list[Any] = []
    tokens: list[int] = []
    for event in events:
        assert event.parent_block_hash == (hashes[-1] if hashes else None), (
            "parent_block_hash does not link to the previous block")
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        hashes += event.block_hashes
        tokens += event.token_ids
    return hashes, tokens


async def subscribed_to(endpoint: str, recorder: Recorder) -> KVEventSubscriber:
    sub = subscriber(recorder, endpoint=endpoint)
    await sub.start()
    await until(lambda: sub.connected, what=f"a connection to {endpoint}")
    await asyncio.sleep(0.3)  # the subscription reaches the publisher
    return sub


@pytest.mark.vllm
@pytest.mark.slow
async def test_real_vllm_reports_stored_blocks_with_their_tokens_and_parents(
    kv_events_vllm: tuple[VllmServer, str],
) -> None:
    server, endpoint = kv_events_vllm
    recorder = Recorder()
    sub = await subscribed_to(endpoint, recorder)
    try:
        words = 50
        prompt = unique_prompt(words)
        tokens = await tokenize(server, prompt)
        while len(tokens) % BLOCK == 0:  # the tail must be a partial block (see below)
            words += 1
            prompt = unique_prompt(words)
            tokens = await tokenize(server, prompt)
        assert len(tokens) > 2 * BLOCK + 8, len(tokens)
        # Decoding past the next block boundary makes vLLM store one more block, a
        # child of the prompt's last full block.
        prompt_blocks = len(tokens) // BLOCK
        max_tokens = (prompt_blocks + 1) * BLOCK - len(tokens) + 4
        await complete(server, prompt, max_tokens)
        await until(lambda: sum(len(e.block_hashes) for e in stored(recorder))
                    >= prompt_blocks + 1, what="BlockStored for every full block")
        events = stored(recorder)
        hashes, stored_tokens = chain(events)
        assert len(hashes) == prompt_blocks + 1 == len(set(hashes))
        assert stored_tokens[: prompt_blocks * BLOCK] == tokens[: prompt_blocks * BLOCK]
        assert stored_tokens[prompt_blocks * BLOCK: len(tokens)] == tokens[prompt_blocks * BLOCK:]
        for event in events:
            assert (event.block_size, event.group_idx, event.medium) == (BLOCK, 0, "GPU")
            assert event.lora_id is None and event.extra_keys is None
            assert all(isinstance(h, int) for h in event.block_hashes)
        assert sub.gaps == 0 and sub.decode_errors == 0 and sub.batches >= 1
        print("decoded from the real server:", events[0])

        # The same prompt again is a prefix hit: nothing new is stored (its partial tail
        # block is recomputed, and one generated token does not fill it).
        before = len(stored(recorder))
        await complete(server, prompt, 1)
        await asyncio.sleep(0.5)
        assert len(stored(recorder)) == before
    finally:
        await sub.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_real_vllm_reports_evictions_and_a_cleared_cache(
    kv_events_vllm: tuple[VllmServer, str],
) -> None:
    server, endpoint = kv_events_vllm
    recorder = Recorder()
    sub = await subscribed_to(endpoint, recorder)
    try:
        # Start from an empty cache, so that every eviction is of a block seen stored.
        status, body = await asyncio.to_thread(server.post_json, "/reset_prefix_cache", {})
        assert status == 200, body
        # 63 usable blocks of 32 tokens: three prompts of ~28 blocks cannot all stay cached.
        for _ in range(3):
            await complete(server, unique_prompt(200), 1)
        # vLLM queues AllBlocksCleared and publishes it with the next step's events.
        await until(lambda: bool(recorder.batches), what="the first batch")
        assert recorder.batches[0][0] == AllBlocksCleared()
        assert isinstance(recorder.batches[0][1], BlockStored)
        await until(lambda: any(isinstance(e, BlockRemoved)
                                for batch in recorder.batches for e in batch),
                    what="BlockRemoved")
        stored_hashes = {h for e in stored(recorder) for h in e.block_hashes}
        removed = [e for batch in recorder.batches for e in batch if isinstance(e, BlockRemoved)]
        removed_hashes = {h for e in removed for h in e.block_hashes}
        assert removed_hashes <= stored_hashes, "evicted blocks never seen stored"
        assert all((e.medium, e.group_idx) == ("GPU", 0) for e in removed)
        assert sub.gaps == 0 and sub.decode_errors == 0
    finally:
        await sub.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("kv_events_vllm", ["ipc"], indirect=True)  # the pod's transport
async def test_real_vllm_restart_is_a_gap_and_its_events_are_picked_up(
    kv_events_vllm: tuple[VllmServer, str],
) -> None:
    server, endpoint = kv_events_vllm
    recorder = Recorder()
    sub = await subscribed_to(endpoint, recorder)
    try:
        await complete(server, unique_prompt(50), 1)
        await until(lambda: bool(stored(recorder)), what="BlockStored before the restart")
        await asyncio.to_thread(server.restart)
        await until(lambda: sub.connected, what="the reconnection")
        await asyncio.sleep(0.3)
        prompt = unique_prompt(50)
        tokens = await tokenize(server, prompt)
        await complete(server, prompt, 1)
        await until(lambda: "gap" in recorder.log and bool(recorder.batches[-1]),
                    what="events after the restart")
        assert sub.gaps == 1
        after = recorder.log[recorder.log.index("gap") + 1:]
        events = [e for batch in after if isinstance(batch, list) for e in batch
                  if isinstance(e, BlockStored)]
        _, stored_tokens = chain(events)
        blocks = len(tokens) // BLOCK
        assert stored_tokens[: blocks * BLOCK] == tokens[: blocks * BLOCK]
    finally:
        await sub.close()
