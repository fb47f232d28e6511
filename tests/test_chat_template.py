"""kvgate's chat rendering and the policy that checks local token counts.

Rendering: templates written for these tests (`tests/data/chat_templates`) exercise what
real ones use; kvgate's output is compared with transformers' own renderer, and each
template's content format with vLLM's own detection, both run in vLLM's environment
(`support/chat_oracle.py`). The message conversion follows vLLM 0.32's
(`vllm/renderers/chat_utils.py`): asserted here case by case.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sidecar.tokens import CannotRender, ChatTemplate, Plan, Verification, shape_of
from sidecar.tokens.chat_template import conversation, tool_schemas

from support.env import vllm_python

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
ORACLE = Path(__file__).parent / "support" / "chat_oracle.py"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find a word",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "no_params"}}]

MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "  hi  "}],
    [{"role": "system", "content": "rules"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2 ✓ 中文"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "find 'x'"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function",
          "function": {"name": "lookup", "arguments": "{\"word\": \"x\"}"}},
         {"id": "c2", "type": "function", "function": {"name": "no_params", "arguments": ""}}]},
     {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "found"}]}],
    [{"role": "developer", "content": "be short"}, {"role": "user", "content": "hello"}],
]


def cases() -> list[dict[str, Any]]:
    out = []
    for name in sorted(p.name for p in TEMPLATES.glob("*.jinja")):
        for index, messages in enumerate(MESSAGES):
            for tools in (None, TOOLS):
                out.append({"template": name, "messages": messages, "tools": tools,
                            "add_generation_prompt": index % 2 == 0,
                            "kwargs": {"enable_thinking": False} if index == 1 else {}})
        out.append({"template": name, "messages": MESSAGES[1][:3], "tools": None,
                    "add_generation_prompt": False, "continue_final_message": True,
                    "kwargs": {}})
    return out


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    templates = {p.name: p.read_text() for p in TEMPLATES.glob("*.jinja")}
    request_cases = []
    for case in cases():
        template = ChatTemplate(templates[case["template"]])
        try:
            chat = conversation(case["messages"], template.format,
                                knows_developer=template.knows_developer)
        except CannotRender:
            chat = []
        request_cases.append({
            "template": case["template"], "conversation": chat,
            "tools": tool_schemas(case["tools"]),
            "add_generation_prompt": case["add_generation_prompt"],
            "continue_final_message": case.get("continue_final_message", False),
            "kwargs": {**SPECIAL, **case["kwargs"]}})
    answer = subprocess.run(
        [vllm_python(), str(ORACLE)], input=json.dumps(
            {"templates": templates, "cases": request_cases}),
        capture_output=True, text=True, timeout=300, check=True)
    result: dict[str, Any] = json.loads(answer.stdout)
    return result


def test_content_format_is_vllms(oracle: dict[str, Any]) -> None:
    mine = {p.name: ChatTemplate(p.read_text()).format for p in TEMPLATES.glob("*.jinja")}
    assert mine == oracle["formats"]
    assert set(mine.values()) == {"string", "openai"}  # both kinds are exercised


def test_rendering_is_transformers(oracle: dict[str, Any]) -> None:
    compared = 0
    for case, expected in zip(cases(), oracle["rendered"], strict=True):
        template = ChatTemplate((TEMPLATES / case["template"]).read_text())
        if isinstance(expected, dict):  # the template refuses it: so does kvgate
            with pytest.raises(CannotRender):
                template.render(case["messages"], special_tokens=SPECIAL, tools=case["tools"],
                                add_generation_prompt=case["add_generation_prompt"],
                                continue_final_message=case.get("continue_final_message",
                                                                False),
                                template_kwargs=case["kwargs"])
            continue
        rendered = template.render(
            case["messages"], special_tokens=SPECIAL, tools=case["tools"],
            add_generation_prompt=case["add_generation_prompt"],
            continue_final_message=case.get("continue_final_message", False),
            template_kwargs=case["kwargs"])
        assert rendered == expected, case
        compared += 1
    assert compared >= len(cases()) * 3 // 4


# ---- the conversion vLLM applies before rendering -----------------------------------


def test_string_format_joins_text_parts_with_newlines() -> None:
    chat = conversation(MESSAGES[2], "string")
    assert chat == [{"role": "user", "content": "part one\npart two"}]


def test_openai_format_wraps_text_and_keeps_tool_results_as_text() -> None:
    chat = conversation(MESSAGES[3], "openai")
    assert chat[0]["content"] == [{"type": "text", "text": "find 'x'"}]
    assert chat[1]["content"] == []
    assert chat[2] == {"role": "tool", "content": "found", "tool_call_id": "c1"}


def test_tool_call_arguments_become_objects() -> None:
    chat = conversation(MESSAGES[3], "string")
    calls = chat[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"word": "x"}
    assert calls[1]["function"]["arguments"] == {}
    assert MESSAGES[3][1]["tool_calls"][0]["function"]["arguments"] == "{\"word\": \"x\"}"


def test_developer_becomes_system_when_the_template_does_not_know_it() -> None:
    kept = conversation(MESSAGES[4], "string", knows_developer=True)
    assert kept[0]["role"] == "developer"
    converted = conversation(MESSAGES[4], "string", knows_developer=False)
    assert [m["role"] for m in converted] == ["system", "user"]
    late = [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}]
    merged = conversation(late, "string", knows_developer=False)
    assert merged == [{"role": "system", "content": "b"}, {"role": "user", "content": "a"}]


def test_tools_are_dumped_as_vllm_does() -> None:
    dumped = tool_schemas(TOOLS)
    assert dumped is not None
    assert dumped[1] == {"type": "function", "function": {
        "name": "no_params", "description": None, "parameters": None}}


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "data:,"}}],
    [{"type": "input_audio", "input_audio": {}}],
    7,
])
def test_what_only_the_server_renders_is_refused(content: object) -> None:
    with pytest.raises(CannotRender):
        conversation([{"role": "user", "content": content}], "string")


def test_a_template_error_is_refused_not_raised() -> None:
    template = ChatTemplate((TEMPLATES / "tools_json.jinja").read_text())
    with pytest.raises(CannotRender):
        template.render([{"role": "critic", "content": "x"}], special_tokens=SPECIAL)


# ---- the check policy ---------------------------------------------------------------


def test_first_requests_of_a_shape_are_checked_then_sampled() -> None:
    policy = Verification(first_checks=2, every=3)
    shape = shape_of({"messages": [{"role": "user", "content": "a"}]})
    assert [policy.plan(shape) for _ in range(2)] == [Plan.CHECK_NOW] * 2
    policy.record(shape, True)
    policy.record(shape, True)
    plans = [policy.plan(shape) for _ in range(6)]
    assert plans == [Plan.LOCAL, Plan.LOCAL, Plan.CHECK_LATER] * 2


def test_checks_waiting_for_the_server_count_toward_the_first_ones() -> None:
    policy = Verification(first_checks=2, every=0)
    shape = shape_of({"prompt": "a"})
    assert [policy.plan(shape) for _ in range(4)] == [Plan.CHECK_NOW] * 2 + [Plan.LOCAL] * 2
    policy.settle(shape)  # one check ended without an answer: its place is free again
    assert policy.plan(shape) is Plan.CHECK_NOW
    for _ in range(2):
        policy.record(shape, True)
        policy.settle(shape)
    policy.settle(shape)  # more settles than plans change nothing
    assert policy.plan(shape) is Plan.LOCAL


def test_one_mismatch_sends_the_shape_to_the_server_for_good() -> None:
    policy = Verification(first_checks=1, every=0)
    chat = shape_of({"messages": [{"role": "user", "content": "a"}], "tools": []})
    prompt = shape_of({"prompt": "a"})
    policy.plan(chat)
    policy.record(chat, False)
    assert all(policy.plan(chat) is Plan.SERVER for _ in range(5))
    policy.plan(prompt)
    policy.record(prompt, True)
    assert policy.plan(prompt) is Plan.LOCAL
    assert (policy.matches, policy.mismatches) == (1, 1)


def test_shapes_depend_on_rendering_not_on_text() -> None:
    def chat(text: str, **extra: Any) -> str:
        return shape_of({"messages": [{"role": "system", "content": "s"},
                                      {"role": "user", "content": text}], **extra})

    assert chat("one") == chat("two, longer")
    assert chat("one") != chat("one", tools=[])
    assert chat("one") != chat("one", chat_template_kwargs={"enable_thinking": True})
    assert chat("one") != chat("one", add_generation_prompt=False)
    assert shape_of({"prompt": "a"}) != shape_of({"prompt": "a", "add_special_tokens": False})


def test_a_requests_own_template_is_left_to_the_server() -> None:
    from sidecar.tokens import LocalTokenizer

    from support.env import model_dir

    tokenizer = LocalTokenizer.load(model_dir("tiny-llama"))
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    with pytest.raises(CannotRender, match="own chat template"):
        tokenizer.tokenize({"messages": [{"role": "user", "content": "hi"}],
                            "chat_template": loop})
