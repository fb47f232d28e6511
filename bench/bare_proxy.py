#!/usr/bin/env python3
"""The floor for a Python proxy: a bare aiohttp stream-through reverse proxy.

    python bench/bare_proxy.py --port 20002 --upstream http://127.0.0.1:20001

No admission, no parsing, no metrics: it reads each request's body, sends it upstream
on a pooled keep-alive connection and streams the answer back chunk by chunk. The
canned-upstream run of `bench/overhead.py` holds kvgate against it.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length"})
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    async with request.app[SESSION].request(
            request.method, request.app[UPSTREAM] + request.rel_url.path_qs,
            data=body or None, headers=headers, allow_redirects=False) as upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in upstream.headers.items():
            if name.lower() not in HOP_BY_HOP:
                response.headers.add(name, value)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def session_context(app: web.Application):  # type: ignore[no-untyped-def]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        app[SESSION] = session
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(session_context)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None,
                backlog=4096)


if __name__ == "__main__":
    main()
