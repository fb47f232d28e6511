"""Which prompt blocks of a request vLLM may share with other requests.

vLLM keys a prompt block by its tokens and its parent block, plus what it adds to
the key: the LoRA adapter, a `cache_salt` and multimodal inputs. kvgate keys the
blocks itself (`AdmissionController.prompt_keys`) where it knows what vLLM adds:
- a `cache_salt` salts the chain, so only requests with the same salt share;
- a request for another model name than the served one (a LoRA adapter) or with
  image, audio or video parts shares nothing, as far as kvgate assumes;
- a request that asks for its prompt's logprobs does not read the cache at all.

`shares_prompt_blocks` also says whether the forks of one request (n > 1) share its
prompt's blocks among themselves (`CostModel.fork_shared_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.admission import AdmissionController
from sidecar.server.requests import GenerationRequest

_MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "audio_url", "input_audio",
                          "audio", "video_url", "video", "file", "input_file"})


def prompt_keys(
    controller: AdmissionController,
    body: Mapping[str, Any],
    gen: GenerationRequest,
    token_ids: tuple[int, ...] | None,
    served_model: str | None,
    *,
    shares: bool,
) -> tuple[bytes, ...]:
    """The keys of the prompt's full blocks, or () where kvgate counts no sharing
    (`shares`: `shares_prompt_blocks(body, gen)`)."""
    if token_ids is None or not shares:
        return ()
    if served_model is not None and gen.model not in (None, served_model):
        return ()  # a LoRA adapter: vLLM adds it to every block's key
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return ()
    # Any string JSON can carry, lone surrogates too (vLLM answers for those).
    return controller.prompt_keys(token_ids, b"cache_salt:" + salt.encode("utf-8", "surrogatepass")
                                  if salt else b"")


def shares_prompt_blocks(body: Mapping[str, Any], gen: GenerationRequest) -> bool:
    """Whether kvgate counts the prompt's blocks as shared: between the request's forks
    (n > 1) and, with its keys, with other requests. Not for a batch of prompts (which
    prompt each sequence forks from is not tracked), media (an encoder budget can cut
    the first fork's prefill short of them) or a request that does not read the prefix
    cache."""
    return gen.prompts == 1 and not _has_media(body) and reads_prefix_cache(body, gen.route)


def reads_prefix_cache(body: Mapping[str, Any], route: str) -> bool:
    """Whether vLLM looks the prompt up in its prefix cache. Not when it returns the
    prompt's logprobs (vLLM 0.32 then sets `skip_reading_prefix_cache`):
    `prompt_logprobs`, `echo` with `logprobs` (completions), or `echo` at all (chat,
    whose `top_logprobs`, 0 when absent or null, becomes the prompt's logprobs). An
    `echo` that is not plainly false counts as true, as vLLM's lax parsing reads it."""
    if body.get("prompt_logprobs") is not None:
        return False
    echo = body.get("echo") not in (None, False, 0, "false", "False", "0")
    return not (echo and (route == "chat" or (route == "completions"
                                              and body.get("logprobs") is not None)))


def _has_media(body: Mapping[str, Any]) -> bool:
    for name in ("messages", "input"):
        items = body.get(name)
        if not isinstance(items, list):
            continue
        for item in items:
            content = item.get("content") if isinstance(item, dict) else None
            if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") in _MEDIA_PARTS for part in content
            ):
                return True
    return False
