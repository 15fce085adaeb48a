"""HTTP plumbing shared by the admin API and every dialect: keys, bodies, disconnects, SSE."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from openforgerl.gateway.core import CallOutcome
from openforgerl.gateway.errors import GatewayError
from openforgerl.jsonutil import dumps

KEEPALIVE_S = 10.0  # SSE comment while the engine works, so idle-timeouts in clients don't fire


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else dumps(content)


def api_key_of(request: HTTPConnection, *, in_query: bool = True) -> str | None:
    """The key a request carries: a bearer token, an Anthropic or Google key header, or (Gemini's
    `?key=`, when `in_query`) a query parameter."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return (
        request.headers.get("x-api-key")
        or request.headers.get("x-goog-api-key")
        or (request.query_params.get("key") if in_query else None)
        or None
    )


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_large = GatewayError(
        413, f"The request body exceeds the gateway's limit of {limit} bytes.", kind="too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, work: Awaitable[CallOutcome]) -> CallOutcome | None:
    """Run `work`; cancel it (which aborts the generation) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


class SSEResponse(Response):
    """Streams one finished call as SSE: headers and the first event go out at once, keep-alive
    comments while the engine works, a disconnect aborts the generation."""

    media_type = "text/event-stream"

    def __init__(
        self,
        first: bytes,
        work: Callable[[], Awaitable[CallOutcome]],
        release: Callable[[], None],
        events: Callable[[CallOutcome], Iterable[bytes]],
        on_error: Callable[[GatewayError], bytes],
        keepalive: bytes = b": keep-alive\n\n",
    ) -> None:
        # Like Starlette's StreamingResponse: no body attribute, so no content-length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.first, self.work, self.events, self.on_error = first, work, events, on_error
        self.release = release
        # Some clients parse every non-data line as JSON (google-genai): they get a blank line.
        self.keepalive = keepalive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(receive, send)
        finally:
            self.release()

    async def _stream(self, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        task = asyncio.ensure_future(self.work())
        watcher = asyncio.ensure_future(until_disconnect(receive))
        try:
            while not task.done():
                done, _ = await asyncio.wait(
                    {task, watcher}, timeout=KEEPALIVE_S, return_when="FIRST_COMPLETED"
                )
                if watcher in done:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, GatewayError):
                        await task
                    return
                if not done:
                    await send({"type": "http.response.body", "body": self.keepalive, "more_body": True})
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        try:
            outcome = task.result()
        except GatewayError as err:
            body = self.on_error(err)
        else:
            body = b"".join(self.events(outcome))
        await send({"type": "http.response.body", "body": body, "more_body": False})
