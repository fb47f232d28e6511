"""Bundled `config.json` files of popular models, addressable by name.

Files live in `presets/` as `<org>__<name>.json` (copies of the public Hugging Face
configs; each keeps a `_source` key saying where it came from). A preset is found by
its Hugging Face id (`Qwen/Qwen3-8B`), its bare name (`Qwen3-8B`) or the file stem,
case-insensitively.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

_PACKAGE = "sidecar.model"
_FOLDER = "presets"


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


def names() -> list[str]:
    """Preset ids as `org/name`, sorted."""
    return sorted({stem.replace("__", "/", 1) for stem in _index().values()})


def find(name: str) -> str | None:
    """The preset id for a name, or None."""
    stem = _index().get(name.strip().lower())
    return stem.replace("__", "/", 1) if stem else None


def load(preset_id: str) -> dict[str, Any]:
    stem = preset_id.replace("/", "__", 1)
    text = resources.files(_PACKAGE).joinpath(_FOLDER, f"{stem}.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data
