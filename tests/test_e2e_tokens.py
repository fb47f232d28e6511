"""Prompt tokens counted locally equal the server's, and a mismatch falls back to it.

Against the session's real vLLM CPU server (tiny-llama): a corpus of chat and
completion requests (system prompts, tools and tool calls, multi-turn, content parts,
unicode, continue_final_message, template kwargs) tokenized by kvgate's local tokenizer
and by the server's /tokenize gives the same ids, for every tiny test model's tokenizer
files. Through kvgate, requests are counted locally after the first checks of their
shape; a tokenizer whose template differs from the server's is caught by those checks,
and the shape is counted by the server from then on.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sidecar.tokens import LocalTokenizer, reuse

from support.env import model_dir
from support.sidecar import Sidecar, metric_value
from support.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm]

TINY_MODELS = ("tiny-llama", "small-llama", "tiny-gemma2", "tiny-gemma3", "tiny-gptoss",
               "tiny-mistral", "tiny-mixtral", "tiny-qwen3", "tiny-qwen3moe")
SERVED = "tiny-llama"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"messages": [{"role": "system", "content": "You are terse. Answer in one line."},
                  {"role": "user", "content": "What is a KV cache?"}]},
    {"messages": [{"role": "system", "content": "Be helpful."},
                  {"role": "user", "content": "Name a prime."},
                  {"role": "assistant", "content": "Seven."},
                  {"role": "user", "content": "Another one, bigger?"}]},
    {"messages": [{"role": "user", "content": "Größe, naïve café, 東京, Ωμέγα, emoji 🚀🧪, "
                   "tabs\tand\nnewlines\n\n  spaced  "}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                               {"type": "text", "text": "second part"}]}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
        {"role": "user", "content": "And tomorrow?"}], "tools": TOOLS},
    {"messages": [{"role": "developer", "content": "Reply in French."},
                  {"role": "user", "content": "Good morning"}]},
    {"messages": [{"role": "user", "content": "Count to three"},
                  {"role": "assistant", "content": "One, two,"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "Think first"}],
     "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "No generation prompt"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "<|endoftext|> special text <|user|>"}]},
]
PROMPTS: list[dict[str, Any]] = [
    {"prompt": "The quick brown fox"},
    {"prompt": "   leading spaces and trailing   "},
    {"prompt": "unicode: ñ 中文 😀 \u00e9\u0301"},
    {"prompt": "a" * 3000},
    {"prompt": "<|endoftext|>inline special"},
    {"prompt": "without specials", "add_special_tokens": False},
]

# Long prompts that share prefixes (a system prompt, a document, an agent session's
# earlier turns): counted locally by joining a recent prompt's tokens with a window of
# the new text (`tokens/reuse.py`).
SYSTEM = ("You are the on-call assistant for a model-serving platform. Rules: answer in "
          "short lines; quote numbers exactly; never invent metrics; 東京 café naïve 🚀. "
          ) * 12
DOCUMENT = "".join(f"Section {n}: the KV cache held {n * 37} blocks at {n}:0{n % 10}Z; "
                   "preemptions followed.\n" for n in range(40))


def long_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for n, question in enumerate(["What failed?", "When exactly?", "Größe of the cache?",
                                  "And after that, 👀?", "Summarise  it\n\nbriefly."]):
        turns = [*turns, {"role": "user", "content": f"{question} {DOCUMENT[:400 * n]}"}]
        cases.append({"messages": turns})
        turns = [*turns, {"role": "assistant", "content": f"Answer {n}: " + "ok " * 20}]
    cases.append({"messages": turns[:3], "tools": TOOLS})
    for question in ("Which section?", " leading space", "\nnewline first", "x", "😀"):
        cases.append({"prompt": DOCUMENT + question})
        cases.append({"prompt": DOCUMENT[:-17] + question, "add_special_tokens": False})
    return cases


def server_ids(server: VllmServer, payload: dict[str, Any]) -> list[int]:
    body = json.dumps({"model": SERVED, **payload}).encode()
    request = urllib.request.Request(server.url + "/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        data = json.loads(response.read())
    assert data["count"] == len(data["tokens"])
    return list(data["tokens"])


def files_digest(name: str) -> str:
    folder = model_dir(name)
    digest = hashlib.sha256()
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        path = folder / file
        digest.update(path.read_bytes() if path.exists() else b"-")
    return digest.hexdigest()


def test_every_tiny_models_tokenizer_matches_the_server(small_kv_vllm: VllmServer,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    # Each distinct set of tokenizer files needs a server loaded with it: the tiny models
    # share one, which the session's server (tiny-llama) loads.
    digests = {name: files_digest(name) for name in TINY_MODELS}
    assert set(digests.values()) == {digests[SERVED]}, (
        "a tiny model has tokenizer files of its own: serve it to compare", digests)
    # Joined encodings are used unchecked here, so that the server's ids judge them.
    monkeypatch.setattr(reuse, "FIRST_CHECKS", 0)
    monkeypatch.setattr(reuse, "CHECK_EVERY", 10**9)
    payloads = CHATS + PROMPTS + long_cases()
    expected = [server_ids(small_kv_vllm, payload) for payload in payloads]
    assert all(expected), "the server tokenized nothing"
    for name in TINY_MODELS:
        local = LocalTokenizer.load(model_dir(name))
        for payload, ids in zip(payloads, expected, strict=True):
            assert list(local.tokenize(payload)) == ids, (name, payload)
        assert local.reuse.counts["spliced"] >= 12 and local.reuse.counts["checked"] == 0


def tokenize_calls(sidecar: Sidecar) -> dict[str, float]:
    text = sidecar.metrics_text()
    return {source: metric_value(text, "kvgate_prompt_tokens_counted_total",
                                 f'source="{source}"')
            for source in ("local", "server", "estimate")}


def checks(sidecar: Sidecar) -> dict[str, float]:
    text = sidecar.metrics_text()
    return {result: metric_value(text, "kvgate_tokenizer_checks_total", f'result="{result}"')
            for result in ("match", "mismatch", "failed")}


def complete(sidecar: Sidecar, path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(status, kvgate's prompt-token count from its header)."""
    request = urllib.request.Request(
        sidecar.url + path, data=json.dumps({"model": SERVED, **body}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        return response.status, int(response.headers["x-kvgate-prompt-tokens"])


def test_requests_are_counted_locally_after_the_first_checks(
        small_kv_vllm: VllmServer) -> None:
    chat = {"messages": CHATS[2]["messages"], "max_tokens": 2}
    expected = len(server_ids(small_kv_vllm, {"messages": chat["messages"],
                                              "add_generation_prompt": True}))
    with Sidecar(small_kv_vllm.url, "--tokenizer-check-every", "4") as sidecar:
        counts = [complete(sidecar, "/v1/chat/completions", chat)[1] for _ in range(12)]
        assert counts == [expected] * 12
        # 3 checks (server's answer used), then local; one in 4 of those checked later.
        calls = tokenize_calls(sidecar)
        assert calls["server"] == 3
        assert calls["local"] == 9
        sidecar_checks = checks(sidecar)
        assert sidecar_checks["mismatch"] == 0
        assert sidecar_checks["match"] >= 3 + 2  # the background ones may still run
        # Long prompts sharing a document: after the first, each is encoded from where
        # it differs, and its count is the server's.
        for question in ("Which section?", "When?", "Größe?", "x"):
            prompt = DOCUMENT[:1200] + question  # within the server's max_model_len
            body = {"prompt": prompt, "max_tokens": 2}
            served = len(server_ids(small_kv_vllm, {"prompt": prompt}))
            assert complete(sidecar, "/v1/completions", body)[1] == served
        spliced = metric_value(sidecar.metrics_text(), "kvgate_tokenizer_prefix_reuse_total",
                               'result="spliced"')
        assert spliced >= 3


def test_a_mismatching_tokenizer_falls_back_to_the_server(
        small_kv_vllm: VllmServer, tmp_path: Path) -> None:
    # The same tokenizer with another chat template than the server's.
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    source = model_dir(SERVED)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, folder / file)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
    chat = {"messages": CHATS[1]["messages"], "max_tokens": 2}
    served = len(server_ids(small_kv_vllm, {"messages": chat["messages"],
                                            "add_generation_prompt": True}))
    local = len(LocalTokenizer.load(folder).tokenize({"messages": chat["messages"]}))
    assert local != served  # the premise: the two templates count differently
    prompt = {"prompt": "completions render no template", "max_tokens": 2}
    with Sidecar(small_kv_vllm.url, "--tokenizer", str(folder)) as sidecar:
        counts = [complete(sidecar, "/v1/chat/completions", chat)[1] for _ in range(6)]
        # Every count is the server's: the first check caught the mismatch.
        assert counts == [served] * 6
        assert checks(sidecar)["mismatch"] == 1
        calls = tokenize_calls(sidecar)
        assert calls["local"] == 0 and calls["server"] == 6
        # Another shape whose ids agree is still counted locally after its checks.
        for _ in range(5):
            complete(sidecar, "/v1/completions", prompt)
        calls = tokenize_calls(sidecar)
        assert calls["local"] == 2 and calls["server"] == 9
        assert "the server counts that shape from now on" in sidecar.log_text()
