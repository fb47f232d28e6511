"""Typed application keys (no globals)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from sidecar.server.services import Services

SERVICES = web.AppKey("services", Services)
SESSION = web.AppKey("session", aiohttp.ClientSession)
