"""`kvgate plan`: the JSON contract, the report, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.cli.main import main
from sidecar.cli.plan import build_parser
from sidecar.model import Deployment, ServedModel, read_architecture
from sidecar.model.gpu import find_gpu
from sidecar.model.summary import PlanInput, compute_plan

CONTRACT_KEYS = {
    "params_total", "params_active", "weights_bytes", "kv_bytes_per_token",
    "kv_bytes_per_sequence", "kv_budget_bytes", "kv_capacity_tokens", "max_concurrency",
    "ttft_s", "tpot_s", "e2e_s", "prefill_bound", "decode_bound", "fits",
}


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["plan", *args, "--json"]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def test_json_contract_with_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                       "--prompt-tokens", "2000", "--output-tokens", "100", "--concurrency", "8")
    assert result.keys() >= CONTRACT_KEYS
    assert result["kv_bytes_per_token"] == 147_456
    assert result["prefill_bound"] == "compute" and result["decode_bound"] == "memory"
    assert result["fits"] is True
    assert result["latency_source"] == "simulator"
    # Every simulated request of a fixed shape takes its TTFT + 99 x its TPOT: the mean
    # E2E lies between the p50s' and the p90s' sums, give or take the spread.
    e2e, ttft, tpot, ttft90, tpot90 = (float(result[k]) for k in (  # type: ignore[arg-type]
        "e2e_s", "ttft_s", "tpot_s", "ttft_p90_s", "tpot_p90_s"))
    assert 0.9 * (ttft + 99 * tpot) <= e2e <= ttft90 + 99 * tpot90
    closed = result["closed_form"]
    assert isinstance(closed, dict)
    # The closed form too: the prefill's step gives the first token, 99 decode steps the rest.
    assert closed["e2e_s"] == pytest.approx(closed["ttft_s"] + 99 * closed["tpot_s"])


def test_latency_under_load_comes_from_the_simulator(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 64 clients with long prompts: prefills queue behind each other and share the
    # token budget with decodes, which one prefill beside 63 decodes does not see.
    args = ("--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--prompt-tokens", "6000",
            "--output-tokens", "200")
    alone = plan_json(capsys, *args)
    loaded = plan_json(capsys, *args, "--concurrency", "64")
    closed = loaded["closed_form"]
    assert isinstance(closed, dict)
    assert float(loaded["ttft_p90_s"]) > 1.5 * float(closed["ttft_s"])  # type: ignore[arg-type]
    assert float(loaded["ttft_s"]) > float(alone["ttft_s"])  # type: ignore[arg-type]
    # One client: the simulated request runs alone, as the closed form prices it.
    assert float(alone["ttft_s"]) == pytest.approx(  # type: ignore[arg-type]
        alone["closed_form"]["ttft_s"], rel=0.1)  # type: ignore[index]


def test_a_target_no_seat_meets_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    # 1 ms TTFT: no prefill of 2,000 tokens is that fast, even alone.
    args = ("--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--prompt-tokens", "2000",
            "--ttft-slo-ms", "1", "--arrival-rate", "2")
    rec = plan_json(capsys, *args)["recommendation"]
    assert isinstance(rec, dict)
    assert rec["max_num_seqs"] == 1 and rec["limited_by"] == "ttft-slo"
    assert rec["targets_met"] is False
    assert main(["plan", *args]) == 0
    assert "NOT MET" in capsys.readouterr().out


def test_max_num_seqs_is_the_largest_that_meets_the_targets(
        capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.cli.plan import plan_input
    from sidecar.model.simulator_plan import PlanSimulator

    args = ["--model", "Qwen/Qwen3-8B", "--gpu", "L40S", "--prompt-tokens", "2000",
            "--output-tokens", "200", "--tpot-slo-ms", "60", "--ttft-slo-ms", "1500",
            "--arrival-rate", "6"]
    rec = plan_json(capsys, *args)["recommendation"]
    assert isinstance(rec, dict)
    seats = rec["max_num_seqs"]
    assert rec["source"] == "simulator" and rec["limited_by"] in ("tpot-slo", "ttft-slo")
    assert rec["targets_met"] is True
    assert rec["tpot_p90_s_at_max"] <= 0.060 and rec["ttft_p90_s_at_max"] <= 1.5
    simulator = PlanSimulator(plan_input(build_parser().parse_args(args)).served, 2000, 200)
    assert simulator.closed_loop(seats + 1, seats + 1).meets(1.5, 0.060) == rec["limited_by"]
    # Replicas: enough throughput for the rate, each replica's open loop within targets.
    assert rec["replicas"] * rec["throughput_per_replica_per_s"] >= 6
    per_replica = rec["per_replica_open_loop"]
    assert per_replica["tpot_p90_s"] <= 0.060 and per_replica["ttft_p90_s"] <= 1.5
    fewer = simulator.open_loop(6 / (rec["replicas"] - 1), seats) if rec["replicas"] > 1 \
        else None
    assert fewer is None or fewer.meets(1.5, 0.060) is not None or \
        (rec["replicas"] - 1) * rec["throughput_per_replica_per_s"] < 6


def test_capacity_from_a_logged_budget_needs_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    # Qwen3-14B on an A100 40GB logged 6.51 GiB and 42,656 tokens (LMCache#1739).
    result = plan_json(capsys, "--model", "Qwen/Qwen3-14B", "--available-kv-gib", "6.51",
                       "--max-model-len", "32768")
    assert result["kv_capacity_tokens"] == 42_656
    assert result["max_concurrency"] == pytest.approx(1.30, abs=0.005)
    assert result["ttft_s"] is None and result["tpot_s"] is None
    assert result["latency_source"] is None
    assert result["kv_bytes_per_sequence"] == 32_768 * 163_840


def test_sequence_tokens_and_tp(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "meta-llama/Meta-Llama-3.1-8B", "--tp", "2",
                       "--sequence-tokens", "8192")
    assert result["kv_bytes_per_token"] == 65_536
    assert result["kv_bytes_per_sequence"] == 8192 * 65_536


def test_report_is_a_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "A100-80GB",
                 "--chain", "1000:200,1500:300", "--arrival-rate", "2"]) == 0
    out = capsys.readouterr().out
    for text in ("weights per GPU", "KV cache size (vLLM's log)", "TTFT", "TPOT",
                 "recommended --max-num-seqs", "replicas needed", "Chain (prefix cache on)"):
        assert text in out


def test_vllm_args_and_helm_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "L40S", "--tpot-slo-ms", "40",
                 "--print", "vllm-args"]) == 0
    args = capsys.readouterr().out
    assert "--max-num-seqs" in args and "--gpu-memory-utilization 0.9" in args
    assert args.startswith("vllm serve Qwen/Qwen3-8B \\\n")  # positional, not --model
    assert "--model" not in args
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "L40S", "--arrival-rate", "5",
                 "--print", "helm-values"]) == 0
    assert "replicaCount:" in capsys.readouterr().out


def test_the_closed_form_prices_only_the_requests_that_run_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """5,000 clients where the server runs far fewer: the closed form beside the
    simulator prices one prefill beside the requests that fit, not 4,999 decodes."""
    from sidecar.cli.plan import build_parser, plan_input
    from sidecar.model.planning import kv_concurrency_limit, steady_latency

    flags = ["--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--max-model-len", "32768",
             "--prompt-tokens", "2000", "--output-tokens", "500"]
    served = plan_input(build_parser().parse_args(flags)).served
    fit = kv_concurrency_limit(served, 2500, 1.0, output_tokens=500)
    assert fit is not None and fit < served.max_num_seqs < 5000
    assert main(["plan", *flags, "--concurrency", "5000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    closed = result["closed_form"]
    assert result["closed_form_running"] == fit
    expected = steady_latency(served, 2000, 500, fit)
    assert expected is not None
    assert closed["tpot_s"] == pytest.approx(expected.tpot_s)
    assert closed["ttft_s"] == pytest.approx(expected.ttft_s)
    assert main(["plan", *flags, "--concurrency", "5000"]) == 0
    assert f"closed form (one prefill beside {fit - 1} decodes: what runs at once)" in (
        capsys.readouterr().out)


def test_printed_arguments_say_when_the_targets_are_not_met(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A 1 ms TPOT target no deployment meets: the report says NOT MET; --print's
    arguments still come (the closest deployment), with a note on stderr."""
    base = ["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--tpot-slo-ms", "1",
            "--arrival-rate", "4"]
    assert main(base) == 0
    report = capsys.readouterr()
    assert "NOT MET" in report.out and "p90 at 1 client " in report.out
    assert "targets are not met" not in report.err
    for emit in ("vllm-args", "helm-values"):
        assert main([*base, "--print", emit]) == 0
        printed = capsys.readouterr()
        assert "the TTFT/TPOT targets are not met even at this recommendation" in printed.err
        assert printed.out.strip()
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--tpot-slo-ms", "100",
                 "--print", "vllm-args"]) == 0
    assert "targets are not met" not in capsys.readouterr().err


