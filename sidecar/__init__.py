"""kvgate: KV-cache-aware admission control for vLLM."""

from __future__ import annotations

import sys

__version__ = "0.1.0"


def compiled_modules() -> list[str]:
    """kvgate's modules loaded as compiled code (a build with KVGATE_COMPILE=1, see
    setup.py); none in the pure Python package."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.startswith("sidecar.")
                  and str(getattr(module, "__file__", None) or "").endswith((".so", ".pyd")))
