"""Bundled `config.json` files of popular models, addressable by name.

Files live in `presets/` as `<org>__<name>.json` (copies of the public Hugging Face
configs; each keeps a `_source` key saying where it came from). A preset is found by
its Hugging Face id (`Qwen/Qwen3-8B`), its bare name (`Qwen3-8B`) or the file stem,
case-insensitively.

Names as users type them also find the preset whose config they share: the instruct,
chat and `-it` variants of a base model (`meta-llama/Llama-3.1-70B-Instruct` is
`meta-llama/Meta-Llama-3.1-70B`), whatever the organisation that republished it. A
quantized variant keeps its quantization: `Qwen3-32B-FP8` finds the FP8 preset, never
the bf16 one, and a quantized name without a preset of the same quantization finds
nothing (its weights would be counted at the wrong precision).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

_PACKAGE = "sidecar.model"
_FOLDER = "presets"

# Name parts that mark a fine-tuned or repackaged variant with its base model's config.
_VARIANT_PARTS = frozenset({"instruct", "chat", "it", "hf", "base"})
# Name parts that mark a quantized checkpoint, and the quantization each one means
# (in order: `AWQ-INT4` is AWQ, `FP8-dynamic` is FP8).
_QUANT_KINDS = (
    ("awq", "awq"), ("gptq", "gptq"), ("nvfp4", "nvfp4"), ("fp4", "nvfp4"),
    ("mxfp4", "mxfp4"), ("fp8", "fp8"), ("w8a8", "int8"), ("int8", "int8"),
    ("w4a16", "int4"), ("int4", "int4"), ("bnb", "bitsandbytes"), ("4bit", "bitsandbytes"),
    ("8bit", "bitsandbytes"), ("gguf", "gguf"), ("exl2", "exl2"),
)
_QUANT_PARTS = frozenset({part for part, _ in _QUANT_KINDS} | {"dynamic", "static", "marlin"})
_SPLIT = re.compile(r"[-_\s]+")


@dataclass(frozen=True)
class Match:
    """A preset found for a name: `exact` when the name is the preset's own id, bare
    name or file stem; otherwise a variant sharing its config."""

    preset: str
    exact: bool


@dataclass(frozen=True)
class _Key:
    base: str            # the name without organisation, variant and quantization parts
    quantization: str | None


def _parts(name: str) -> list[str]:
    bare = name.strip().rstrip("/").rpartition("/")[2].lower()
    parts = [part for part in _SPLIT.split(bare) if part]
    # Meta-Llama-3.1-8B and Llama-3.1-8B are the same model.
    if len(parts) > 1 and parts[0] == "meta" and parts[1] == "llama":
        parts = parts[1:]
    return parts


def _key(name: str) -> _Key:
    parts = _parts(name)
    quantization = next((kind for tag, kind in _QUANT_KINDS if tag in parts), None)
    base = [part for part in parts if part not in _VARIANT_PARTS and part not in _QUANT_PARTS]
    return _Key("-".join(base), quantization)


@cache
def _index() -> dict[str, str]:
    """Lower-cased aliases -> preset file stem."""
    aliases: dict[str, str] = {}
    folder = resources.files(_PACKAGE).joinpath(_FOLDER)
    for entry in folder.iterdir():
        if not entry.name.endswith(".json"):
            continue
        stem = entry.name.removesuffix(".json")
        org, _, bare = stem.partition("__")
        for alias in (stem, f"{org}/{bare}", bare):
            aliases.setdefault(alias.lower(), stem)
    return aliases


@cache
def _keys() -> dict[str, _Key]:
    """Preset id -> its variant key."""
    return {preset: _key(preset) for preset in names()}


def names() -> list[str]:
    """Preset ids as `org/name`, sorted."""
    return sorted({stem.replace("__", "/", 1) for stem in _index().values()})


def match(name: str) -> Match | None:
    """The preset for a name: its own (exact), else the one whose config a variant of
    the same quantization shares; None when there is none."""
    stem = _index().get(name.strip().lower())
    if stem:
        return Match(stem.replace("__", "/", 1), exact=True)
    wanted = _key(name)
    if not wanted.base:
        return None
    found = [preset for preset, key in _keys().items() if key == wanted]
    if not found:
        return None
    # Several presets of one base (none today): prefer the same organisation.
    org = name.strip().partition("/")[0].lower() if "/" in name else ""
    found.sort(key=lambda preset: (preset.partition("/")[0].lower() != org, preset))
    return Match(found[0], exact=False)


def find(name: str) -> str | None:
    """The preset id for a name (exact or a variant sharing its config), or None."""
    found = match(name)
    return found.preset if found else None


def quantized_base(name: str) -> str | None:
    """For a quantized name without a preset of its quantization: the preset of the
    model it quantizes (which kvgate must not use for it), else None."""
    wanted = _key(name)
    if wanted.quantization is None or match(name) is not None:
        return None
    same_base = [preset for preset, key in _keys().items() if key.base == wanted.base]
    same_base.sort(key=lambda preset: _keys()[preset].quantization is not None)
    return same_base[0] if same_base else None


def quantization_of(name: str) -> str | None:
    """The quantization a model's name says it has (`fp8`, `awq`, ...), or None."""
    return _key(name).quantization


def suggestions(name: str, count: int = 3) -> list[str]:
    """The presets whose names are closest to `name`, best first."""
    wanted = _key(name).base or name.strip().lower()
    by_key: dict[str, list[str]] = {}
    for preset, key in _keys().items():
        by_key.setdefault(key.base, []).append(preset)
    close = difflib.get_close_matches(wanted, list(by_key), n=count, cutoff=0.6)
    found = [preset for base in close for preset in by_key[base]]
    return found[:count]


def load(preset_id: str) -> dict[str, Any]:
    stem = preset_id.replace("/", "__", 1)
    text = resources.files(_PACKAGE).joinpath(_FOLDER, f"{stem}.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data