def test_helm_values_name_the_model_asked_for_not_the_preset_that_priced_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The chart passes servedModelName to vLLM as --served-model-name: clients send the
    id they asked kvgate plan about, not the bundled config of the same architecture."""
    assert main(["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "H100",
                 "--tp", "4", "--print", "helm-values"]) == 0
    captured = capsys.readouterr()
    assert "bundled config of meta-llama/Meta-Llama-3.1-70B" in captured.err
    assert '  name: "Llama-3.1-70B-Instruct"\n' in captured.out
    assert '  servedModelName: "meta-llama/Llama-3.1-70B-Instruct"\n' in captured.out


def test_printed_arguments_name_a_local_model_by_its_directory_and_a_preset_by_its_id(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM loads a directory, and the chart mounts one: a local config.json is named by
    its directory; a preset's bare name by the preset's own id."""
    from sidecar.model.presets import load

    model = tmp_path / "qwen3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(load("Qwen/Qwen3-8B")))
    for given in (str(model / "config.json"), str(model)):
        assert main(["plan", "--model", given, "--gpu", "H100", "--print", "vllm-args"]) == 0
        assert capsys.readouterr().out.startswith(f"vllm serve {model} \\\n")
        assert main(["plan", "--model", given, "--gpu", "H100", "--print", "helm-values"]) == 0
        assert '  name: "qwen3-8b"\n' in capsys.readouterr().out
    assert main(["plan", "--model", "qwen3-8b", "--gpu", "H100", "--print", "vllm-args"]) == 0
    assert capsys.readouterr().out.startswith("vllm serve Qwen/Qwen3-8B \\\n")
    assert main(["plan", "--model", "qwen3-8b", "--gpu", "H100", "--print", "helm-values"]) == 0
    out = capsys.readouterr().out
    assert '  name: "Qwen3-8B"\n' in out and '  servedModelName: "Qwen/Qwen3-8B"\n' in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/config.json"], "is not a file"),
        (["--model", "Qwen/Qwen3-8B", "--gpu", "Z9000"], "unknown GPU 'Z9000'"),
        (["--model", "Qwen/Qwen3-8B", "--tp", "3"], "does not divide"),
        (["--model", "Qwen/Qwen3-8B", "--tp", "two"], "--tp: expected a positive integer"),
        (["--model", "Qwen/Qwen3-8B", "--max-model-len", "1.5"], "--max-model-len"),
        (["--model", "Qwen/Qwen3-8B", "--gpu-memory-gib", "10"], "needs all of"),
        (["--model", "Qwen/Qwen3-8B", "--gpu-memory-gib", "1e308", "--gpu-bandwidth-gbps",
          "100", "--gpu-tflops", "10"], "--gpu-memory-gib: expected a size in GiB of at most"),
        (["--model", "Qwen/Qwen3-8B", "--available-kv-gib", "1e300"],
         "--available-kv-gib: expected a size in GiB of at most"),
        (["--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--max-model-len", "1000",
          "--output-tokens", "100"],
         "--prompt-tokens 1,024 + --output-tokens 100 = 1,124 tokens is more than "
         "--max-model-len 1,000"),
        (["--model", "Qwen/Qwen3-8B", "--chain", "10:x"], "--chain entry '10:x'"),
        (["--model", "Qwen/Qwen3-8B", "--max-model-len", "4096", "--sequence-tokens", "5000"],
         "--sequence-tokens 5,000 is more than --max-model-len 4,096"),
        (["--model", "Qwen/Qwen3-8B", "--json", "--print", "vllm-args"],
         "--json and --print vllm-args each say what to print: give one"),
        (["--model", "Qwen/Qwen3-8B", "--max-model-len", "4096", "--chain", "1000:200,4000:500"],
         "--chain call 2 (4,000:500) is 4,500 tokens, more than --max-model-len 4,096"),
        (["--model", "Qwen/Qwen3-8B", "--gpu-memory-utilization", "2"], "in (0, 1]"),
        (["--gpu", "H100"], "--model"),
        (["--model", "Qwen/Qwen3-8B", "--shared-prefix-tokens", "3000"],
         "--shared-prefix-tokens 3,000 is more than --prompt-tokens 1,024"),
        (["--model", "Qwen/Qwen3-8B", "--max-num-batched-tokens", "64", "--max-num-seqs", "128"],
         "--max-num-batched-tokens (64) must be at least --max-num-seqs (128)"),
        (["--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--max-num-seqs", "10000"],
         "(8192, vLLM's default for the GPU) must be at least --max-num-seqs (10000)"),
        (["--model", "Qwen/Qwen3-8B", "--kv-cache-dtype", "fp8_ds_mla"],
         "Qwen/Qwen3-8B has no sparse MLA layers: use fp8"),
        (["--model", "Qwen/Qwen3-8B", "--max-model-len", "4096",
          "--long-prefill-token-threshold", "5000"],
         "--long-prefill-token-threshold 5000 is above --max-model-len 4096: vLLM refuses it"),
        (["--model", "Qwen/Qwen3-8B", "--long-prefill-token-threshold", "-1"],
         "--long-prefill-token-threshold"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar", "plan", *args],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert message in lines[0]


def test_bad_calibration_file(tmp_path: Path) -> None:
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"efficiency": {"compute": 0.0}}))
    proc = subprocess.run([sys.executable, "-m", "sidecar", "plan", "--model", "Qwen/Qwen3-8B",
                           "--gpu", "H100", "--calibration", str(bad)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "efficiency compute must be" in proc.stderr


def test_calibration_changes_latency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = plan_json(capsys, "--model", "Qwen/Qwen3-8B", "--gpu", "H100")
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"efficiency": {"bandwidth": 0.4}}))
    slow = plan_json(capsys, "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                     "--calibration", str(cal))
    assert float(slow["tpot_s"]) > 1.5 * float(base["tpot_s"])  # type: ignore[arg-type]


def test_help_explains_every_flag() -> None:
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"
    for flag in ("--gpu-memory-gib", "--gpu-bandwidth-gbps", "--gpu-tflops", "--available-kv-gib",
                 "--sequence-tokens", "--arrival-rate", "--kv-cache-dtype", "--json"):
        assert flag in text


def test_top_level_help_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2


def test_helm_values_from_plan_render_with_the_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from support.helm import render

    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "L40S", "--tp", "2",
                 "--arrival-rate", "20", "--print", "helm-values"]) == 0
    values = tmp_path / "values.yaml"
    values.write_text(capsys.readouterr().out)
    manifests = render(Path(__file__).resolve().parent.parent / "helm" / "kvgate", [values])
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "L40S", "--tp", "2",
                 "--arrival-rate", "20", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    args = " ".join(containers["vllm"].get("args", []) + containers["vllm"].get("command", []))
    assert str(plan["recommendation"]["max_num_seqs"]) in args
    env = {e["name"]: e.get("value") for e in containers["kvgate"]["env"]}
    assert env["KVGATE_GPU"] == "L40S" and env["KVGATE_TP"] == "2"
    assert env["KVGATE_MAX_NUM_SEQS"] == str(plan["recommendation"]["max_num_seqs"])
    assert "KVGATE_ASYNC_SCHEDULING" not in env  # a GPU build's default


