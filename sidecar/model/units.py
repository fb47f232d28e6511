"""Small arithmetic helpers shared by the model; units live in names elsewhere."""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2
GB = 1000**3
TERA = 1e12


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of non-negative integers: cdiv(5, 4) == 2."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value`."""
    return cdiv(value, multiple) * multiple
