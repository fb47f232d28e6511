"""Model ids as users type them: the local Hugging Face cache, presets matched by
variant (instruct, chat, quantized), the Hub (faked: it cannot be reached here) and
"did you mean" for unknown names."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from sidecar.cli import model_source
from sidecar.cli.main import main
from sidecar.cli.model_source import cached_config, hub_cache_dir, read_model
from sidecar.model import ConfigError, presets, read_architecture

REVISION = "0123456789abcdef0123456789abcdef01234567"
OLD_REVISION = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(autouse=True)
def isolated_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache of our own, no token, and no real huggingface_hub."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for variable in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    return cache


def small_config(layers: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
        "intermediate_size": 4096, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }


def put_in_cache(cache: Path, repo_id: str, revision: str, config: dict[str, object],
                 *, main_ref: bool = True) -> Path:
    """Lay out a model as huggingface_hub does: a blob, a snapshot linking to it, and
    refs/main naming the snapshot."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    blob = folder / "blobs" / f"blob-{revision}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_text(json.dumps(config))
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(Path("..") / ".." / "blobs" / blob.name)
    if main_ref:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(revision)
    return snapshot / "config.json"


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["plan", *args, "--json"]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def plan_error(*args: str, env: dict[str, str] | None = None) -> str:
    """Run `kvgate plan` as a user does; it must fail with one line and exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "sidecar", "plan", *args],
                          capture_output=True, text=True, timeout=60, check=False, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# ---- presets: variants share their base model's config -----------------------------

@pytest.mark.parametrize(
    ("typed", "preset"),
    [
        ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Meta-Llama-3.1-70B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B"),
        ("LLAMA-3.1-405B-INSTRUCT", "meta-llama/Meta-Llama-3.1-405B"),
        ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.3"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-v0.1"),
        ("google/gemma-2-9b-it", "google/gemma-2-9b"),
        ("Qwen/Qwen2-7B", "Qwen/Qwen2-7B-Instruct"),
        # Quantized variants find the preset of their own quantization, from any org.
        ("RedHatAI/Qwen3-32B-FP8-dynamic", "Qwen/Qwen3-32B-FP8"),
        ("Qwen/Qwen3-30B-A3B-Instruct-FP8", "Qwen/Qwen3-30B-A3B-FP8"),
    ],
)
def test_variants_find_their_base_preset(typed: str, preset: str) -> None:
    found = presets.match(typed)
    assert found is not None and found.preset == preset and not found.exact


def test_exact_names_stay_exact() -> None:
    for name in ("Qwen/Qwen3-32B", "qwen3-32b", "Qwen__Qwen3-32B-FP8", "google/gemma-3-1b-it"):
        found = presets.match(name)
        assert found is not None and found.exact


def test_a_quantized_variant_keeps_its_quantization() -> None:
    bf16 = read_architecture("Qwen/Qwen3-32B")
    fp8 = read_architecture("RedHatAI/Qwen3-32B-FP8-dynamic")
    assert bf16.quantization is None
    assert fp8.quantization is not None and fp8.quantization["quant_method"] == "fp8"
    # Never the other way round: an unquantized name does not get FP8 or NVFP4 weights.
    assert presets.find("Qwen/Qwen3-32B-Instruct") == "Qwen/Qwen3-32B"
    assert presets.match("google/gemma-4-31B-it") is None
    # A quantization without a preset of its own finds nothing, and says why.
    assert presets.match("Qwen/Qwen3-32B-AWQ") is None
    assert presets.match("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4") is None
    with pytest.raises(ConfigError, match=r"Qwen/Qwen3-32B quantized with awq.*wrong precision"):
        read_architecture("Qwen3-32B-AWQ")


def test_plan_accepts_the_id_users_type(capsys: pytest.CaptureFixture[str]) -> None:
    typed = plan_json(capsys, "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "H100",
                      "--tp", "4")
    base = plan_json(capsys, "--model", "meta-llama/Meta-Llama-3.1-70B", "--gpu", "H100",
                     "--tp", "4")
    for key in ("params_total", "weights_bytes", "kv_bytes_per_token", "kv_capacity_tokens"):
        assert typed[key] == base[key]


def test_plan_says_which_preset_a_variant_uses() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar", "plan", "--model",
                           "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "H100", "--tp", "4",
                           "--json"], capture_output=True, text=True, timeout=60, check=True)
    json.loads(proc.stdout)  # stdout stays one JSON object
    assert "using the bundled config of meta-llama/Meta-Llama-3.1-70B" in proc.stderr


def test_unknown_names_get_did_you_mean() -> None:
    line = plan_error("--model", "llama-3.3-70b-instruct", "--gpu", "H100")
    assert "did you mean meta-llama/Meta-Llama-3.1-70B" in line
    line = plan_error("--model", "Qwen/Qwen3-9B", "--gpu", "H100")
    assert "did you mean" in line and "Qwen/Qwen3-8B" in line
    line = plan_error("--model", "Qwen/Qwen3-32B-AWQ", "--gpu", "H100")
    assert "quantized with awq" in line and "did you mean" not in line


# ---- the local Hugging Face cache ---------------------------------------------------

def test_cache_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"


def test_a_model_in_the_cache_is_read_from_refs_main(isolated_hub: Path) -> None:
    current = put_in_cache(isolated_hub, "acme/Tiny-7B-Instruct", REVISION, small_config(6))
    # A newer snapshot that refs/main does not name (a download of another revision).
    other = put_in_cache(isolated_hub, "acme/Tiny-7B-Instruct", OLD_REVISION, small_config(4),
                         main_ref=False)
    os.utime(other.resolve(), (current.stat().st_mtime + 60,) * 2)
    assert cached_config("acme/Tiny-7B-Instruct") == current
    assert cached_config("ACME/tiny-7b-instruct") == current  # Hub ids ignore case
    arch = read_model("acme/Tiny-7B-Instruct")
    assert arch.name == "acme/Tiny-7B-Instruct" and arch.num_layers == 6
    assert cached_config("acme/Other") is None


def test_the_cache_comes_before_presets(isolated_hub: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    # As vLLM does: the config the user's cache holds is the one served.
    put_in_cache(isolated_hub, "Qwen/Qwen3-8B", REVISION, small_config(3))
    result = plan_json(capsys, "--model", "Qwen/Qwen3-8B")
    assert result["model"] == "Qwen/Qwen3-8B"
    assert result["kv_bytes_per_token"] == 3 * 2 * 4 * 64 * 2  # 3 layers, K+V, 4 heads x 64


def test_plan_reads_the_cache_in_a_fresh_process(isolated_hub: Path) -> None:
    put_in_cache(isolated_hub, "acme/Tiny-7B-Instruct", REVISION, small_config(6))
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": str(isolated_hub), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "sidecar", "plan", "--model",
                           "acme/Tiny-7B-Instruct", "--json"], capture_output=True, text=True,
                          timeout=60, check=True, env=env)
    assert json.loads(proc.stdout)["kv_bytes_per_token"] == 6 * 2 * 4 * 64 * 2
    line = plan_error("--model", "acme/Missing-1B", env=env)
    assert f"not in the Hugging Face cache ({isolated_hub})" in line
    assert "HF_HUB_OFFLINE is set" in line


# ---- the Hub (a fake huggingface_hub: the real Hub cannot be reached here) ---------

def fake_hub(monkeypatch: pytest.MonkeyPatch, download: object) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []

    def hf_hub_download(repo_id: str, filename: str) -> str:
        calls.append((repo_id, filename))
        assert callable(download)
        return str(download(repo_id, filename))

    module = types.ModuleType("huggingface_hub")
    module.hf_hub_download = hf_hub_download  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)
    # No network here: the connection check passes as if the Hub answered.
    monkeypatch.setattr(model_source, "hub_unreachable", lambda: None)
    return calls


def test_the_hub_is_asked_for_config_json_only(monkeypatch: pytest.MonkeyPatch,
                                               isolated_hub: Path) -> None:
    def download(repo_id: str, filename: str) -> Path:
        return put_in_cache(isolated_hub, repo_id, REVISION, small_config(5))

    calls = fake_hub(monkeypatch, download)
    notes: list[str] = []
    arch = read_model("acme/Remote-3B", notes.append)
    assert calls == [("acme/Remote-3B", "config.json")]
    assert arch.name == "acme/Remote-3B" and arch.num_layers == 5
    assert notes and "Hugging Face Hub" in notes[0]
    # Presets and the cache answer without the Hub.
    read_model("meta-llama/Llama-3.1-8B-Instruct")
    read_model("acme/Remote-3B")
    assert len(calls) == 1


def test_the_hub_is_not_asked_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_hub(monkeypatch, lambda repo, name: pytest.fail("asked the Hub offline"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        read_model("acme/Remote-3B")
    assert calls == []


class RepositoryNotFoundError(Exception):
    pass


class GatedRepoError(RepositoryNotFoundError):
    pass


class LocalEntryNotFoundError(ConnectionError):
    pass


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (LocalEntryNotFoundError("Connection refused"), "Hub could not be reached"),
        (GatedRepoError("401"), "accept it on the model's page and set HF_TOKEN"),
        (RepositoryNotFoundError("404"), "the Hub has no model acme/Remote-3B"),
    ],
)
def test_a_hub_failure_says_so(monkeypatch: pytest.MonkeyPatch, error: Exception,
                               message: str) -> None:
    def download(repo_id: str, filename: str) -> Path:
        raise error

    fake_hub(monkeypatch, download)
    with pytest.raises(ConfigError) as caught:
        read_model("acme/Remote-3B")
    text = str(caught.value)
    assert message in text and "not in the Hugging Face cache" in text
    assert "\n" not in text


def test_an_unreachable_hub_fails_fast_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                   isolated_hub: Path) -> None:
    # The real huggingface_hub retries for half a minute; kvgate checks the connection
    # first (here: a port on loopback nothing listens on).
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.ModuleType("huggingface_hub"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        read_model("acme/Remote-3B")
    assert time.monotonic() - started < 5
    assert "could not be reached" in str(caught.value) and "\n" not in str(caught.value)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_without_huggingface_hub_the_message_says_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"huggingface_hub is not installed.*kvgate\[hub\]"):
        read_model("acme/Remote-3B")
