"""The CUDA graph term of the KV budget (vLLM 0.21 and later subtract the graph pool they
profile before sizing the KV cache) against public vLLM start-up logs
(tests/data/groundtruth/cudagraph_memory.csv): the graphs vLLM captures, and the pool
they take, predicted out of sample (each model held out of the fit of its own rows)."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.model import Deployment, ServedModel, find_gpu, parse_config
from sidecar.model.architecture import DenseMlp, MoeMlp
from sidecar.model.memory_budget import CUDAGRAPH_PROFILED_SINCE, cudagraph_counts
from sidecar.model.units import GIB, MIB

from support.admission_fixtures import TINY_LLAMA
from support.cli import run_cli as _cli

DATA = Path(__file__).parent / "data" / "groundtruth" / "cudagraph_memory.csv"


@dataclass(frozen=True)
class GraphRow:
    model: str
    model_type: str
    layers: int
    moe: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    piecewise: int
    full: int
    pool_gib: float | None
    notes: str

    @property
    def per_layer_graph_mib(self) -> float:
        assert self.pool_gib is not None
        return self.pool_gib * GIB / MIB / (self.layers * (self.piecewise + self.full))


def rows() -> list[GraphRow]:
    with DATA.open(newline="") as handle:
        return [GraphRow(row["model"], row["model_type"], int(row["layers"]),
                         row["moe"] == "yes", int(row["max_num_seqs"]),
                         int(row["max_num_batched_tokens"]), int(row["piecewise_graphs"]),
                         int(row["full_graphs"]),
                         float(row["pool_gib"]) if row["pool_gib"] else None, row["notes"])
                for row in csv.DictReader(handle)]


def test_graph_counts_are_the_ones_vllm_logged() -> None:
    checked = 0
    for row in rows():
        if "captures no FULL graphs" in row.notes:  # its attention backend's choice
            assert cudagraph_counts(row.max_num_seqs, row.max_num_batched_tokens,
                                    model_type=row.model_type)[0] == row.piecewise
            continue
        assert cudagraph_counts(row.max_num_seqs, row.max_num_batched_tokens,
                                model_type=row.model_type) == (row.piecewise, row.full), row
        checked += 1
    assert checked >= 20
    # vLLM 0.32's own sizes on Blackwell (a 1,024 ceiling) and at small max_num_seqs:
    # 1, 2, 4, 8..248 by 8, 256..1024 by 16; and up to 2 x 100, plus 100 itself.
    assert cudagraph_counts(1024, 8192, blackwell=True) == (3 + 31 + 49, 3 + 31 + 49)
    assert cudagraph_counts(100, 8192) == (3 + 25 + 1, 3 + 12 + 1)


def _kind_constant(mlp: type[DenseMlp] | type[MoeMlp]) -> float:
    return mlp.cudagraph_bytes_per_graph / MIB


def test_per_layer_constants_are_the_medians_of_the_logs() -> None:
    pooled = [row for row in rows() if row.pool_gib is not None]
    dense = statistics.median(r.per_layer_graph_mib for r in pooled if not r.moe)
    moe = statistics.median(r.per_layer_graph_mib for r in pooled if r.moe)
    assert _kind_constant(DenseMlp) == pytest.approx(dense, abs=0.005)
    assert _kind_constant(MoeMlp) == pytest.approx(moe, abs=0.005)


def test_pool_predicted_out_of_sample_within_its_bounds() -> None:
    """Each model's rows predicted from the median of the other models of its kind."""
    pooled = [row for row in rows() if row.pool_gib is not None]
    errors_gib, errors_rel = [], []
    for row in pooled:
        others = [r.per_layer_graph_mib for r in pooled
                  if r.model != row.model and r.moe == row.moe]
        predicted_gib = (statistics.median(others) * row.layers * (row.piecewise + row.full)
                         * MIB / GIB)
        assert row.pool_gib is not None
        errors_gib.append(abs(predicted_gib - row.pool_gib))
        errors_rel.append(abs(predicted_gib / row.pool_gib - 1))
    assert len(pooled) >= 20
    assert statistics.median(errors_rel) <= 0.12  # 9.4% when measured
    assert max(errors_gib) <= 0.5  # 0.47 GiB (gemma-3-27b) when measured


def _plan(*flags: str) -> dict[str, object]:
    code, out, err = _cli(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                           "--max-model-len", "8192", "--json", *flags])
    assert code == 0, err
    result: dict[str, object] = json.loads(out)
    return result


def test_plan_takes_the_graph_pool_out_of_the_budget_from_vllm_0_21() -> None:
    default = _plan()
    assert default["vllm_version"] == "0.32"
    assert default["cudagraphs"] == {"piecewise": 51, "full": 51}  # H100: 1,024 sequences
    graphs = default["cudagraph_bytes"]
    assert isinstance(graphs, int)
    # Qwen3-8B: 36 dense layers x 102 graphs x 0.26 MiB
    assert graphs == 36 * 102 * DenseMlp.cudagraph_bytes_per_graph
    for flags in (["--enforce-eager"], ["--vllm-version", "0.20"]):
        other = _plan(*flags)
        assert other["cudagraph_bytes"] == 0
        budget = default["kv_budget_bytes"]
        assert isinstance(budget, int)
        assert other["kv_budget_bytes"] == budget + graphs
    assert _plan("--vllm-version", "0.21.1")["cudagraph_bytes"] == graphs
    code, out, _ = _cli(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100"])
    assert code == 0
    assert "CUDA graphs (vLLM 0.32)" in out and "51 piecewise + 51 full" in out
    code, out, _ = _cli(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--enforce-eager"])
    assert code == 0 and "- (--enforce-eager)" in out
    # the vLLM flags printed start the server the plan sized
    for flags, eager in (([], False), (["--enforce-eager"], True)):
        code, out, _ = _cli(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                             "--print", "vllm-args", *flags])
        assert code == 0 and ("--enforce-eager" in out) == eager


@pytest.mark.parametrize("text", ["latest", "0", "0.x", "1.2.3.4"])
def test_a_bad_vllm_version_is_one_clear_error(text: str) -> None:
    code, _, err = _cli(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                         "--vllm-version", text])
    assert code == 2
    assert "--vllm-version" in err and "like 0.32" in err and err.count("\n") == 1


def test_moe_layers_keep_more_per_graph_than_dense_ones() -> None:
    moe_config = {**TINY_LLAMA, "model_type": "qwen2_moe", "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 0}
    gpu = find_gpu("H100")
    dense = ServedModel(parse_config(TINY_LLAMA, "dense"), Deployment(), gpu)
    moe = ServedModel(parse_config(moe_config, "moe"), Deployment(), gpu)
    assert moe.arch.is_moe and not dense.arch.is_moe
    layers = len(dense.arch.layers)
    assert dense.cudagraph_bytes == layers * 102 * DenseMlp.cudagraph_bytes_per_graph
    assert moe.cudagraph_bytes == layers * 102 * MoeMlp.cudagraph_bytes_per_graph
    assert CUDAGRAPH_PROFILED_SINCE == (0, 21)
