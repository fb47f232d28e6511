"""The model against the public measurements in tests/data/groundtruth: the issue's
targets, on the same row mapping as `bench/model_accuracy.py` (tests/support/
groundtruth.py).

- weights within 3% of vLLM's "Model loading took", for every row with a config;
- KV tokens (V0: blocks) exact from vLLM's logged budget: the logged figure lies in
  the interval that the budget, printed rounded to 0.01 GiB, allows - except the rows
  listed in EXPLAINED_KV_MISMATCHES with their reason;
- latency out of sample (`bench/model_cv.py`): the physics terms fitted with one model
  family left out predict that family's rows; the median absolute errors out of fold
  meet the bounds below, one request at a time (steady rows, `steady_latency`) and
  under load (N prompts sent at once, the engine simulator).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import replace
from functools import cache

import pytest

from sidecar.model.latency import DEFAULT_EFFICIENCY
from sidecar.model.units import GIB

from bench.model_cv import (
    BANDS,
    FAMILIES,
    FIT_REQUESTS_PER_CLIENT,
    KV_RATIO_GRID,
    NEUTRAL_START,
    Prediction,
    committed_values,
    cross_validate,
    differing_terms,
    efficiency_for,
    family,
    fit,
    fit_kv_bandwidth,
    main,
    median_ape,
    model_family,
    predict_closed,
    usable_cases,
)
from support.groundtruth import (
    KV_EXACT_EXCEPTIONS,
    KvCase,
    LatencyCase,
    _load,
    kv_cases,
    latency_cases,
    predict_steady,
    steady_cases,
    token_interval,
)

# Rows whose logged KV tokens are not expected to follow from their logged budget.
# Both are tensor-parallel: every worker logs its own "Available KV cache memory", vLLM
# sizes the shared pool by the smallest, and the report quotes one (larger) line.
EXPLAINED_KV_MISMATCHES = {
    "kv_capacity.csv:20": "DeepSeek-R1-Distill-Qwen-14B, TP=2: the 8.69 GiB budget is quoted "
                          "for one worker and vLLM uses the min over workers (the row's notes)",
    "kv_capacity.csv:3": "Qwen3-235B-A22B-FP8, TP=4: one of four workers' budget lines is "
                         "quoted; its 178,880 tokens need 8.02 GiB, not 8.11 GiB",
}

WEIGHT_CASES = [case for case in kv_cases() if case.checks_weights]
KV_CASES = [case for case in kv_cases() if case.checks_kv_exact]


def _ids(case: KvCase) -> str:
    return f"{case.ref}-{case.model}"


def test_the_data_gives_rows_of_every_kind() -> None:
    # A mapping regression that drops rows would otherwise pass vacuously.
    assert len(WEIGHT_CASES) >= 9
    assert len(KV_CASES) >= 8
    assert len(steady_cases()) >= 80


def test_every_row_not_run_says_why() -> None:
    for case in latency_cases():
        assert case.usable or case.skip
    for kv in kv_cases():
        assert kv.usable or kv.skip or kv.choice.skip


@pytest.mark.parametrize("case", WEIGHT_CASES, ids=_ids)
def test_weights_within_3_percent_of_model_loading_took(case: KvCase) -> None:
    assert case.weights_gib is not None
    predicted = case.served().weights_bytes / GIB
    assert predicted == pytest.approx(case.weights_gib, rel=0.03)


@pytest.mark.parametrize("case", KV_CASES, ids=_ids)
def test_kv_tokens_exact_from_the_logged_budget(case: KvCase) -> None:
    interval = token_interval(case)
    inside = True
    if case.kv_tokens is not None:
        inside = interval.has_tokens(case.kv_tokens)
    if case.gpu_blocks is not None:
        inside = inside and interval.has_blocks(case.gpu_blocks)
    if case.ref in EXPLAINED_KV_MISMATCHES:
        # The explanation holds only if the pool is smaller than this worker's budget.
        assert not inside
        assert case.kv_tokens is not None and case.kv_tokens < interval.tokens_low
    else:
        assert inside, (f"{case.ref}: {case.available_kv_gib} GiB allows tokens "
                        f"{interval.tokens_low}-{interval.tokens_high}, blocks "
                        f"{interval.blocks_low}-{interval.blocks_high}; logged "
                        f"{case.kv_tokens} tokens, {case.gpu_blocks} blocks")


def test_explained_mismatches_are_the_benchmarks() -> None:
    assert set(EXPLAINED_KV_MISMATCHES) == set(KV_EXACT_EXCEPTIONS)
    assert set(EXPLAINED_KV_MISMATCHES) <= {case.ref for case in KV_CASES}


@cache
def _cross_validated() -> tuple[tuple[Prediction, ...], dict[str, dict[str, float]]]:
    """Every usable latency row predicted by terms fitted without its model family, and
    each fold's terms."""
    predictions, folds = cross_validate()
    return tuple(predictions), folds


