"""The request headers that steer admission: priority, tenant, TTFT target.

Values are validated strictly (a header is an input like any other): a priority is
a class name or a small integer, a tenant a short identifier, a TTFT target a
bounded number of milliseconds. Anything else is a 400 naming the header.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.admission.quick_init import quick_init
from sidecar.server.requests import BadRequest

PRIORITY = "x-kvgate-priority"
TENANT = "x-kvgate-tenant"
TTFT_SLO = "x-kvgate-ttft-slo-ms"

CLASS_NAMES = {"high": 0, "normal": 1, "low": 2}
_TENANT = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
MAX_TTFT_SLO_MS = 3_600_000
_NUMBER = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?")
DEFAULT_TENANT = "default"


@quick_init
@dataclass(frozen=True)
class Steering:
    band: int
    tenant: str
    ttft_slo_s: float | None


def parse_priority(value: str | None, bands: int) -> int:
    if value is None:
        return min(1, bands - 1)
    text = value.strip().lower()
    if text in CLASS_NAMES:
        return min(CLASS_NAMES[text], bands - 1)
    # isascii(): str.isdigit() also accepts digits int() cannot read ("²").
    if text.isascii() and text.isdigit() and len(text) <= 2 and int(text) < bands:
        return int(text)
    names = ", ".join(CLASS_NAMES)
    raise BadRequest(f"header {PRIORITY} must be one of {names} or an integer from 0 to "
                     f"{bands - 1} (0 highest)", PRIORITY)


def parse_tenant(header: str | None, user: str | None) -> str:
    for source, value in ((TENANT, header), ("user", user)):
        if value is None:
            continue
        if not _TENANT.fullmatch(value):
            raise BadRequest(f"{'header ' if source == TENANT else ''}{source} must be 1-128 "
                             "characters of letters, digits and ._:@/+=-", source)
        return value
    return DEFAULT_TENANT


def parse_ttft_slo(value: str | None) -> float | None:
    if value is None:
        return None
    text = value.strip()
    try:
        # float() also reads "1_000" and non-ASCII digits: a header takes plain numbers.
        millis = float(text) if _NUMBER.fullmatch(text) else -1.0
    except ValueError:
        millis = -1.0
    if not 0 < millis <= MAX_TTFT_SLO_MS:
        raise BadRequest(f"header {TTFT_SLO} must be a number of milliseconds in "
                         f"(0, {MAX_TTFT_SLO_MS}]", TTFT_SLO)
    return millis / 1000.0


def parse_steering(headers: Mapping[str, str], user: str | None, bands: int) -> Steering:
    return Steering(
        band=parse_priority(headers.get(PRIORITY), bands),
        tenant=parse_tenant(headers.get(TENANT), user),
        ttft_slo_s=parse_ttft_slo(headers.get(TTFT_SLO)),
    )
