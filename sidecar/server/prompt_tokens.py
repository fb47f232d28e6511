"""Who counts a request's prompt tokens: kvgate's local tokenizer, the server's
/tokenize, or the fallback estimate.

With the model's tokenizer files readable (`--tokenizer`, else the model directory),
prompts are counted locally, which saves every admitted request a round trip to the
server. The local ids must be the server's (prefix-aware admission hashes them), so the
`Verification` policy compares them with the server's /tokenize: the first requests of
each shape synchronously (the server's answer is used), then one in
`--tokenizer-check-every` in the background; a mismatch sends that shape to the server
from then on. Without the files, every prompt goes to /tokenize as before; when that
fails too, the documented estimate (`estimate_tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

from sidecar.metrics import SidecarMetrics
from sidecar.server.requests import GenerationRequest, estimate_tokens
from sidecar.tokens import (
    CannotRender,
    LocalTokenizer,
    Plan,
    TokenizerFilesError,
    Verification,
    shape_of,
)
from sidecar.upstream import Engine, UpstreamError

log = logging.getLogger("kvgate.tokens")

# Prompts larger than this many characters are tokenized on a worker thread.
INLINE_CHARS = 16_384
MAX_BACKGROUND_CHECKS = 64
# Identical prompts (retries, health probes, repeated queries) are tokenized once: the
# last CACHED_PROMPTS payloads of at most CACHED_CHARS characters are kept (<= ~20 MB).
CACHED_PROMPTS = 1024
CACHED_CHARS = 8_192
LOAD_WAIT_S = 5.0


def _payload_chars(payload: Mapping[str, Any]) -> int:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for message in payload.get("messages") or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(part)) for part in content)
    return total + len(str(payload.get("tools") or ""))


def _cache_key(payload: Mapping[str, Any]) -> Hashable:
    """What identifies a payload's tokens: its items when every value is a string, a
    boolean or None (a completion's), else its JSON with sorted keys."""
    for value in payload.values():
        if value is not None and not isinstance(value, (str, bool)):
            return json.dumps(payload, sort_keys=True, default=str)
    return tuple(sorted(payload.items()))


class PromptCounter:
    def __init__(self, metrics: SidecarMetrics, *, check_every: int = 100,
                 first_checks: int = 3, log_prompts: bool = False) -> None:
        self.metrics = metrics
        self.verification = Verification(first_checks=first_checks, every=check_every)
        self.tokenizer: LocalTokenizer | None = None
        self.directory: Path | None = None
        self.problem: str | None = "no tokenizer files found yet"
        self.log_prompts = log_prompts
        self._loading: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self._recent: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()

    # ---- the tokenizer files ----------------------------------------------------------

    def load_from(self, directory: str | Path) -> None:
        """Load the tokenizer from `directory` in the background (once per directory)."""
        path = Path(directory).expanduser()
        if path.is_file():
            path = path.parent
        if path == self.directory or not (path / "tokenizer.json").is_file():
            return
        self.directory = path
        if self._loading is not None:
            self._loading.cancel()
        self._loading = asyncio.get_running_loop().create_task(
            self._load(path), name="kvgate-tokenizer-load")

    async def _load(self, path: Path) -> None:
        try:
            tokenizer = await asyncio.to_thread(LocalTokenizer.load, path)
        except TokenizerFilesError as exc:
            self.problem = str(exc)
            log.warning("prompts are counted by the server's /tokenize: %s", exc)
            return
        tokenizer.reuse.listener = self._reused
        tokenizer.reuse.check_inline = False
        self.tokenizer, self.problem = tokenizer, None
        log.info("counting prompt tokens locally with the tokenizer in %s (checked against "
                 "the server's /tokenize)", path)

    def _verify_joins(self, tokenizer: LocalTokenizer) -> None:
        """Compare the joins due a check with their whole prompts encoded, on a worker
        thread (the joined ids are in use already; a difference turns reuse off)."""
        pending = tokenizer.reuse.pending_checks
        while pending and len(self._checks) < MAX_BACKGROUND_CHECKS:
            text, special, ids = pending.popleft()
            task = asyncio.get_running_loop().create_task(
                self._verify_join(tokenizer, text, special, ids))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    @staticmethod
    async def _verify_join(tokenizer: LocalTokenizer, text: str, special: bool,
                           ids: tuple[int, ...]) -> None:
        await asyncio.to_thread(tokenizer.reuse.verify, text, special, ids)

    def _reused(self, result: str) -> None:
        self.metrics.tokenizer_reuse.labels(result).inc()
        if result == "mismatch":
            log.warning("a prompt encoded from a recent prompt's tokens differed from the "
                        "whole prompt encoded: prompts are encoded whole from now on")

    async def aclose(self) -> None:
        tasks = [t for t in (self._loading, *self._checks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- counting ---------------------------------------------------------------------

    async def count(self, gen: GenerationRequest, client: Engine | None,
                    request_id: str | None = None) -> tuple[int, tuple[int, ...] | None]:
        """The prompt's token count (the longest of a batch), and the token ids of a
        single prompt when known."""
        counts = list(gen.token_counts)
        token_ids: tuple[int, ...] | None = gen.token_ids
        try:
            for payload in gen.tokenize_payloads:
                count, token_ids = await self._tokens(payload, client, request_id)
                counts.append(count)
        except UpstreamError as exc:
            token_ids = None
            self.metrics.tokenize_fallback.inc()
            self.metrics.counted_by["estimate"].inc()
            # The server's error text may quote the prompt: logged only with --log-prompts.
            log.debug("tokenize failed (%s); estimating",
                      exc if self.log_prompts else f"{exc.kind} error")
            texts = gen.estimate_text or ("",)
            counts = list(gen.token_counts)
            if gen.route == "completions":
                counts += [estimate_tokens([text], 0) for text in texts]
            else:
                counts.append(estimate_tokens(texts, gen.message_count))
        if gen.prompts != 1:
            token_ids = None
        return (max(counts) if counts else 1), token_ids

    async def _tokens(self, payload: Mapping[str, Any], client: Engine | None,
                      request_id: str | None) -> tuple[int, tuple[int, ...] | None]:
        if self.tokenizer is None and self._loading is not None and not self._loading.done():
            # Being read (milliseconds): wait for it rather than count by the server.
            await asyncio.wait({self._loading}, timeout=LOAD_WAIT_S)
        tokenizer = self.tokenizer
        if tokenizer is None:
            return await self._server(payload, client, request_id)
        shape = shape_of(payload)
        plan = self.verification.plan(shape)
        if plan is Plan.SERVER:
            return await self._server(payload, client, request_id)
        if plan is Plan.CHECK_NOW:
            try:
                return await self._check_now(tokenizer, shape, payload, client, request_id)
            finally:
                self.verification.settle(shape)
        local = await self._rendered(tokenizer, payload)
        if local is None:
            return await self._server(payload, client, request_id)
        if plan is Plan.CHECK_LATER and len(self._checks) < MAX_BACKGROUND_CHECKS \
                and client is not None:
            task = asyncio.get_running_loop().create_task(
                self._check_later(shape, payload, local, client, request_id))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        self.metrics.counted_by["local"].inc()
        return len(local), local

    async def _check_now(self, tokenizer: LocalTokenizer, shape: str,
                         payload: Mapping[str, Any], client: Engine | None,
                         request_id: str | None) -> tuple[int, tuple[int, ...] | None]:
        """Count by the server, and compare the local count with its answer."""
        local = await self._rendered(tokenizer, payload)
        if local is None:
            return await self._server(payload, client, request_id)
        served = await self._server(payload, client, request_id)
        self._compare(shape, local, served[1])
        return served

    async def _rendered(self, tokenizer: LocalTokenizer,
                        payload: Mapping[str, Any]) -> tuple[int, ...] | None:
        """The local token ids, or None where the local tokenizer cannot render the
        request (the server counts it)."""
        try:
            return await self._local(tokenizer, payload)
        except CannotRender as exc:
            log.debug("counted by the server: %s", exc)
            return None

    async def _local(self, tokenizer: LocalTokenizer,
                     payload: Mapping[str, Any]) -> tuple[int, ...]:
        chars = _payload_chars(payload)
        key = _cache_key(payload) if chars <= CACHED_CHARS else None
        if key is not None:
            cached = self._recent.get(key)
            if cached is not None:
                self._recent.move_to_end(key)
                return cached
        if chars > INLINE_CHARS:
            ids = await asyncio.to_thread(tokenizer.tokenize, payload)
        else:
            ids = tokenizer.tokenize(payload)
        self._verify_joins(tokenizer)
        if key is not None:
            self._recent[key] = ids
            if len(self._recent) > CACHED_PROMPTS:
                self._recent.popitem(last=False)
        return ids

    async def _server(self, payload: Mapping[str, Any], client: Engine | None,
                      request_id: str | None) -> tuple[int, tuple[int, ...] | None]:
        if client is None:
            raise UpstreamError("connect", "no upstream client")
        tokenized = await client.tokenize(payload, request_id)
        self.metrics.counted_by["server"].inc()
        return tokenized.count, tokenized.token_ids

    def _compare(self, shape: str, local: tuple[int, ...],
                 served: tuple[int, ...] | None) -> None:
        if served is None:
            self.metrics.tokenizer_checks.labels("failed").inc()
            return
        matched = local == served
        self.verification.record(shape, matched)
        self.metrics.tokenizer_checks.labels("match" if matched else "mismatch").inc()
        if not matched:
            log.warning("the local tokenizer gave %d tokens where the server's /tokenize gave "
                        "%d for a request shape: the server counts that shape from now on",
                        len(local), len(served))

    async def _check_later(self, shape: str, payload: Mapping[str, Any],
                           local: tuple[int, ...], client: Engine,
                           request_id: str | None) -> None:
        try:
            tokenized = await client.tokenize(payload, request_id)
        except UpstreamError:
            self.metrics.tokenizer_checks.labels("failed").inc()
            return
        self._compare(shape, local, tokenized.token_ids)
