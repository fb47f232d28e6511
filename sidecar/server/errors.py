"""Responses in OpenAI's error format, with the numbers behind kvgate's decisions."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from sidecar.admission import Decision, Outcome
from sidecar.server.access_log import DECISION, ERROR_CODE

STATUS = {
    Outcome.NEVER_FITS: 400,
    Outcome.QUEUE_FULL: 429,
    Outcome.DEADLINE: 429,
    Outcome.QUEUE_TIMEOUT: 429,
    Outcome.UNAVAILABLE: 503,
    Outcome.DRAINING: 503,
}
ERROR_TYPE = {400: "invalid_request_error", 413: "invalid_request_error",
              404: "not_found_error", 405: "invalid_request_error",
              429: "rate_limit_error", 503: "service_unavailable_error",
              502: "api_error", 504: "api_error", 401: "authentication_error"}


def _finite(value: Any) -> Any:
    """JSON has no Infinity or NaN (strict clients refuse them): null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    kvgate: Mapping[str, Any] | None = None,
    retry_after_s: float | None = None,
) -> web.Response:
    body: dict[str, Any] = {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "api_error"),
            "code": code,
            "param": param,
        }
    }
    if kvgate is not None:
        body["kvgate"] = _finite(dict(kvgate))
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    response = web.Response(status=status, text=json.dumps(body),
                            content_type="application/json", headers=headers)
    response[ERROR_CODE] = code  # for the access log
    return response


def rejection_response(decision: Decision) -> web.Response:
    status = STATUS[decision.outcome]
    param = None
    if decision.outcome is Outcome.NEVER_FITS:
        # Too many sequences for the server's queue limit is `n`'s doing, not max_tokens'.
        param = "n" if "server_limit" in decision.details else "max_tokens"
    kvgate: dict[str, Any] = {"outcome": decision.outcome.value, **decision.details}
    if decision.retry_after_s is not None:
        kvgate["retry_after_s"] = decision.retry_after_s
    response = error_response(
        status,
        decision.reason,
        code=decision.outcome.value,
        param=param,
        kvgate=kvgate,
        retry_after_s=decision.retry_after_s if status != 400 else None,
    )
    response[DECISION] = decision
    return response