@pytest.mark.parametrize("flags", [["--cpu-build"], ["--gpu", "L40S", "--no-async-scheduling"]],
                         ids=["cpu-build", "no-async-scheduling"])
def test_helm_values_tell_the_sidecar_how_the_server_schedules(
        flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sidecar cannot learn that the server schedules each step after the last (its
    predicted waits count half a step, not one and a half), nor a CPU build's batched
    tokens: the values give them."""
    from support.helm import render

    assert main(["plan", "--model", "Qwen/Qwen3-0.6B", "--max-model-len", "4096", *flags,
                 "--print", "helm-values"]) == 0
    values = tmp_path / "values.yaml"
    values.write_text(capsys.readouterr().out)
    manifests = render(Path(__file__).resolve().parent.parent / "helm" / "kvgate", [values])
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    kvgate = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "kvgate")
    env = {e["name"]: e.get("value") for e in kvgate["env"]}
    assert env["KVGATE_ASYNC_SCHEDULING"] == "false"
    vllm = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == "vllm")
    gpus = [k for k in (vllm["resources"].get("limits") or {}) if "gpu" in k]
    if "--cpu-build" in flags:
        assert env["KVGATE_MAX_NUM_BATCHED_TOKENS"] == "2048"
        assert gpus == []  # a CPU build's pod asks for no GPU
    else:
        assert "KVGATE_MAX_NUM_BATCHED_TOKENS" not in env
        assert gpus


def test_a_deployment_that_does_not_fit_exits_1_and_recommends_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 70B in bf16 on one L4: the weights alone are six times its memory.
    args = ["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "L4"]
    assert main([*args, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is False
    assert "the weights take 131.42 GiB per GPU" in result["fit_problems"][0]
    assert result["recommendation"]["max_num_seqs"] is None
    assert main(args) == 1
    report = capsys.readouterr().out
    assert "NO: the weights take" in report and "- (the deployment does not fit)" in report
    for emit in ("vllm-args", "helm-values"):
        assert main([*args, "--print", emit]) == 1
        out = capsys.readouterr()
        assert out.out == "" and "does not fit, so there is nothing to start" in out.err
    # Nor does it simulate a server that does not start.
    assert main([*args, "--simulate", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["simulated"] is None
    assert main([*args, "--simulate"]) == 1
    assert "Simulated: - (the deployment does not fit)" in capsys.readouterr().out
    # A forced block count skips vLLM's check of the KV memory, not of the weights.
    assert main([*args, "--num-gpu-blocks-override", "1000", "--max-model-len", "8192",
                 "--json"]) == 1
    assert "the weights take" in json.loads(capsys.readouterr().out)["fit_problems"][0]
    # The weights fit but one request of --max-model-len does not: vLLM refuses to start.
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--max-model-len",
                 "1000000", "--json"]) == 1
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["fits"] is False
    assert f"needs {1_000_000 // 16:,} KV blocks and the cache holds " \
        f"{result['num_gpu_blocks'] - 1:,}" in result["fit_problems"][0]
    assert "beyond the model's max_position_embeddings (40,960)" in out.err


def test_a_request_longer_than_max_model_len_is_bad_input(
        capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM cuts (0.32) or refuses (0.20) a request of prompt + max_tokens past
    # --max-model-len: a plan of such requests (or its flags) would not be of them.
    for extra in (["--max-model-len", "512", "--prompt-tokens", "300", "--output-tokens",
                   "300"], ["--prompt-tokens", "100000"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", *extra,
                  "--print", "vllm-args"])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert "is more than --max-model-len" in captured.err
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--max-model-len",
                 "1280", "--json"]) == 0  # 1,024 + 256: exactly fits
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 1024
    # The default request, not given, is shortened to fit (a capacity question).
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--max-model-len",
                 "1000", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert (result["prompt_tokens"], result["output_tokens"]) == (750, 250)
    assert "latency is planned for 750 + 250" in captured.err


def test_without_a_gpu_what_is_not_known_is_null(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_json(capsys, "--model", "Qwen/Qwen3-8B", "--tpot-slo-ms", "20")
    assert result["fits"] is None and result["fit_problems"] == []
    # Every key of the simulator's path is there, null, off it.
    for key in ("ttft_p90_s", "tpot_p90_s", "throughput_requests_per_s"):
        assert key in result and result[key] is None
    rec = result["recommendation"]
    assert isinstance(rec, dict)
    for key in ("ttft_p90_s_at_max", "tpot_p90_s_at_max", "throughput_per_replica_per_s",
                "targets_met", "per_replica_open_loop", "source"):
        assert key in rec and rec[key] is None
    assert main(["plan", "--model", "Qwen/Qwen3-8B"]) == 0
    report = capsys.readouterr().out
    assert "- (give --gpu or --available-kv-gib)" in report and "-bound" not in report


def test_a_budget_the_server_logged_says_its_weights_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A GPU too small for the estimated weights, but the server logged its KV budget: it
    # started, so the plan does not second-guess the weights.
    result = plan_json(capsys, "--model", "Qwen/Qwen3-8B", "--gpu", "L4",
                       "--gpu-memory-gib", "10", "--available-kv-gib", "2",
                       "--max-model-len", "8192")
    assert result["fits"] is True and result["fit_problems"] == []


def test_max_num_seqs_defaults_below_the_batched_tokens_as_vllm_lowers_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's default of 1,024 sequences on an H100 is lowered to 512 batched tokens.
    result = plan_json(capsys, "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                       "--max-model-len", "8192", "--max-num-batched-tokens", "512")
    rec = result["recommendation"]
    assert isinstance(rec, dict) and 1 <= rec["max_num_seqs"] <= 512


def test_the_closed_form_says_when_it_misses_a_target() -> None:
    from sidecar.cli.plan import plan_input
    from sidecar.model.summary import compute_plan

    def closed_form(tpot_slo_ms: str) -> dict[str, object]:
        args = build_parser().parse_args(["--model", "Qwen/Qwen3-8B", "--gpu", "L4",
                                          "--max-model-len", "8192",
                                          "--tpot-slo-ms", tpot_slo_ms])
        recommendation: dict[str, object] = compute_plan(plan_input(args))["recommendation"]
        return recommendation

    # One request's TPOT on an L4 reads 16 GB of weights at 300 GB/s: over 50 ms.
    missed, met = closed_form("1"), closed_form("500")
    assert (missed["source"], missed["targets_met"], missed["max_num_seqs"]) == (
        "closed-form", False, 1)
    assert (met["source"], met["targets_met"]) == ("closed-form", True)


def test_vllm_args_carry_every_setting_the_plan_was_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = ["--dtype", "fp8", "--kv-cache-dtype", "fp8", "--max-num-batched-tokens",
                "4096", "--no-prefix-cache", "--data-parallel-size", "2",
                "--num-speculative-tokens", "3", "--speculative-method", "ngram",
                "--long-prefill-token-threshold", "512"]
    base = ["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", *settings]
    assert main([*base, "--print", "vllm-args"]) == 0
    command = capsys.readouterr().out
    for flag in ("--quantization fp8", "--kv-cache-dtype fp8", "--max-num-batched-tokens 4096",
                 "--no-enable-prefix-caching", "--data-parallel-size 2",
                 "--long-prefill-token-threshold 512",
                 """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'"""):
        assert flag in command
    # Without a method vLLM would take a draft model it is not given: no flag, a note.
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100",
                 "--num-speculative-tokens", "3", "--print", "vllm-args"]) == 0
    out = capsys.readouterr()
    assert "--speculative-config" not in out.out and "without --speculative-method" in out.err
    # The chart runs one engine per pod: the rest go to vllm.extraArgs, one argument each.
    from support.helm import render

    assert main([*base, "--print", "helm-values"]) == 0
    out = capsys.readouterr()
    assert "--data-parallel-size is left out" in out.err
    values = tmp_path / "values.yaml"
    values.write_text(out.out)
    manifests = render(Path(__file__).resolve().parent.parent / "helm" / "kvgate", [values])
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    vllm = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == "vllm")
    args = vllm["args"]
    for flag, value in (("--kv-cache-dtype", "fp8"), ("--quantization", "fp8"),
                        ("--max-num-batched-tokens", "4096"), ("--block-size", "16")):
        assert args[args.index(flag) + 1] == value
    assert "--no-enable-prefix-caching" in args and "--data-parallel-size" not in args
    # What the sidecar cannot learn from the server, it is told.
    kvgate = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "kvgate")
    env = {e["name"]: e.get("value") for e in kvgate["env"]}
    assert env["KVGATE_MAX_NUM_BATCHED_TOKENS"] == "4096"
    assert env["KVGATE_LONG_PREFILL_TOKEN_THRESHOLD"] == "512"
    assert args[args.index("--long-prefill-token-threshold") + 1] == "512"
    assert (env["KVGATE_NUM_SPECULATIVE_TOKENS"], env["KVGATE_SPECULATIVE_METHOD"]) == (
        "3", "ngram")


