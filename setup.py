"""kvgate's build: pure Python by default; with KVGATE_COMPILE=1, the modules every
proxied request runs through are compiled with mypyc (the same code, as C extensions).

    pip install .                                                  # pure Python
    KVGATE_COMPILE=1 pip install --no-build-isolation .            # compiled
    KVGATE_COMPILE=1 python setup.py build_ext --inplace           # compiled, in place

Compiling needs mypy (its mypyc), setuptools >= 77 and a C compiler in the build
environment; nothing more at run time. The metadata is in pyproject.toml.
"""

from __future__ import annotations

import os

from setuptools import setup

# The admission core and the request path's pure parts. Left out: the modules that
# hold event-loop transports (uvloop's are not `asyncio.Transport`s, which compiled
# code checks), subclass builtin exceptions mypyc cannot, run once (start-up, CLI), or
# cost little per request (the queue, whose methods the property tests wrap).
COMPILED = [
    "sidecar/admission/blockage.py",
    "sidecar/admission/controller.py",
    "sidecar/admission/cost.py",
    "sidecar/admission/finished.py",
    "sidecar/admission/forecast.py",
    "sidecar/admission/ledger.py",
    "sidecar/admission/load.py",
    "sidecar/admission/outcomes.py",
    "sidecar/admission/output_policy.py",
    "sidecar/admission/prefix.py",
    "sidecar/admission/recent_keys.py",
    "sidecar/admission/room.py",
    "sidecar/admission/running.py",
    "sidecar/admission/server_queue.py",
    "sidecar/admission/sharing.py",
    "sidecar/admission/wait_ratio.py",
    "sidecar/metrics.py",
    "sidecar/model/latency.py",
    "sidecar/server/client_headers.py",
    "sidecar/server/prefix_keys.py",
    "sidecar/server/prompt_tokens.py",
    "sidecar/server/proxy.py",
    "sidecar/server/requests.py",
    "sidecar/server/services.py",
    "sidecar/server/token_stream.py",
    "sidecar/tokens/reuse.py",
]


def ext_modules() -> list[object]:
    if os.environ.get("KVGATE_COMPILE", "") != "1":
        return []
    from mypyc.build import mypycify  # noqa: PLC0415  (only a compiled build needs mypy)

    return list(mypycify(COMPILED, opt_level="3"))


setup(ext_modules=ext_modules())