def _out_of_fold() -> tuple[Prediction, ...]:
    return _cross_validated()[0]


# Out-of-fold median |error| bounds per concurrency band (issue 15's targets). One
# request at a time the targets are 25% (TTFT) and 15% (TPOT); the model reaches 11.0%
# and 6.9% on 94 / 92 rows (vLLM's own 21.9% / 4.2% on 16 / 14), and the bounds are 12%
# and 10%. Under load the targets are 35% (TTFT) and 20% (TPOT); the model reaches
# 31.5% on 113 rows and 11.6% on 108, and the bounds are 33% and 13%. Those rows are of
# two kinds the model prices differently: 52 closed loops of 2 to 38 clients (France-
# Travail's sweeps, Llama 3 on vLLM 0.4-0.7), which it follows (22.5% / 3.5%), and 61
# bursts and closed loops of Qwen and gpt-oss on vLLM 0.10-0.23, most of whose long
# prefills it prices too cheap: 46.2% / 34.7% on those alone, outside the targets
# (49.4% / 40.5% before vLLM's KV cache bandwidth was fitted under load). A change that
# loses accuracy fails (the cross-validation is deterministic). The wmx closed loops'
# own median inter-token latency (their source gives no TPOT) is within 30.2% on 5
# rows, 33.9% on the one client's: the KV share prices their KV reads slower (26.3% and
# 33.4% before; 15.4% and 21.7% before the H100 NVL's bandwidth moved the Qwen fold's
# cost per step from 1.0 to 1.7 ms, which this 0.5B model on an L4 pays in every step).
OUT_OF_FOLD_BOUNDS = {
    (BANDS[0], "ttft"): (0.12, 90),
    (BANDS[0], "tpot"): (0.10, 90),
    (BANDS[1], "ttft"): (0.33, 110),
    (BANDS[1], "tpot"): (0.13, 105),
    (BANDS[0], "itl"): (0.34, 1),
    (BANDS[1], "itl"): (0.31, 5),
}


@pytest.mark.slow  # the cross-validation's six fits (9 starts each): ~10 min, once a session
@pytest.mark.parametrize(("band", "quantity"), list(OUT_OF_FOLD_BOUNDS))
def test_out_of_fold_median_error_within_bounds(band: str, quantity: str) -> None:
    bound, least_rows = OUT_OF_FOLD_BOUNDS[(band, quantity)]
    rows, median, _ = median_ape(_out_of_fold(), band=band, quantity=quantity)
    assert rows >= least_rows
    assert median <= bound, f"{band} {quantity}: {median:.1%}"


@pytest.mark.slow
def test_vllm_one_request_at_a_time_meets_the_target_out_of_fold() -> None:
    # vLLM's own rows one request at a time, 25% TTFT / 15% TPOT the targets: 21.9% /
    # 4.6% on 16 / 14 rows, each predicted with its family held out (Qwen's by the host
    # costs the Llama 3 rows fit, ~20-24 ms a request, and the reverse).
    rows, median, _ = median_ape(_out_of_fold(), band=BANDS[0], engine="vllm", quantity="ttft")
    assert rows >= 16 and median <= 0.23, f"{median:.1%}"
    rows, median, _ = median_ape(_out_of_fold(), band=BANDS[0], engine="vllm", quantity="tpot")
    assert rows >= 14 and median <= 0.05, f"{median:.1%}"


