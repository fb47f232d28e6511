"""Who counts a prompt: the local tokenizer, the server, or the estimate.

The server is an in-memory `Engine` (the seam in `sidecar/upstream/engine.py`) whose
/tokenize is the real tokenizer of the tiny test models, or a deliberately different
one: no HTTP patched, no server faked beyond the one call these tests exercise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.metrics import SidecarMetrics
from sidecar.server.prompt_tokens import PromptCounter
from sidecar.server.requests import estimate_tokens, parse_generation
from sidecar.tokens import CannotRender, LocalTokenizer
from sidecar.upstream import (
    Engine,
    ForwardResponse,
    ModelInfo,
    ServerMetrics,
    Tokenized,
    UpstreamError,
)

from support.env import model_dir


class TokenizingEngine:
    """An engine whose /tokenize answers with a tokenizer (shifted ids: a server whose
    tokenizer differs), or fails."""

    base_url = "memory://engine"

    def __init__(self, tokenizer: LocalTokenizer, *, shift: int = 0,
                 fail: bool = False) -> None:
        self.tokenizer = tokenizer
        self.shift = shift
        self.fail = fail
        self.calls = 0

    def url(self, path: str) -> str:
        return self.base_url + path

    async def models(self) -> list[ModelInfo]:
        return []

    async def tokenize(self, payload: Mapping[str, Any],
                       request_id: str | None = None) -> Tokenized:
        self.calls += 1
        await asyncio.sleep(0)
        if self.fail:
            raise UpstreamError("connect", "refused")
        try:
            ids = tuple(t + self.shift for t in self.tokenizer.tokenize(payload))
        except CannotRender:  # a server renders images into placeholder tokens
            ids = tuple(range(100))
        return Tokenized(len(ids), ids)

    async def metrics(self) -> ServerMetrics:
        raise UpstreamError("status", "no metrics here")

    async def version(self) -> str | None:
        return None

    def connections(self) -> dict[str, int] | None:
        return None

    async def forward(self, method: str, path_qs: str, body: bytes | None,
                      headers: Iterable[tuple[str, str]],
                      read_timeout_s: float | None) -> ForwardResponse:
        raise NotImplementedError


CHAT = parse_generation("/v1/chat/completions", {
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "What is a KV block?"}]})
IMAGE = parse_generation("/v1/chat/completions", {
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]})


@pytest.fixture
def tokenizer() -> LocalTokenizer:
    return LocalTokenizer.load(model_dir("tiny-llama"))


def counter(tokenizer: LocalTokenizer | None, **options: Any) -> PromptCounter:
    prompts = PromptCounter(SidecarMetrics(CollectorRegistry(), lambda: None),  # type: ignore[arg-type]
                            **options)
    prompts.tokenizer = tokenizer
    return prompts


def counted(prompts: PromptCounter, source: str) -> float:
    return prompts.metrics.prompt_tokens_counted.labels(source)._value.get()


def checks(prompts: PromptCounter, result: str) -> float:
    return prompts.metrics.tokenizer_checks.labels(result)._value.get()


def test_the_engine_is_an_engine(tokenizer: LocalTokenizer) -> None:
    engine: Engine = TokenizingEngine(tokenizer)  # mypy checks the protocol here
    assert engine.url("/tokenize").endswith("/tokenize")


async def test_local_after_the_first_checks_then_sampled(tokenizer: LocalTokenizer) -> None:
    engine = TokenizingEngine(tokenizer)
    prompts = counter(tokenizer, first_checks=2, check_every=5)
    results = [await prompts.count(CHAT, engine) for _ in range(12)]
    await asyncio.sleep(0.01)  # let the background checks finish
    assert len(set(results)) == 1  # same count and ids, whoever counted
    assert counted(prompts, "server") == 2 and counted(prompts, "local") == 10
    assert engine.calls == 2 + 2  # the first checks, then one in 5 of the 10 local ones
    assert checks(prompts, "match") == 4 and checks(prompts, "mismatch") == 0


async def test_a_burst_of_a_new_shape_asks_the_server_only_the_first_checks(
        tokenizer: LocalTokenizer) -> None:
    # 16 requests of a shape never seen, at once: while the first checks wait for the
    # server, the rest are counted locally (not 16 more requests to a busy server).
    engine = TokenizingEngine(tokenizer)
    prompts = counter(tokenizer, first_checks=3, check_every=0)
    results = await asyncio.gather(*(prompts.count(CHAT, engine) for _ in range(16)))
    assert len(set(results)) == 1
    assert engine.calls == 3 and counted(prompts, "server") == 3
    assert counted(prompts, "local") == 13 and checks(prompts, "match") == 3
    # Settled: later requests are local too.
    await prompts.count(CHAT, engine)
    assert engine.calls == 3


async def test_a_check_the_server_did_not_answer_frees_its_place(
        tokenizer: LocalTokenizer) -> None:
    engine = TokenizingEngine(tokenizer, fail=True)
    prompts = counter(tokenizer, first_checks=2, check_every=0)
    await asyncio.gather(*(prompts.count(CHAT, engine) for _ in range(4)))
    assert engine.calls == 2 and checks(prompts, "match") == 0
    engine.fail = False  # the next two are checks again, none having been recorded
    await asyncio.gather(*(prompts.count(CHAT, engine) for _ in range(2)))
    assert engine.calls == 4 and checks(prompts, "match") == 2


async def test_a_mismatch_sends_the_shape_to_the_server(tokenizer: LocalTokenizer) -> None:
    engine = TokenizingEngine(tokenizer, shift=1)
    prompts = counter(tokenizer, first_checks=3, check_every=0)
    _, ids = await prompts.count(CHAT, engine)
    assert ids is not None and ids[0] == tokenizer.tokenize(CHAT.tokenize_payloads[0])[0] + 1
    for _ in range(5):
        assert (await prompts.count(CHAT, engine))[1] == ids  # the server's ids, always
    assert checks(prompts, "mismatch") == 1
    assert counted(prompts, "local") == 0 and engine.calls == 6


async def test_what_only_the_server_renders_goes_to_it(tokenizer: LocalTokenizer) -> None:
    engine = TokenizingEngine(tokenizer)
    prompts = counter(tokenizer)
    assert await prompts.count(IMAGE, engine) == (100, tuple(range(100)))
    assert engine.calls == 1 and counted(prompts, "server") == 1
    assert checks(prompts, "match") == 0  # nothing local to compare


async def test_text_with_an_unpaired_surrogate_goes_to_the_server(
        tokenizer: LocalTokenizer) -> None:
    # JSON's "\\ud800" escape parses to a str the tokenizers library refuses to encode.
    with pytest.raises(CannotRender, match="surrogate"):
        tokenizer.tokenize({"prompt": "a\ud800b"})
    engine = TokenizingEngine(tokenizer)
    prompts = counter(tokenizer)
    odd = parse_generation("/v1/completions", {"prompt": "a\ud800b"})
    assert await prompts.count(odd, engine) == (100, tuple(range(100)))
    assert engine.calls == 1 and counted(prompts, "server") == 1


async def test_without_tokenizer_files_the_server_counts(tokenizer: LocalTokenizer) -> None:
    engine = TokenizingEngine(tokenizer)
    prompts = counter(None)
    for _ in range(3):
        await prompts.count(CHAT, engine)
    assert engine.calls == 3 and counted(prompts, "local") == 0


async def test_the_estimate_when_the_server_cannot_count(tokenizer: LocalTokenizer) -> None:
    engine = TokenizingEngine(tokenizer, fail=True)
    prompts = counter(None)
    count, ids = await prompts.count(CHAT, engine)
    assert ids is None and count == estimate_tokens(CHAT.estimate_text, CHAT.message_count)
    assert counted(prompts, "estimate") == 1
    assert prompts.metrics.tokenize_fallback._value.get() == 1


async def test_a_failed_check_keeps_the_local_count_honest(tokenizer: LocalTokenizer) -> None:
    # The first checks need the server: when it fails, the estimate is used and
    # nothing is recorded as checked.
    engine = TokenizingEngine(tokenizer, fail=True)
    prompts = counter(tokenizer)
    _, ids = await prompts.count(CHAT, engine)
    assert ids is None and counted(prompts, "estimate") == 1
    engine.fail = False
    for _ in range(3):
        await prompts.count(CHAT, engine)
    assert checks(prompts, "match") == 3
    assert (await prompts.count(CHAT, engine))[1] == tokenizer.tokenize(
        CHAT.tokenize_payloads[0])
    assert counted(prompts, "local") == 1


ENCODED_TEXTS = ("", " ", "plain words", "  two  spaces\tand\ttabs\n\nnewlines ",
                 "l'été à Zürich, 日本語のテキスト, emoji 😀👍🏽 and ∑∫√", "<s> [INST] </s>",
                 "x" * 5000, " ".join(f"word{i}" for i in range(900)))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-gptoss"])
def test_ids_without_offsets_are_the_plain_encoders(model: str) -> None:
    """kvgate encodes without character offsets (`encode_batch_fast`); the ids are the
    ones the plain encoder gives, with and without special tokens, and the plain
    encoder is used where the library has no such method."""
    local = LocalTokenizer.load(model_dir(model))
    plain = LocalTokenizer.load(model_dir(model))
    plain._encode_fast = None
    assert local._encode_fast is not None
    for text in ENCODED_TEXTS:
        for special in (True, False):
            expected = tuple(local._tokenizer.encode(text, add_special_tokens=special).ids)
            assert local.encode(text, add_special_tokens=special) == expected
            assert plain.encode(text, add_special_tokens=special) == expected


class CountingTokenizer:
    """The real tokenizer, counting the prompts it encodes."""

    def __init__(self, tokenizer: LocalTokenizer) -> None:
        self.inner = tokenizer
        self.reuse = tokenizer.reuse
        self.encoded: list[Mapping[str, Any]] = []

    def tokenize(self, payload: Mapping[str, Any]) -> tuple[int, ...]:
        self.encoded.append(payload)
        return self.inner.tokenize(payload)


def test_identical_prompts_are_encoded_once_and_any_difference_encodes_again(
        tokenizer: LocalTokenizer) -> None:
    """Repeated payloads (retries, probes, the same query) come from the recent ones;
    a payload that differs in the prompt, the model, add_special_tokens or a chat
    message is encoded itself, and its ids are its own."""
    counting = CountingTokenizer(tokenizer)
    prompts = counter(counting, check_every=0, first_checks=1)  # type: ignore[arg-type]
    server = TokenizingEngine(tokenizer)  # the first of each shape is checked with it
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": "What is a KV block?"}),
        ("/v1/completions", {"prompt": "What is a KV block?", "model": "m"}),
        ("/v1/completions", {"prompt": "What is a KV block?", "add_special_tokens": False}),
        ("/v1/completions", {"prompt": "What is a KV block!"}),
        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                "content": "What is a KV block?"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                "content": "What is a KV block!"}]}),
    ]
    first = [asyncio.run(prompts.count(parse_generation(route, body), server))
             for route, body in bodies]
    assert len(counting.encoded) == len(bodies)
    checks = server.calls
    again = [asyncio.run(prompts.count(parse_generation(route, body), server))
             for route, body in bodies]
    assert again == first and server.calls == checks
    assert len(counting.encoded) == len(bodies)  # none encoded twice
    for (route, body), (count, ids) in zip(bodies, first, strict=True):
        assert ids == tokenizer.tokenize(parse_generation(route, body).tokenize_payloads[0])
        assert count == len(ids or ())
