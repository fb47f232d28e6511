"""How forwarding a request to the server failed, one type per answer the proxy gives.

`UpstreamUnavailable` (refused, reset, closed or a connect timeout before any answer:
503), `UpstreamTimeout` (silent longer than the read timeout: 504, or a stream ended with
an error), `UpstreamProtocolError` (an answer that is not HTTP/1.x: 502), and
`UpstreamBroke` (the body ended early: the stream is ended with an error).

Apart from the forwarding pool (http1.py) because the compiled build compiles the pool and
not these: mypyc cannot compile a class with two builtin bases (`ConnectionError`,
`TimeoutError`), and callers catch them as those too.
"""

from __future__ import annotations


class ForwardError(Exception):
    """The server gave no usable answer to a forwarded request."""


class UpstreamUnavailable(ForwardError, ConnectionError):
    """No answer: refused, reset or closed before the response's head."""


class UpstreamConnectTimeout(UpstreamUnavailable):
    """The connection was not established within the connect timeout."""


class UpstreamTimeout(ForwardError, TimeoutError):
    """The server stayed silent longer than the read timeout."""


class UpstreamProtocolError(ForwardError):
    """The server answered something that is not an HTTP/1.x response."""


class UpstreamBroke(ForwardError, ConnectionError):
    """The connection ended before the response's body did."""
