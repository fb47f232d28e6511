"""Render OpenAI chat messages with a model's Jinja chat template, as vLLM does.

vLLM (0.32) turns a chat request into a prompt in three steps, which this module
follows:
1. messages become a *conversation*: each message's content becomes either one string
   (the text parts joined by newlines) or a list of `{"type": "text", "text": ...}`
   parts, depending on whether the template loops over a message's content (the
   template's *content format*, "string" or "openai"); assistant tool calls get their
   JSON `arguments` parsed into objects; `developer` messages become `system` ones when
   the template does not know the role;
2. the template renders the conversation in transformers' sandboxed Jinja environment
   (`trim_blocks`, `lstrip_blocks`, `loopcontrols`, a `tojson` that does not escape
   HTML, `raise_exception`, `strftime_now`), with the tokenizer's named special tokens,
   `tools`, `add_generation_prompt` and the request's `chat_template_kwargs`;
3. the text is tokenized without adding special tokens (the template holds them).

Anything this module cannot render as vLLM would (images, audio, unknown part types, a
template error) raises `CannotRender`: the caller then asks the server instead.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]
# transformers marks the final message with this tag to cut the rendered text after it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class CannotRender(Exception):
    """The request holds something rendered only by the server (or the template failed)."""


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}` block: renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 reads it from the class)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---- the template's content format -------------------------------------------------


def _base(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """`x | filter`, `x is test` and `x[a:b]` read `x`."""
    while True:
        wraps = (isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test)
                 and node.node is not None)
        sliced = (isinstance(node, jinja2.nodes.Getitem)
                  and isinstance(node.arg, jinja2.nodes.Slice))
        if not (wraps or sliced):
            return node
        node = node.node  # type: ignore[attr-defined]


def _is_name(node: jinja2.nodes.Node, names: set[str]) -> bool:
    node = _base(node)
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _is_field(node: jinja2.nodes.Node, names: set[str], key: str) -> bool:
    """`name.key` or `name['key']` (through filters, tests and slices)."""
    node = _base(node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _is_name(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == key and _is_name(node.node, names)
    return False


def _aliases(root: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable `{% set %}` from it (`loop_messages = messages[1:]`)."""
    names = {name}
    changed = True
    while changed:
        changed = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (isinstance(target, jinja2.nodes.Name) and target.name not in names
                    and _is_name(assign.node, names)):
                names.add(target.name)
                changed = True
    return names


def _loop_targets(loops: Iterator[jinja2.nodes.For]) -> set[str]:
    return {loop.target.name for loop in loops if isinstance(loop.target, jinja2.nodes.Name)}


def content_format(source: str) -> ContentFormat:
    """"openai" when the template iterates over a message's content (it expects a list
    of parts), else "string" (vLLM's detection; "string" when it cannot parse)."""
    try:
        root = _environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = _aliases(root, "messages")
    loops = list(root.find_all(jinja2.nodes.For))
    message_vars = _loop_targets(loop for loop in loops if _is_name(loop.iter, messages))
    content_vars = {"content"}
    for loop in loops:
        if _is_field(loop.iter, message_vars, "content") or _is_name(loop.iter, content_vars):
            return "openai"
    # A macro given a message's content as an argument, which loops over the parameter.
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for index, arg in enumerate(call.args):
                    if index < len(params) and _is_field(arg, message_vars, "content"):
                        bound.add(params[index])
                for keyword in call.kwargs:
                    if keyword.key in params and _is_field(keyword.value, message_vars,
                                                           "content"):
                        bound.add(keyword.key)
        if bound and any(_is_name(loop.iter, bound) for loop in macro.find_all(jinja2.nodes.For)):
            return "openai"
    return "string"


# ---- messages to the conversation the template sees ---------------------------------