@pytest.mark.parametrize("command", ["gpus", "presets"])
def test_listing_commands_explain_themselves(command: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvgate {command}") and "--" in out
    assert main([command, "--frobnicate"]) == 2
    assert "takes no options" in capsys.readouterr().err


def test_the_gpu_list_shows_the_other_names_plan_accepts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--gpu H100` is what the examples use: the list says which entry it names."""
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    table, notes = out.split("\nsources:\n")
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    # Each figure's source is a numbered note under the table, not a column that widens
    # every row past a terminal's width.
    assert max(len(line) for line in table.splitlines()) <= 140
    assert rows["H100-SXM"].endswith("]") and "  [1] " in notes
    assert "also as --gpu" in rows["gpu"]
    assert "h100," in rows["H100-SXM"] and "a100," in rows["A100-80GB"]
    assert find_gpu("H100").name == "H100-SXM" and find_gpu("a100").name == "A100-80GB"


def test_the_plan_of_a_running_server_never_says_it_does_not_fit() -> None:
    # The same deployment, with a cache too small for one --max-model-len request: the
    # offline plan says vLLM would refuse to start; a server that runs (GET
    # /kvgate/v1/plan) started, so its plan keeps its figures and its recommendation.
    served = ServedModel(read_architecture("Qwen/Qwen3-8B"),
                         Deployment(max_model_len=32768, num_gpu_blocks_override=1000),
                         find_gpu("H100"))
    answers = {}
    for running in (False, True):
        answers[running] = compute_plan(PlanInput(
            served=served, sequence_tokens=served.max_model_len, prompt_tokens=1024,
            output_tokens=256, concurrency=4, arrival_rate=None, ttft_slo_s=None,
            tpot_slo_s=None, kv_margin=0.9, chain=(), prefix_cache=True,
            server_running=running))
    offline, running_plan = answers[False], answers[True]
    assert offline["fits"] is False and "KV blocks" in offline["fit_problems"][0]
    assert offline["recommendation"]["max_num_seqs"] is None
    assert running_plan["fits"] is True and running_plan["fit_problems"] == []
    assert running_plan["recommendation"]["max_num_seqs"] >= 1
    assert running_plan["num_gpu_blocks"] == offline["num_gpu_blocks"] == 1000


def test_one_output_token_has_no_tpot_and_misses_no_tpot_target(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--output-tokens", "1",
            "--tpot-slo-ms", "0.001")
    result = plan_json(capsys, *args)
    rec = result["recommendation"]
    assert isinstance(rec, dict)
    assert result["tpot_s"] is None and result["tpot_p90_s"] is None
    assert rec["tpot_p90_s_at_max"] is None and rec["targets_met"] is True
    assert rec["limited_by"] != "tpot-slo"
    assert main(["plan", *args]) == 0
    report = capsys.readouterr().out
    assert "- (one output token)" in report and "needs a GPU" not in report


def test_with_data_parallel_engines_the_replicas_are_engines_and_servers_are_counted_apart(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--arrival-rate", "60"]
    alone = plan_json(capsys, *args[1:])
    rec = alone["recommendation"]
    assert isinstance(rec, dict)
    engines = rec["replicas"]
    assert isinstance(engines, int) and engines > 2
    # Engines of two per server: the servers are the engines halved, rounded up.
    assert main([*args, "--data-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"{engines} engines: {(engines + 1) // 2} server(s) of --data-parallel-size 2, "
            f"or {engines} pods of the chart" in out)
    assert out.startswith("Qwen/Qwen3-8B (qwen3) on H100-SXM x1 per engine, 2 engines "
                          "(data parallel), ")


def test_helm_values_without_a_gpu_say_the_rate_and_targets_were_not_used(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--arrival-rate", "5", "--ttft-slo-ms",
                 "500", "--print", "helm-values"]) == 0
    captured = capsys.readouterr()
    assert "replicaCount: 1" in captured.out
    assert "neither capacity nor latency is known" in captured.err
    assert "not sized for the arrival rate and targets given" in captured.err
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "H100", "--arrival-rate", "5",
                 "--print", "helm-values"]) == 0
    assert "not sized" not in capsys.readouterr().err
    # The report too, where the KV budget is known but nothing prices latency.
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--available-kv-gib", "10",
                 "--tpot-slo-ms", "20"]) == 0
    captured = capsys.readouterr()
    assert "replicas needed" not in captured.out
    assert "without a GPU latency is not known: replicas and --max-num-seqs are not sized" in (
        captured.err)
