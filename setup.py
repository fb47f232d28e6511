"""kvgate's build: pure Python by default; with KVGATE_COMPILE=1, the modules every
proxied request runs through are compiled with mypyc (the same code, as C extensions).

    pip install .                                                  # pure Python
    pip install '.[compile]' && KVGATE_COMPILE=1 pip install --no-build-isolation .
    KVGATE_COMPILE=1 python setup.py build_ext --inplace           # compiled, in place

Compiling needs, in the build environment, what the `compile` extra installs (mypy,
whose mypyc type-checks the package first, so kvgate's dependencies and stubs too;
setuptools >= 77) and a C compiler; nothing more at run time. The metadata is in
pyproject.toml.
"""

from __future__ import annotations

import os

from setuptools import setup

# The admission core and every module a proxied request runs through. Left out: what
# runs once (start-up, the CLI, the model's sizing), the queue and its policies (little
# per request, and the admission property tests wrap the queue's methods), and the
# forwarding errors (upstream/forward_errors.py: mypyc does not compile a class with two
# builtin bases).
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
    "sidecar/admission/step_clock.py",
    "sidecar/admission/wait_ratio.py",
    "sidecar/metrics.py",
    "sidecar/model/latency.py",
    "sidecar/model/prefill_queue.py",
    "sidecar/server/access_log.py",
    "sidecar/server/client_headers.py",
    "sidecar/server/errors.py",
    "sidecar/server/front.py",
    "sidecar/server/lean.py",
    "sidecar/server/prefix_keys.py",
    "sidecar/server/prompt_tokens.py",
    "sidecar/server/proxy.py",
    "sidecar/server/requests.py",
    "sidecar/server/services.py",
    "sidecar/server/token_stream.py",
    "sidecar/tokens/reuse.py",
    "sidecar/tokens/verification.py",
    "sidecar/upstream/deadline.py",
    "sidecar/upstream/http1.py",
]


def ext_modules() -> list[object]:
    if os.environ.get("KVGATE_COMPILE", "") != "1":
        return []
    from mypyc.build import mypycify  # noqa: PLC0415  (only a compiled build needs mypy)

    return list(mypycify(COMPILED, opt_level="3"))


setup(ext_modules=ext_modules())
