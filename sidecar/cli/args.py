"""Argument parsing shared by the commands: one-line errors, typed values."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2, and which
    takes no abbreviation of a flag: a later flag of the same prefix would change what an
    abbreviation meant (the flags other commands spell differently are aliases)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


# The most GiB a memory flag takes: far past any device (1 PiB), short of the float
# range where byte counts stop being integers.
MAX_GIB = 1024.0 ** 2


def memory_gib(text: str) -> float:
    """A memory size in GiB: positive, at most MAX_GIB."""
    value = positive_float(text)
    if value > MAX_GIB:
        raise argparse.ArgumentTypeError(
            f"expected a size in GiB of at most {MAX_GIB:,.0f}, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def vllm_version(text: str) -> tuple[int, int]:
    """A vLLM release as X.Y or X.Y.Z (the patch level does not change accounting)."""
    parts = text.strip().lstrip("v").split(".")
    if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected a vLLM version like 0.32 or 0.19.1, "
                                         f"got {text!r}")
    return int(parts[0]), int(parts[1])


def fail(prog: str, message: str) -> NoReturn:
    """Print one error line and exit 2 (bad input)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)