@pytest.mark.slow
def test_every_row_is_predicted_out_of_fold_and_finite() -> None:
    predictions = _out_of_fold()
    steady_refs = {case.ref for case in steady_cases()}
    steady = [p for p in predictions if p.ref in steady_refs]
    # TTFT and TPOT of every steady row, but the TPOT of a server without CUDA graphs.
    assert len(steady) == sum(1 + case.tpot_priced for case in steady_cases())
    assert {p.band for p in steady} == {BANDS[0]}
    # A closed loop's TTFT and what else its source gives (the ITL, or a TPOT), in the
    # band of its clients.
    closed = [case for case in latency_cases() if case.kind == "closed" and case.usable]
    assert len(closed) >= 50
    for case in closed:
        quantities = {p.quantity: p for p in predictions if p.ref == case.ref}
        given = {"ttft"} | {q for q, measured in (("itl", case.itl_ms), ("tpot", case.tpot_ms))
                            if measured is not None}
        assert set(quantities) == given and len(given) == 2
        assert {p.band for p in quantities.values()} == {
            BANDS[0] if case.num_prompts == 1 else BANDS[1]}
    assert all(math.isfinite(p.ape) for p in predictions)
    # A fold never sees its own family: each row's family is the fold's.
    assert {p.family for p in predictions} >= {"llama-2", "mistral", "mixtral", "qwen"}


@pytest.mark.slow
def test_an_engine_fits_its_flops_share_only_on_three_timed_prefills() -> None:
    # An engine's share of peak FLOP/s is fitted only where the training rows time at
    # least three prefills (not a prompt the benchmark's warm-up left cached). vLLM's
    # that do are Llama 3's but one (Qwen3-14B-AWQ): with Llama 3 held out, its share
    # stays at the prior; in the other folds it is fitted. TensorRT-LLM's 78 rows fit
    # their own.
    timed = [c for c in steady_cases() if c.engine == "vllm" and c.prefill_measured]
    by_family = Counter(family(c) for c in timed)
    assert by_family["llama-3"] >= 3 and sum(by_family.values()) - by_family["llama-3"] < 3
    folds = _cross_validated()[1]
    assert folds["llama-3"]["vllm.compute"] == NEUTRAL_START["vllm.compute"]
    assert all(values["vllm.compute"] != NEUTRAL_START["vllm.compute"]
               for held, values in folds.items() if held != "llama-3")
    assert any(values["tensorrt-llm.compute"] != NEUTRAL_START["tensorrt-llm.compute"]
               for values in folds.values())


def test_the_kv_share_under_load_is_found_where_the_rows_put_it() -> None:
    # Rows under load "measured" with the KV cache's bytes at a share of the weights'
    # bandwidth between the grid's points (0.5 / 2^(1/4)): the fit finds it from the
    # prior's 1 by refining around the best point of the grid, and moves nothing else.
    # Rows that read little KV (short contexts) tell the shares apart the least, so the
    # rows here are long ones: France-Travail's loops of 4,096-token prompts. (How the
    # share prices a step is `test_the_kv_cache_streams_at_its_own_share_of_the_bandwidth`.)
    loaded = [c for c in usable_cases() if c.engine == "vllm" and c.kind == "closed"
              and c.input_len >= 4096 and c.num_prompts <= 14][:3]
    assert len(loaded) == 3
    values = committed_values() | {"vllm.kv_bandwidth_ratio": 1.0}

    def priced_at(ratio: float) -> list[LatencyCase]:
        efficiency = efficiency_for(values | {"vllm.kv_bandwidth_ratio": ratio}, "vllm")
        out = []
        for case in loaded:
            ttft, tpot, _ = predict_closed(case, efficiency, FIT_REQUESTS_PER_CLIENT)
            out.append(replace(case, ttft_ms=ttft * 1e3, tpot_ms=tpot * 1e3))
        return out

    between = 0.5 / 2 ** 0.25
    assert between not in KV_RATIO_GRID
    found = fit_kv_bandwidth(values, "vllm", priced_at(between))
    # Within the refinement's last step, 2^(1/8); nothing else moved.
    share = found.pop("vllm.kv_bandwidth_ratio")
    assert abs(math.log(share / between)) <= math.log(2) / 8, share
    assert found == {k: v for k, v in values.items() if k != "vllm.kv_bandwidth_ratio"}
    # Rows priced as measured at the prior's share keep it.
    assert fit_kv_bandwidth(values, "vllm", priced_at(1.0)) == values


