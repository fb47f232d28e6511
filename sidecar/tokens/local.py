"""Count prompt tokens with the served model's own tokenizer and chat template.

The files are the ones the server loads from its model directory: `tokenizer.json`
(Hugging Face `tokenizers`), `tokenizer_config.json` (named special tokens, the chat
template) and `chat_template.jinja` (the template, when it is its own file; it wins
over the config's). Completions prompts are tokenized with the tokenizer's special
tokens (vLLM's default for /v1/completions), chat prompts without them (the template
holds them).

`LocalTokenizer.tokenize` is synchronous and pure once loaded; the server calls it off
the event loop for large prompts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from sidecar.tokens.chat_template import CannotRender, ChatTemplate
from sidecar.tokens.reuse import PrefixReuse

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


class TokenizerFilesError(Exception):
    """The tokenizer files are missing or unusable (the message says which and why)."""


@dataclass(frozen=True)
class TokenizerFiles:
    directory: Path
    tokenizer_json: Path
    config: Mapping[str, Any]
    chat_template: str | None
    named_templates: Mapping[str, str]


def _special(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def find_files(directory: str | Path) -> TokenizerFiles:
    """Read what the tokenizer needs from a model directory."""
    root = Path(directory).expanduser()
    if root.is_file():
        root = root.parent
    tokenizer_json = root / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerFilesError(f"{root}: no tokenizer.json")
    config: dict[str, Any] = {}
    config_path = root / "tokenizer_config.json"
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerFilesError(f"{config_path}: unreadable ({exc})") from exc
        if isinstance(loaded, dict):
            config = loaded
    for extra in ("special_tokens_map.json",):
        path = root / extra
        if path.is_file():
            try:
                more = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                more = None
            if isinstance(more, dict):
                config = {**more, **config}
    template: str | None = None
    named: dict[str, str] = {}
    raw_template = config.get("chat_template")
    if isinstance(raw_template, str):
        template = raw_template
    elif isinstance(raw_template, list):
        for entry in raw_template:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str) \
                    and isinstance(entry.get("template"), str):
                named[entry["name"]] = entry["template"]
        template = named.get("default")
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizerFilesError(f"{jinja_file}: unreadable ({exc})") from exc
    return TokenizerFiles(root, tokenizer_json, config, template, named)


class LocalTokenizer:
    """A model's tokenizer and chat template, loaded once."""

    def __init__(self, files: TokenizerFiles) -> None:
        try:
            self._tokenizer = Tokenizer.from_file(str(files.tokenizer_json))
        except Exception as exc:  # the Rust library raises its own exception type
            raise TokenizerFilesError(f"{files.tokenizer_json}: not usable ({exc})") from exc
        self._encode_fast: Callable[..., list[Encoding]] | None = getattr(
            self._tokenizer, "encode_batch_fast", None)
        self.files = files
        self.special_tokens = {
            name: token for name in NAMED_SPECIAL_TOKENS
            if (token := _special(files.config.get(name))) is not None
        }
        self._templates: dict[str, ChatTemplate] = {}
        # Long prompts that extend a recent one are encoded from near where they differ.
        self.reuse = PrefixReuse(self._encode_whole, self._encode_with_offsets)

    @classmethod
    def load(cls, directory: str | Path) -> LocalTokenizer:
        return cls(find_files(directory))

    def template(self, tools: object, override: object) -> ChatTemplate:
        """The template vLLM would pick: the request's own, else the model's ("tool_use"
        when the request has tools and the model names one)."""
        if override is not None:
            if not isinstance(override, str) or override not in self.files.named_templates:
                # A request's own template is the server's to accept (vLLM refuses it
                # without --trust-request-chat-template) and to render: kvgate does not
                # run a client's Jinja.
                raise CannotRender("a request's own chat template")
            source = self.files.named_templates[override]
        elif tools is not None and "tool_use" in self.files.named_templates:
            source = self.files.named_templates["tool_use"]
        elif self.files.chat_template is not None:
            source = self.files.chat_template
        else:
            raise CannotRender("the model has no chat template")
        template = self._templates.get(source)
        if template is None:
            if len(self._templates) >= 16:
                self._templates.clear()
            template = self._templates[source] = ChatTemplate(source)
        return template

    def encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, ...]:
        """The text's token ids; `CannotRender` for text that is not Unicode (an unpaired
        surrogate, which JSON's "\\ud800" escape gives and `tokenizers` refuses): only
        the server can say what it makes of that."""
        try:
            return self.reuse.encode(text, add_special_tokens)
        except TypeError as exc:
            if _unicode(text):
                raise
            raise CannotRender("the text has an unpaired surrogate") from exc

    def _encode_whole(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        # The same ids without the character offsets kvgate never reads (~30% less CPU
        # on an 800-token prompt; tokenizers >= 0.20, else the plain encode).
        fast = self._encode_fast
        if fast is not None:
            return tuple(fast([text], add_special_tokens=add_special_tokens)[0].ids)
        return tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _encode_with_offsets(self, text: str, add_special_tokens: bool) -> tuple[
            tuple[int, ...], list[tuple[int, int]]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return tuple(encoding.ids), encoding.offsets

    def tokenize(self, payload: Mapping[str, Any]) -> tuple[int, ...]:
        """The token ids the server's /tokenize gives for the same payload (a prompt or
        chat messages); `CannotRender` when only the server can say."""
        if "prompt" in payload:
            prompt = payload["prompt"]
            if not isinstance(prompt, str):
                raise CannotRender("the prompt is not text")
            return self.encode(prompt, add_special_tokens=bool(
                payload.get("add_special_tokens", True)))
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise CannotRender("neither a prompt nor messages")
        tools = payload.get("tools")
        kwargs = payload.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise CannotRender("'chat_template_kwargs' is not an object")
        if kwargs and ({"chat_template", "tokenize"} & kwargs.keys()):
            raise CannotRender("reserved chat_template_kwargs")
        continue_final = bool(payload.get("continue_final_message", False))
        add_generation = bool(payload.get("add_generation_prompt", True))
        template = self.template(tools, payload.get("chat_template"))
        text = template.render(
            messages, special_tokens=self.special_tokens, tools=tools,
            add_generation_prompt=add_generation, continue_final_message=continue_final,
            template_kwargs=kwargs)
        return self.encode(text, add_special_tokens=bool(
            payload.get("add_special_tokens", False)))


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
