"""Where `kvgate plan --model` finds a model's config.json, in vLLM's order.

1. a local file, or a directory holding `config.json`;
2. for a Hugging Face id (`org/name`), the local Hugging Face cache:
   `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`, laid out as
   `models--ORG--NAME/snapshots/<revision>/config.json` with `refs/main` naming the
   revision;
3. a bundled preset: the id itself, or the base model whose config an instruct, chat
   or quantized variant shares (`sidecar.model.presets`);
4. the Hugging Face Hub, when it can be reached: `config.json` only, through
   `huggingface_hub` (an optional dependency, imported here and only here), which
   honours `HF_TOKEN` and `HF_HUB_OFFLINE` and keeps the file in the cache above.

The model package stays pure: this module does the looking, the model package the
reading.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from sidecar.model import ConfigError, ModelArchitecture, load_config, parse_config, presets
from sidecar.model.hf_config import unknown_model_message

# `org/name` as the Hub spells repository ids (letters, digits, `-`, `_`, `.`).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_TRUE = {"1", "true", "yes", "on"}
INSTALL_HINT = "pip install 'kvgate[hub]'"
HUB_CONNECT_TIMEOUT_S = 5.0


class HubError(ConfigError):
    """The Hub was not asked, or did not give the config (the message says why)."""


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and ".." not in name and "--" not in name


def hub_cache_dir() -> Path:
    """The Hugging Face cache as `huggingface_hub` finds it."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cached_config(repo_id: str, cache: Path | None = None) -> Path | None:
    """The config.json of `repo_id` in the local Hugging Face cache: the revision
    `refs/main` names, else the newest snapshot holding one; None if absent."""
    root = cache if cache is not None else hub_cache_dir()
    folder = root / ("models--" + repo_id.replace("/", "--"))
    if not folder.is_dir():
        # Hub ids are case-insensitive; the cache keeps the spelling that fetched it.
        wanted = folder.name.lower()
        try:
            folder = next((entry for entry in root.iterdir()
                           if entry.name.lower() == wanted and entry.is_dir()), folder)
        except OSError:
            return None
    snapshots = folder / "snapshots"
    ref = folder / "refs" / "main"
    if ref.is_file():
        try:
            candidate = snapshots / ref.read_text(encoding="utf-8").strip() / "config.json"
        except OSError:
            candidate = None
        if candidate is not None and candidate.is_file():
            return candidate
    try:
        found = [entry / "config.json" for entry in snapshots.iterdir()
                 if (entry / "config.json").is_file()]
    except OSError:
        return None
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def fetch_config(repo_id: str) -> Path:
    """Download `repo_id`'s config.json from the Hub (into the Hugging Face cache);
    HubError with the reason when it cannot."""
    if hub_offline():
        raise HubError("the Hub was not asked: HF_HUB_OFFLINE is set")
    try:
        hub = importlib.import_module("huggingface_hub")
    except ImportError:
        raise HubError("the Hub was not asked: huggingface_hub is not installed "
                       f"({INSTALL_HINT})") from None
    unreachable = hub_unreachable()
    if unreachable is not None:
        raise HubError(unreachable)
    try:
        quiet = getattr(getattr(getattr(hub, "utils", None), "logging", None),
                        "set_verbosity_error", None)
        if quiet is not None:
            quiet()  # its retries and progress are not the user's business
        path = hub.hf_hub_download(repo_id, "config.json")
    except Exception as exc:  # the Hub's errors, and any network error under them
        raise HubError(_hub_failure(repo_id, exc)) from exc
    return Path(str(path))


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached, or None when it can be connected to.
    huggingface_hub retries an unreachable Hub for half a minute, printing each retry:
    find out first, in seconds, and say it in one line."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return (f"the Hugging Face Hub ({host}) could not be reached to fetch it "
                f"({exc.strerror or type(exc).__name__})")
    return None


def _hub_failure(repo_id: str, exc: Exception) -> str:
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if "GatedRepoError" in kinds:
        return (f"the Hub has {repo_id} behind a licence: accept it on the model's page "
                "and set HF_TOKEN")
    if "RepositoryNotFoundError" in kinds:
        return (f"the Hub has no model {repo_id} (or it is private: set HF_TOKEN)")
    if "EntryNotFoundError" in kinds or "RemoteEntryNotFoundError" in kinds:
        return f"the Hub's {repo_id} has no config.json"
    return (f"the Hugging Face Hub could not be reached to fetch it "
            f"({type(exc).__name__}: {first_line})")


def read_model(source: str, note: Callable[[str], None] = lambda _: None) -> ModelArchitecture:
    """The architecture of `--model`: a path, a Hub id (cache, preset, Hub) or a preset
    name. `note` receives one line when the config read is not the name's own."""
    path = Path(source).expanduser()
    local = path.exists()
    if not local and is_hub_id(source):
        cached = cached_config(source)
        if cached is not None:
            raw, _ = load_config(cached)
            return parse_config(raw, source)
    found = None if local else presets.match(source)
    if local or found is not None or not is_hub_id(source):
        raw, name = load_config(source)
        if found is not None and not found.exact:
            note(f"{source}: using the bundled config of {found.preset}, a model of the "
                 "same architecture and precision")
        return parse_config(raw, name)
    try:
        fetched = fetch_config(source)
    except HubError as exc:
        raise HubError(unknown_model_message(
            source, f", it is not in the Hugging Face cache ({hub_cache_dir()}), and {exc}"
        )) from None
    note(f"{source}: config.json from the Hugging Face Hub ({fetched})")
    raw, _ = load_config(fetched)
    return parse_config(raw, source)
