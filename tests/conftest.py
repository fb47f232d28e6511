"""Shared fixtures. Session-scoped servers (vLLM, Prometheus) live in tests/support."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"

# tests/support and bench are plain folders of helpers, importable from tests.
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
