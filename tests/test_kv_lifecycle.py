"""The blocks a request holds over its life (`model.lifecycle`), against worked
examples measured on vLLM 0.32 CPU servers (tests/test_e2e_lifecycle.py measures them
live) and against a step-by-step replay of vLLM's allocator."""

from __future__ import annotations

import pytest

from sidecar.model import Deployment, ServedModel, custom_gpu, parse_config
from sidecar.model.units import cdiv

from support.admission_fixtures import TINY_LLAMA

SLIDING = {**TINY_LLAMA, "model_type": "mistral", "num_key_value_heads": 1, "head_dim": 32,
           "sliding_window": 256, "max_position_embeddings": 4096}
HYBRID = {**TINY_LLAMA, "model_type": "gemma2", "num_hidden_layers": 2, "head_dim": 32,
          "sliding_window": 128, "query_pre_attn_scalar": 32,
          "layer_types": ["sliding_attention", "full_attention"]}


def served(config: dict[str, object], chunk: int = 2048, block: int = 32) -> ServedModel:
    return ServedModel(parse_config(config, "tiny"),
                       Deployment(block_size=block, max_model_len=1024,
                                  num_gpu_blocks_override=64, max_num_batched_tokens=chunk),
                       custom_gpu(16, 100, 1))


def replay(window: int | None, block: int, prompt: int, output: int, chunk: int) -> list[int]:
    """vLLM's allocator for one request, step by step: before each step the blocks that
    fell out of the window of the processed tokens are freed (the previous step is
    still in flight), then the step's tokens get blocks. Returns the blocks held in
    each step."""
    held: list[int] = []
    computed, in_flight = 0, 0
    steps = []
    while computed < prompt:
        size = min(chunk, prompt - computed)
        steps.append(size)
        computed += size
    steps += [1] * max(0, output - 1)
    computed = 0
    for size in steps:
        settled = computed - in_flight
        skipped = 0 if window is None else max(0, settled - window + 1) // block
        held.append(cdiv(computed + size, block) - skipped)
        computed += size
        in_flight = size
    return held


def test_full_attention_holds_prompt_plus_output_less_one_token_at_its_end() -> None:
    lifecycle = served(TINY_LLAMA).lifecycle
    # 450 + 300 tokens: the last sampled token is never fed back: cdiv(749, 32) = 24.
    assert lifecycle.peak_blocks(450, 300) == 24
    assert lifecycle.peak_blocks(450, 300, 150) == 24
    assert lifecycle.blocks_now(450, 0) == 15


def test_sliding_window_peaks_at_the_prefill_then_holds_the_window() -> None:
    lifecycle = served(SLIDING).lifecycle
    # Measured on vLLM 0.32 CPU (tiny-mistral, window 256, blocks of 32): a 386-token
    # prompt holds 13 blocks while it prefills, then 9 while it decodes 300 tokens.
    assert lifecycle.peak_blocks(386, 300) == 13
    assert lifecycle.peak_blocks(386, 300, 2) == 9
    assert [lifecycle.blocks_now(386, k) for k in (0, 1, 2, 150, 299)] == [13, 13, 9, 9, 9]


def test_hybrid_sliding_and_full_adds_both_groups() -> None:
    model = served(HYBRID)
    assert len(model.layout.groups) == 2
    # Measured on vLLM 0.32 CPU (tiny-gptoss, sliding 128 / full, blocks of 32): a
    # 386-token prompt + 300 tokens peaks at 27 blocks, at its last step.
    assert model.lifecycle.peak_blocks(386, 300) == 27
    assert model.lifecycle.blocks_now(386, 0) == 26


@pytest.mark.parametrize("config", [TINY_LLAMA, SLIDING, HYBRID], ids=["full", "sliding",
                                                                       "hybrid"])
@pytest.mark.parametrize("chunk", [2048, 96])
@pytest.mark.parametrize(("prompt", "output"), [(1, 1), (31, 2), (450, 300), (700, 40),
                                                (256, 256), (1000, 24)])
def test_peak_ahead_equals_a_step_by_step_replay(
    config: dict[str, object], chunk: int, prompt: int, output: int
) -> None:
    model = served(config, chunk=chunk)
    steps_per_group = []
    for group in model.layout.groups:
        window = getattr(group.spec, "window", None) if group.spec.recycles_blocks else None
        steps_per_group.append(replay(window, group.block_size, prompt, output, chunk))
    totals = [sum(step) for step in zip(*steps_per_group, strict=True)]
    prefill_steps = cdiv(prompt, chunk)
    for produced in (0, 1, 2, output // 2, output - 1):
        if produced >= output or (produced and produced < 1):
            continue
        ahead = totals if produced == 0 else totals[prefill_steps + produced - 1:]
        if not ahead:
            continue
        assert model.lifecycle.peak_blocks(prompt, output, produced) == max(ahead), produced


def test_the_peak_never_grows_as_the_request_advances() -> None:
    for config in (TINY_LLAMA, SLIDING, HYBRID):
        lifecycle = served(config).lifecycle
        peaks = [lifecycle.peak_blocks(600, 400, produced) for produced in range(0, 400, 7)]
        assert peaks == sorted(peaks, reverse=True)
