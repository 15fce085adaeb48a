"""The viewer's HTTP edge: who may ask (`Guard`: a token, or a loopback Host), the headers every
answer carries, and the JSON body of an answer."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from openforgerl.jsonutil import dumps

COOKIE = "openforge_view_token"
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def json_response(data: Any, status: int = 200) -> Response:
    return Response(dumps(data), status_code=status, media_type="application/json")


class Guard(BaseHTTPMiddleware):
    """With a token: every request carries it (bearer header, cookie, or ?token= once, which sets the
    cookie). Without one (loopback only): the Host must be a loopback name, so a web page cannot
    reach the viewer through DNS rebinding."""

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(
        self, request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if not self.token:
            host = _hostname(request.headers.get("host", ""))
            if host and not is_loopback(host):
                return json_response(
                    {"error": {"status": 403, "message": f"host {host!r} is not loopback"}}, 403
                )
            return _secure(await call_next(request))
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given.encode(), self.token.encode()):
            # Trade the token in the address for a cookie, and drop it from the address bar.
            redirect = RedirectResponse(str(request.url.remove_query_params("token")), status_code=303)
            redirect.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return redirect
        bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        cookie = request.cookies.get(COOKIE, "")
        if any(c and hmac.compare_digest(c.encode(), self.token.encode()) for c in (bearer, cookie)):
            return _secure(await call_next(request))
        return json_response(
            {"error": {"status": 401, "message": "this viewer needs its token: open it with ?token=TOKEN"}},
            401,
        )


def _hostname(header: str) -> str:
    """The host of a Host header, without the port ('[::1]:8000' -> '[::1]')."""
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return header.rsplit(":", 1)[0]


def _secure(response: Response) -> Response:
    response.headers.setdefault("content-security-policy", CSP)
    response.headers.setdefault("x-content-type-options", "nosniff")
    response.headers.setdefault("referrer-policy", "no-referrer")
    return response