def test_a_prefill_timed_one_request_at_a_time_among_several_prompts() -> None:
    # vLLM's benchmark sends its first prompt once before measuring: of 30 random
    # prompts measured one at a time, that one finds its prefix cached, the other 29
    # are prefilled whole. The TTFT compared is the mean over the 30.
    (case,) = [c for c in steady_cases() if c.model == "Qwen/Qwen3-14B-AWQ"]
    assert (case.kind, case.num_prompts, case.engine) == ("steady", 30, "vllm")
    assert case.prefill_measured and case.cached_tokens == 16000 // 16 * 16 - 16
    assert case.dtype == "int4" and case.enforce_eager and not case.tpot_priced
    assert case.served().deployment.enforce_eager
    warmed = predict_steady(replace(case, num_prompts=1))[0]
    # Without the warm-up (another client), every prompt is prefilled whole.
    unwarmed = replace(case, notes=case.notes.replace("benchmark_serving.py", "a client"))
    assert not unwarmed.prefix_warmed and unwarmed.cached_tokens == 0
    whole = predict_steady(unwarmed)[0]
    assert warmed < 0.05 * whole  # a cached prompt's tail against 16,000 tokens
    ttft = predict_steady(case)[0]
    assert ttft == pytest.approx((warmed + 29 * whole) / 30, rel=1e-9)


def test_a_load_cell_is_read_or_the_row_is_not_run() -> None:
    assert _load("num_prompts=1, request_rate=inf (all sent at once)", "") == ("steady", 1)
    assert _load("num_prompts=50, request_rate=inf (all sent at once)", "") == ("burst", 50)
    assert _load("max_concurrency=1 (30 prompts, one at a time)", "") == ("steady", 30)
    assert _load("num_prompts=30, max_concurrency=1", "") == ("steady", 30)
    # One at a time, but over how many prompts (one of them cached) the mean was taken
    # is not said: the row is not run rather than read as one cached prompt.
    assert _load("max_concurrency=1", "") is None
    # A closed loop of C clients (its rows give medians, which the count barely moves).
    assert _load("max_concurrency=16 (closed loop: 16 clients, ...)", "") == ("closed", 16)
    assert _load("max_concurrency=1 (closed loop: one client)", "") == ("closed", 1)


def test_a_closed_loop_row_gives_medians_and_its_inter_token_latency() -> None:
    (case,) = [c for c in latency_cases() if c.kind == "closed" and c.num_prompts == 32]
    assert case.usable and case.statistic == "median"
    assert (case.ttft_ms, case.tpot_ms, case.itl_ms) == (135.3, None, 7.1)
    assert case.gpu.gpu is not None and case.gpu.gpu.name == "L4"
    deployment = case.served().deployment
    assert (deployment.gpu_memory_utilization, deployment.max_model_len) == (0.6, 8192)