def _texts(content: object, where: str) -> list[str]:
    """The text parts of a message's content; anything else is the server's to render."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise CannotRender(f"{where}: content is neither text nor a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" \
                and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise CannotRender(f"{where}: a content part other than text")
    return texts


def _tool_arguments(message: dict[str, Any]) -> None:
    """Assistant tool calls: JSON `arguments` become objects (what templates expect)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return
    if not calls:
        message.pop("tool_calls")
        return
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise CannotRender("a tool call that is not a function")
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
            continue
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = {}
        function["arguments"] = arguments if isinstance(arguments, dict) else {}


def conversation(messages: Sequence[Mapping[str, Any]], fmt: ContentFormat,
                 *, knows_developer: bool = True) -> list[dict[str, Any]]:
    """The messages as the template receives them."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise CannotRender(f"messages[{index}]: no role")
        texts = _texts(message.get("content"), f"messages[{index}]")
        entry: dict[str, Any] = {"role": role}
        if fmt == "openai" and role != "tool":
            entry["content"] = [{"type": "text", "text": text} for text in texts]
        else:
            entry["content"] = "\n".join(texts)
        if role == "assistant":
            if message.get("tool_calls") is not None:
                entry["tool_calls"] = copy.deepcopy(list(message["tool_calls"]))
            reasoning = message.get("reasoning")
            if reasoning is not None:
                entry["reasoning"] = entry["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            entry["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                entry[key] = message[key]
        if role == "developer":
            entry["tools"] = message.get("tools")
        out.append(entry)
    for entry in out:
        if entry["role"] == "assistant":
            _tool_arguments(entry)
    if not knows_developer and any(entry["role"] == "developer" for entry in out):
        out = _developer_as_system(out)
    return out


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`developer` messages become `system` ones, merged into one first message when
    system messages are not only at the start."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            converted.append({**{k: v for k, v in message.items() if k != "tools"},
                              "role": "system"})
        else:
            converted.append(message)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    texts = []
    for i in systems:
        content = converted[i]["content"]
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            texts.append(content)
    merged = {"role": "system", "content": "\n\n".join(texts)}
    return [merged] + [m for m in converted if m["role"] != "system"]


def tool_schemas(tools: object) -> list[dict[str, Any]] | None:
    """OpenAI `tools` as vLLM hands them to the template (its request model's dump)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise CannotRender("'tools' is not a list")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise CannotRender("a tool without a function name")
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for optional in ("strict", "defer_loading"):
            if function.get(optional) is not None:
                dumped[optional] = function[optional]
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


# ---- the template ------------------------------------------------------------------


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise CannotRender(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.format: ContentFormat = content_format(source)
        self.knows_developer = '"developer"' in source or "'developer'" in source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        special_tokens: Mapping[str, str],
        tools: object = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        chat = conversation(messages, self.format, knows_developer=self.knows_developer)
        kwargs: dict[str, Any] = {**special_tokens, **(template_kwargs or {})}
        for reserved in ("messages", "tools", "add_generation_prompt", "documents"):
            kwargs.pop(reserved, None)
        documents = (template_kwargs or {}).get("documents")
        final: str | None = None
        if continue_final_message:
            final = self._mark_final(chat)
        try:
            text = self._template.render(
                messages=chat, tools=tool_schemas(tools), documents=documents,
                add_generation_prompt=add_generation_prompt, **kwargs)
        except CannotRender:
            raise
        except Exception as exc:  # a template error or a sandbox refusal
            raise CannotRender(f"the chat template failed: {exc.__class__.__name__}") from exc
        if final is not None:
            text = self._cut_after_final(text, final)
        return text

    def _mark_final(self, chat: list[dict[str, Any]]) -> str:
        if "content" not in self.source:
            raise CannotRender("continue_final_message with a template without content")
        last = chat[-1]
        content = last["content"]
        if isinstance(content, list):
            for part in reversed(content):
                if "text" in part:
                    final = str(part["text"])
                    part["text"] = final + _CONTINUE_TAG
                    return final
            raise CannotRender("continue_final_message without text to continue")
        final = str(content)
        last["content"] = final + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_after_final(text: str, final: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise CannotRender("the template drops part of the final message")
        at = text.rindex(tag)
        if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()
