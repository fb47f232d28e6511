"""Keep a calibration across restarts in a file the sidecar can lose.

Written atomically (a temporary file renamed over the old one); a missing,
unreadable, corrupt or foreign file is ignored with a warning and the sidecar
relearns from the prior.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("kvgate.calibration")

FORMAT = 1


class CalibrationStore:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None

    def load(self, key: str) -> dict[str, Any] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("ignoring calibration file %s: %s", self.path, exc)
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
            log.info("calibration file %s is for another model or GPU; relearning", self.path)
            return None
        efficiency = data.get("efficiency")
        return data if isinstance(efficiency, dict) else None

    def save(self, data: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kvgate-calibration-")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump({"format": FORMAT, **data}, handle, indent=2)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot save calibration to %s: %s", self.path, exc)