def test_a_row_of_medians_one_request_at_a_time_and_its_servers_token_budget() -> None:
    # France-Travail's reports give medians only (one client, fixed output lengths):
    # read from the median columns, with the server's token budget where it was not
    # vLLM's default for the GPU (V0 chunked a context over 32K at 512 tokens a step).
    rows = [c for c in latency_cases() if "France-Travail" in c.notes and c.kind == "steady"]
    assert len(rows) >= 9 and all(c.usable for c in rows)
    assert all(c.statistic == "median" and c.ttft_ms and c.tpot_ms for c in rows)
    (chunked,) = [c for c in rows if c.model == "meta-llama/Meta-Llama-3.1-8B-Instruct"
                  and c.gpu.gpu is not None and c.gpu.gpu.name == "H100-NVL"
                  and c.input_len == 4096]
    assert (chunked.ttft_ms, chunked.tpot_ms) == (205.89, 8.16)
    assert chunked.served().max_num_batched_tokens == 512
    whole = replace(chunked, max_num_batched_tokens=None)
    assert whole.served().max_num_batched_tokens == 8192  # vLLM's default on an H100
    # Eight 512-token steps cost more than one of 4,096 tokens: the fixed cost of each.
    assert predict_steady(chunked)[0] > predict_steady(whole)[0]
    means = [c for c in latency_cases() if c.kind == "burst" and c.usable]
    assert means and all(c.statistic == "mean" for c in means)
    assert all(c.statistic == "median" for c in latency_cases() if c.kind == "closed")
    # Llama 3.3 70B on vLLM 0.7.1: a 30,000-token context, no chunked prefill, so V0's
    # budget of max(max_model_len, 2048) tokens a step.
    (whole_prompt,) = [c for c in rows if c.tp == 2]
    assert whole_prompt.max_num_batched_tokens == 30000 and whole_prompt.max_model_len == 30000


def test_a_closed_loop_of_medians_with_its_clients_pauses() -> None:
    # France-Travail's sweeps: C clients, each pausing 0-20 ms (0-100 ms before its
    # first request), medians over the count's requests; read with the pauses, which
    # the simulated closed loop then follows, and the server of a one-client row.
    rows = [c for c in latency_cases() if "France-Travail" in c.notes and c.kind == "closed"]
    assert len(rows) == 52 and all(c.usable and c.statistic == "median" for c in rows)
    assert all((c.pause_s, c.first_pause_s) == (0.02, 0.1) for c in rows)
    assert {c.num_prompts for c in rows} == {2, 4, 8, 14, 22, 30, 38}
    assert {c.gpu.gpu.name for c in rows if c.gpu.gpu} == {"H100-NVL", "A100-80GB", "A100-40GB"}
    steady = [c for c in latency_cases() if "France-Travail" in c.notes and c.kind == "steady"]

    def server(case: LatencyCase) -> tuple[object, ...]:
        return (case.model, case.gpu.note, case.tp, case.engine_version, case.input_len,
                case.output_len, case.max_num_batched_tokens, case.max_model_len)

    assert {server(c) for c in rows} <= {server(c) for c in steady}
    (row,) = [c for c in rows if c.tp == 2 and c.num_prompts == 8]
    assert (row.ttft_ms, row.tpot_ms, row.max_num_batched_tokens) == (9727.42, 36.50, 30000)
    # V0 without chunked prefill: max(max_model_len, 2048) tokens a step.
    assert {c.max_num_batched_tokens for c in rows if c.engine_version == "0.4.3"} == {8192}
    # The rule's two exclusions, as far as the kept counts show them: no kept count ran
    # with the KV cache 90% used, nor after a count with more than 10% more throughput.
    sweeps: dict[tuple[object, ...], list[tuple[int, float]]] = {}
    for c in rows:
        assert float(re.search(r"KV cache at most ([\d.]+)% used", c.notes).group(1)) < 90
        throughput = float(re.search(r"x the median speed (\d+) tok/s", c.notes).group(1))
        sweeps.setdefault(server(c), []).append((c.num_prompts, throughput))
    for points in sweeps.values():
        points.sort()
        assert all(later >= 0.9 * max(t for _, t in points[:k])
                   for k, (_, later) in enumerate(points) if k)
    # The simulated loop follows the pauses (as fast clients in lockstep it would not).
    (paused,) = [c for c in rows if c.gpu.note.startswith("A100-80GB") and c.num_prompts == 8
                 and c.input_len == 1024]
    efficiency = DEFAULT_EFFICIENCY.for_engine("vllm")
    assert predict_closed(paused, efficiency) != predict_closed(
        replace(paused, pause_s=0.0, first_pause_s=0.0), efficiency)


