"""A saved calibration: the one reader (for `kvgate serve` and `kvgate plan --calibration`)
and the file the sidecar keeps across restarts.

`read_calibration(path)` checks what any use needs and raises `CalibrationFileError`
naming what is wrong: readable UTF-8 JSON, an object, a known `format` when it has one
(files written by `GET /kvgate/v1/calibration` have none), an `efficiency` object whose
values are valid (`Efficiency.from_mapping`), a string `key` when it has one.

`CalibrationStore` keeps the sidecar's own file: written atomically (a temporary file
renamed over the old one); on reading, a missing file, one that fails those checks or
one for another model, GPU or TP (its `key`) is ignored with a warning and the
sidecar relearns from the prior.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.model import Efficiency

log = logging.getLogger("kvgate.calibration")

FORMAT = 2
KNOWN_FORMATS = (1, 2)  # 1: efficiencies bounded by the device's peaks (same keys)


class CalibrationFileError(ValueError):
    """A calibration file that cannot be used; the message names the file and why."""


@dataclass(frozen=True)
class SavedCalibration:
    efficiency: Efficiency
    key: str | None  # model|device|tp it was fitted on
    data: dict[str, Any]

    @property
    def device(self) -> str | None:
        parts = self.key.split("|") if self.key else []
        return parts[1] if len(parts) == 3 else None


def parse_calibration(data: object, where: str,
                      base: Efficiency | None = None) -> SavedCalibration:
    if not isinstance(data, dict):
        raise CalibrationFileError(f"{where}: must be a JSON object")
    fmt = data.get("format")
    if fmt is not None and fmt not in KNOWN_FORMATS:
        raise CalibrationFileError(f"{where}: unknown format {fmt!r} (known: "
                                   f"{', '.join(map(str, KNOWN_FORMATS))})")
    key = data.get("key")
    if key is not None and not isinstance(key, str):
        raise CalibrationFileError(f"{where}: 'key' must be a string")
    section = data.get("efficiency")
    if not isinstance(section, dict):
        raise CalibrationFileError(f"{where}: no 'efficiency' object")
    if "kv_bandwidth_ratio" not in section:
        # Written before the KV share was a term: its memory rate was fitted with the KV
        # cache at the weights' bandwidth, and only with that share does it price right.
        section = {**section, "kv_bandwidth_ratio": 1.0}
    try:
        efficiency = Efficiency.from_mapping(section, base)
    except ValueError as exc:
        raise CalibrationFileError(f"{where}: {exc}") from exc
    return SavedCalibration(efficiency, key, data)


def read_calibration(path: str | Path, base: Efficiency | None = None) -> SavedCalibration:
    """The calibration saved at `path`; missing efficiency keys keep `base`'s."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CalibrationFileError(f"{path}: cannot read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise CalibrationFileError(f"{path}: not UTF-8 text") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationFileError(f"{path}: not valid JSON ({exc.msg})") from exc
    return parse_calibration(data, str(path), base)


class CalibrationStore:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None

    def load(self, key: str, base: Efficiency | None = None) -> SavedCalibration | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            saved = read_calibration(self.path, base)
        except CalibrationFileError as exc:
            log.warning("ignoring calibration file %s; relearning", exc)
            return None
        if saved.key != key:
            log.warning("ignoring calibration file %s: it is for %s, not %s; relearning",
                        self.path, saved.key, key)
            return None
        return saved

    def save(self, data: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kvgate-calibration-")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({**data, "format": FORMAT}, handle, indent=2)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot save calibration to %s: %s", self.path, exc)
