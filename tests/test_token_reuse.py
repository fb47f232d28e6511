"""Long prompts encoded from where they differ from a recent prompt (`tokens/reuse.py`).

Every joined encoding is compared with the whole text encoded by the same tokenizer:
the tiny test models' byte-level BPE, and two tokenizers built here with what other
families use (a sentencepiece-style Metaspace BPE that marks the first word; a
WordPiece whose template adds a token at the end). The checks `PrefixReuse` makes of
its own joins are switched off for those comparisons, so a wrong join would show.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.normalizers import Normalizer
from tokenizers.pre_tokenizers import PreTokenizer
from tokenizers.trainers import BpeTrainer, Trainer, WordPieceTrainer

from sidecar.metrics import SidecarMetrics
from sidecar.server.prompt_tokens import PromptCounter
from sidecar.server.requests import parse_generation
from sidecar.tokens import LocalTokenizer, reuse, shape_of
from sidecar.tokens.reuse import PrefixReuse, common_prefix_chars

from support.env import model_dir

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "the",
    "scheduler", "admits", "requests", "into", "blocks", "of", "cached", "attention", "keys",
    "12", "345", "6789", "é", "ü", "中文", "😀", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
    "tab\tand\nnew\n\nlines", "", "", "spaces", ",.;:!?", "'quoted'", '"double"', "don't",
    "it's",
)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def texts_sharing_prefixes(seed: int, prefixes: int = 12, per_prefix: int = 40
                           ) -> Iterator[str]:
    """Texts that extend, cut short or branch off a few long prefixes, with every kind
    of character at the joint."""
    rng = random.Random(seed)
    for _ in range(prefixes):
        prefix = words(rng, rng.randrange(250, 1200))
        for _ in range(per_prefix):
            cut = rng.randrange(len(prefix) // 2, len(prefix) + 1)
            joint = rng.choice(["", " ", "  ", "\n", "\n\n", "x", "1", "中", "😀", "<s>",
                                "       ", "\t", "'s"])
            yield prefix[:cut] + joint + words(rng, rng.randrange(0, 150))


def trained(model: models.Model, trainer: Trainer, normalizer: Normalizer,
            pre_tokenizer: PreTokenizer) -> Tokenizer:
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    corpus = [words(random.Random(seed), 400) for seed in range(40)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def metaspace_bpe() -> Tokenizer:
    """Sentencepiece-style: spaces become '▁' and the first word gets one too."""
    tokenizer = trained(
        models.BPE(unk_token="<unk>", byte_fallback=False),
        BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]),
        normalizers.NFKC(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"))
    tokenizer.decoder = decoders.Metaspace()
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    return tokenizer


def wordpiece_with_end_token() -> Tokenizer:
    tokenizer = trained(
        models.WordPiece(unk_token="[UNK]"),
        WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]", "[CLS]", "[SEP]"]),
        normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer())
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                                                 ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    return tokenizer


def reuse_of(tokenizer: Tokenizer) -> PrefixReuse:
    def ids(text: str, special: bool) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=special).ids)

    def with_offsets(text: str, special: bool) -> tuple[tuple[int, ...],
                                                         list[tuple[int, int]]]:
        encoding = tokenizer.encode(text, add_special_tokens=special)
        return tuple(encoding.ids), encoding.offsets

    return PrefixReuse(ids, with_offsets)


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Joins are used without PrefixReuse's own comparisons, so the test's show them."""
    monkeypatch.setattr(reuse, "FIRST_CHECKS", 0)
    monkeypatch.setattr(reuse, "CHECK_EVERY", 10**9)


def tiny_model_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(model_dir("tiny-llama") / "tokenizer.json"))


@pytest.mark.parametrize("build", [tiny_model_tokenizer, metaspace_bpe,
                                   wordpiece_with_end_token])
