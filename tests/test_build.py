"""The build: the pure Python package by default, the modules setup.py lists compiled
(mypyc) when built with KVGATE_COMPILE=1; scripts/check runs the tests on both."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import sidecar
from sidecar import compiled_modules

ROOT = Path(sidecar.__file__).resolve().parent.parent


def listed_in_setup() -> list[str]:
    """setup.py's COMPILED, read without running it."""
    for node in ast.parse((ROOT / "setup.py").read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "COMPILED"):
            paths: list[str] = ast.literal_eval(node.value)
            return paths
    raise AssertionError("setup.py has no COMPILED list")


def test_the_modules_run_as_they_were_built() -> None:
    paths = listed_in_setup()
    assert paths and all((ROOT / path).is_file() for path in paths), paths
    names = [path.removesuffix(".py").replace("/", ".") for path in paths]
    for name in names:
        importlib.import_module(name)
    built = sorted(name for name in names
                   if list((ROOT / name.replace(".", "/")).parent.glob(
                       name.rsplit(".", 1)[1] + ".*.so")))
    # What runs is what was built: the extension where there is one, else the source.
    assert compiled_modules() == built
    if os.environ.get("KVGATE_EXPECT_COMPILED") == "1":  # scripts/check's compiled run
        assert built == sorted(names)