def test_a_closed_loop_keeps_its_waves_as_vllms_benchmark_does() -> None:
    # `vllm bench serve --max-concurrency C` starts its C clients at once and, with
    # fixed lengths, they keep finishing and arriving together: prefills queue behind
    # each other. Measured on the L4 rows, the median TTFT grows 5x from 1 to 32
    # clients while the inter-token latency grows 1.4x; the simulator's closed loop
    # must show the same kind of growth (a loop without waves keeps the TTFT flat).
    rows = {c.num_prompts: c for c in latency_cases()
            if c.kind == "closed" and c.model == "Qwen/Qwen2.5-0.5B-Instruct"}
    efficiency = DEFAULT_EFFICIENCY.for_engine("vllm")
    one, many = (predict_closed(rows[c], efficiency) for c in (1, 32))
    measured = rows[32].ttft_ms / rows[1].ttft_ms
    assert many[0] / one[0] > 0.5 * measured
    assert 1.0 < many[2] / one[2] < 1.5 * (rows[32].itl_ms / rows[1].itl_ms)


def test_a_model_outside_the_families_is_a_family_of_its_own() -> None:
    # Sizes of one model share its family; a new model is held out alone, not refused.
    assert model_family("google/gemma-2-9b") == model_family("google/gemma-2-27b-it") == "gemma-2"
    assert model_family("meta-llama/Meta-Llama-3.1-8B-Instruct") == "llama-3"
    assert model_family("meta-llama/Llama-3.3-70B-Instruct") == "llama-3"
    assert model_family("meta-llama/Llama-2-70b-hf") == "llama-2"
    assert model_family("codellama/CodeLlama-34b-hf") == "codellama"
    assert model_family("huggyllama/llama-30b") == "llama"
    assert model_family("deepseek-ai/DeepSeek-V3") == "deepseek-v3"
    assert model_family("gemma-2-9b") not in FAMILIES
    assert model_family("openai/gpt-oss-120b") == model_family("gpt-oss-20b") == "gpt-oss"


@pytest.mark.slow  # one fit on every usable row (9 starts): ~2 min
def test_the_shipped_constants_are_the_fit_on_every_row() -> None:
    # The out-of-fold errors are those of the procedure that made the shipped
    # constants: they are its fit on all the rows (`python bench/model_cv.py --fit`).
    assert differing_terms(fit(usable_cases()), committed_values()) == []


def test_model_cv_fit_says_when_the_shipped_constants_are_not_the_fits(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import model_cv

    shipped = committed_values()
    monkeypatch.setattr(model_cv, "fit", lambda cases, rounds, starts: dict(shipped))
    assert main(["--fit"]) == 0
    assert "are this fit's" in capsys.readouterr().out
    moved = {**shipped, "vllm.compute": shipped["vllm.compute"] * 1.01}
    monkeypatch.setattr(model_cv, "fit", lambda cases, rounds, starts: dict(moved))
    assert main(["--fit"]) == 1
    out = capsys.readouterr().out
    assert "not this fit's" in out
    assert [line.split()[0] for line in out.splitlines() if "differs" in line] == [
        "vllm.compute"]
    # Three digits: a rounding of the fitted figure is not a difference.
    assert differing_terms({**shipped, "bandwidth": shipped["bandwidth"] * 1.004},
                           shipped) == []


def test_the_committed_constants_predict_finite_figures_for_every_steady_row() -> None:
    for case in steady_cases():
        ttft, tpot = predict_steady(case)
        assert math.isfinite(ttft) and math.isfinite(tpot) and ttft > 0 and tpot > 0


@pytest.mark.parametrize("bad", ["2,x", "0,10", ""])
def test_model_cv_refuses_starts_that_are_not_positive_numbers(
        bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--per-request-starts-ms", bad])
    assert exit_info.value.code == 2
    assert "--per-request-starts-ms" in capsys.readouterr().err