@pytest.mark.usefixtures("unchecked")
def test_joined_encodings_equal_the_whole_text_encoded(build: object) -> None:
    tokenizer = build()  # type: ignore[operator]
    prefix_reuse = reuse_of(tokenizer)
    compared = 0
    for seed, special in ((1, True), (2, False)):
        for text in texts_sharing_prefixes(seed):
            whole = tuple(tokenizer.encode(text, add_special_tokens=special).ids)
            assert prefix_reuse.encode(text, special) == whole, text
            compared += 1
    assert compared == 2 * 12 * 40
    assert prefix_reuse.counts["mismatch"] == 0 and prefix_reuse.enabled
    # Most texts were joined, not encoded whole (a template that adds a token at the
    # end is joined only without special tokens).
    share = 0.4 if build is wordpiece_with_end_token else 0.8
    assert prefix_reuse.counts["spliced"] >= share * compared


def test_a_long_prompt_extending_a_recent_one_encodes_only_a_window() -> None:
    tokenizer = tiny_model_tokenizer()
    encoded: list[int] = []

    def ids(text: str, special: bool) -> tuple[int, ...]:
        encoded.append(len(text))
        return tuple(tokenizer.encode(text, add_special_tokens=special).ids)

    def with_offsets(text: str, special: bool) -> tuple[tuple[int, ...],
                                                         list[tuple[int, int]]]:
        encoded.append(len(text))
        encoding = tokenizer.encode(text, add_special_tokens=special)
        return tuple(encoding.ids), encoding.offsets

    prefix_reuse = PrefixReuse(ids, with_offsets)
    rng = random.Random(7)
    system = words(rng, 1000)
    turns = [system]
    for _ in range(reuse.FIRST_CHECKS + 20):  # an agent session: each turn extends the last
        turns.append(turns[-1] + " " + words(rng, 40))
    for turn in turns:
        assert prefix_reuse.encode(turn, True) == tuple(tokenizer.encode(turn).ids)
    late = encoded[-10:]  # past the first checks: windows only
    assert max(late) < 600 < len(turns[-1]) / 10


def test_identical_long_texts_are_encoded_once() -> None:
    tokenizer = tiny_model_tokenizer()
    calls: list[str] = []

    def ids(text: str, special: bool) -> tuple[int, ...]:
        calls.append(text)
        return tuple(tokenizer.encode(text, add_special_tokens=special).ids)

    prefix_reuse = PrefixReuse(ids, lambda text, special: ((), []))
    text = words(random.Random(3), 500)
    assert prefix_reuse.encode(text, True) == prefix_reuse.encode(text, True)
    assert len(calls) == 1
    assert prefix_reuse.encode(text, False) == tuple(
        tokenizer.encode(text, add_special_tokens=False).ids)  # kept apart
    assert len(calls) == 2


def test_a_join_that_differs_from_the_whole_text_turns_reuse_off() -> None:
    """A tokenizer that is not local: a text's first token depends on its length. The
    window (which never keeps its own first token) agrees with the kept text; the join
    keeps the first text's first token, which the whole text encodes otherwise."""
    def ids(text: str, special: bool) -> tuple[int, ...]:
        chunks = [text[i:i + 4] for i in range(0, len(text), 4)]
        return (len(text), *(hash(chunk) % 1000 for chunk in chunks[1:]))

    def with_offsets(text: str, special: bool) -> tuple[tuple[int, ...],
                                                         list[tuple[int, int]]]:
        return ids(text, special), [(i, min(i + 4, len(text)))
                                    for i in range(0, len(text), 4)]

    seen: list[str] = []
    prefix_reuse = PrefixReuse(ids, with_offsets, listener=seen.append)
    base = "abcdefgh" * 300
    assert prefix_reuse.encode(base, True) == ids(base, True)
    longer = base + "ijkl" * 30
    assert prefix_reuse.encode(longer, True) == ids(longer, True)
    assert prefix_reuse.counts == {"spliced": 1, "checked": 1, "mismatch": 1}
    assert seen == ["spliced", "checked", "mismatch"]
    assert not prefix_reuse.enabled and len(prefix_reuse) == 0
    assert prefix_reuse.encode(longer + "mnop", True) == ids(longer + "mnop", True)
    assert prefix_reuse.counts["spliced"] == 1  # nothing joined after that


def test_the_first_joins_and_then_one_in_check_every_are_checked() -> None:
    tokenizer = tiny_model_tokenizer()
    prefix_reuse = reuse_of(tokenizer)
    rng = random.Random(11)
    system = words(rng, 600)
    for _ in range(reuse.FIRST_CHECKS + 2 * reuse.CHECK_EVERY):
        prefix_reuse.encode(system + " " + words(rng, 20), True)
    spliced = prefix_reuse.counts["spliced"]
    assert spliced == reuse.FIRST_CHECKS + 2 * reuse.CHECK_EVERY - 1  # all but the first
    expected = reuse.FIRST_CHECKS + len([n for n in range(reuse.FIRST_CHECKS + 1, spliced + 1)
                                         if n % reuse.CHECK_EVERY == 0])
    assert prefix_reuse.counts["checked"] == expected
    assert prefix_reuse.counts["mismatch"] == 0


def test_what_is_kept_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "MAX_TEXTS", 20)
    monkeypatch.setattr(reuse, "MAX_TOTAL_CHARS", 30_000)
    tokenizer = tiny_model_tokenizer()
    prefix_reuse = reuse_of(tokenizer)
    rng = random.Random(5)
    for index in range(200):
        text = f"{index:05d} " + words(rng, rng.randrange(200, 500))
        prefix_reuse.encode(text, True)
        assert len(prefix_reuse) <= 20
        assert prefix_reuse._chars <= 30_000
        assert prefix_reuse._chars == sum(len(k.text) for k in prefix_reuse._texts.values())
        anchored = sum(len(peers) for peers in prefix_reuse._by_anchor.values())
        assert anchored == len(prefix_reuse)
    # Many texts under one anchor: the most recent MAX_PER_ANCHOR are looked through.
    monkeypatch.setattr(reuse, "MAX_TEXTS", 100)
    monkeypatch.setattr(reuse, "MAX_TOTAL_CHARS", 10**6)
    shared = words(rng, 300)
    for index in range(3 * reuse.MAX_PER_ANCHOR):
        prefix_reuse.encode(shared + f" {index} " + words(rng, 30), True)
    assert max(len(peers) for peers in prefix_reuse._by_anchor.values()) \
        == reuse.MAX_PER_ANCHOR


def test_short_texts_are_encoded_whole_and_not_kept() -> None:
    prefix_reuse = reuse_of(tiny_model_tokenizer())
    text = "x " * (reuse.MIN_CHARS // 2 - 1)
    assert len(text) < reuse.MIN_CHARS
    prefix_reuse.encode(text, True)
    prefix_reuse.encode(text + "m", True)
    assert len(prefix_reuse) == 0 and prefix_reuse.counts["spliced"] == 0


@given(st.text(alphabet="ab", max_size=3000), st.text(alphabet="abc", max_size=60),
       st.text(alphabet="abc", max_size=60))
def test_common_prefix_chars(base: str, left: str, right: str) -> None:
    a, b = base + left, base + right
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False))
                     if x != y), min(len(a), len(b)))
    assert common_prefix_chars(a, b) == expected


async def test_prompts_counted_locally_report_their_reuse() -> None:
    tokenizer = LocalTokenizer.load(model_dir("tiny-llama"))
    prompts = PromptCounter(SidecarMetrics(CollectorRegistry(), lambda: None),  # type: ignore[arg-type, return-value]
                            first_checks=1, check_every=0)
    prompts.tokenizer = tokenizer
    tokenizer.reuse.listener = prompts._reused
    tokenizer.reuse.check_inline = False  # as PromptCounter._load sets it
    system = words(random.Random(9), 500)
    for question in ("what is a block?", "how long is a step?", "who admits requests?"):
        gen = parse_generation("/v1/completions", {"prompt": system + " " + question})
        # The shape was checked against the server before: counted locally.
        prompts.verification.record(shape_of(gen.tokenize_payloads[0]), True)
        count, ids = await prompts.count(gen, None)
        assert ids == tuple(tokenizer._tokenizer.encode(system + " " + question).ids)
        assert count == len(ids)
    reused = prompts.metrics.tokenizer_reuse
    assert reused.labels("spliced")._value.get() == 2
    # The joins due a check were used at once and are compared on a worker thread.
    assert prompts._checks
    await asyncio.gather(*prompts._checks)
    assert not tokenizer.reuse.pending_checks
    assert reused.labels("checked")._value.get() == 2  # the first joins are checked
    assert reused.labels("mismatch")._value.get() == 0
