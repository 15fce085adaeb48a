"""HTTP plumbing shared by the admin API and every dialect: keys, bodies, disconnects, SSE."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from openforgerl.gateway.core import CallOutcome
from openforgerl.gateway.errors import GatewayError
from openforgerl.gateway.workers import TRIM_AFTER_BYTES, trim_memory_later
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


BODY_TIMEOUT_S = 60.0  # when the app does not say (`app.state.body_timeout_s`, set by build_app)


class BodyTimeout(GatewayError):
    """408: the client stopped sending its body. The connection is closed after the answer: the
    rest of the body may still come, and would be read as the next request (RFC 9110, 15.5.9)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            408, f"The request body did not arrive within {timeout:g} s.", code="request_timeout"
        )

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "connection": "close"}


def _check_json_type(request: Request) -> None:
    """A body of another declared type (text/plain, a form) is refused rather than guessed at; no
    content type at all is read as JSON, as the public APIs do."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise GatewayError(
            415,
            f"The request body must be JSON (Content-Type: application/json), not {media or 'empty'!r}.",
            kind="invalid_request",
            code="unsupported_media_type",
        )


async def read_body(request: Request, limit: int, *, json: bool = True) -> bytes:
    """The body, refused with 413 over `limit` bytes and with 408 unless it all arrives within the
    app's `body_timeout_s` (a slow sender otherwise holds its connection and task for ever); with
    `json`, a body of a declared non-JSON type is a 415."""
    if json:
        _check_json_type(request)
    declared = request.headers.get("content-length")
    too_large = GatewayError(
        413, f"The request body exceeds the gateway's limit of {limit} bytes.", kind="too_large"
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    app = request.scope.get("app")
    timeout: float | None = getattr(app.state, "body_timeout_s", BODY_TIMEOUT_S) if app else BODY_TIMEOUT_S
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(timeout or 0) from None
    except ClientDisconnect:  # nobody reads the answer; without this, a traceback in the log per drop
        raise GatewayError(400, "The client went away before its body arrived.") from None
    if size > TRIM_AFTER_BYTES:
        trim_memory_later()
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


SendEvents = Callable[[bytes], None]  # a streamed call's events, as they come (b"" is ignored)


class SSEResponse(Response):
    """Streams one call as SSE: headers and the first events go out at once, then the events `work`
    sends as the answer is sampled (keep-alive comments while there are none), then `end`'s events
    for the finished call; a disconnect aborts the generation.

    `work(send)` runs the call; `send` may be called any number of times before it returns.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        first: bytes,
        work: Callable[[SendEvents], Awaitable[CallOutcome]],
        release: Callable[[], None],
        end: Callable[[CallOutcome], bytes],
        on_error: Callable[[GatewayError], bytes],
        keepalive: bytes = b": keep-alive\n\n",
    ) -> None:
        # Like Starlette's StreamingResponse: no body attribute, so no content-length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.first, self.work, self.end, self.on_error = first, work, end, on_error
        self.release = release
        # Some clients parse every non-data line as JSON (google-genai): they get a blank line.
        self.keepalive = keepalive

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope.get("http_version") == "1.0":
                await self._whole(receive, send)
            else:
                await self._stream(receive, send)
        finally:
            self.release()

    def _closing(self, outcome: CallOutcome | BaseException) -> bytes:
        """The events after the answer's deltas: the end of a finished call, or an error event
        (never a cut-off stream, also for a bug after the 200 went out)."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            return self.end(outcome)
        except GatewayError as err:
            return self.on_error(err)
        except Exception as exc:
            return self.on_error(GatewayError(500, f"Internal gateway error: {exc!r}", kind="internal"))

    async def _whole(self, receive: Receive, send: Send) -> None:
        """HTTP/1.0 has no chunked encoding: the same events, sent at once with their length."""
        events: list[bytes] = [self.first]
        try:
            outcome = await race_disconnect(receive, self.work(events.append))
            if outcome is None:
                return
            events.append(self._closing(outcome))
        except Exception as exc:
            events.append(self._closing(exc))
        body = b"".join(events)
        self.headers["content-length"] = str(len(body))
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})

        async def write(events: list[bytes]) -> None:
            await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})

        async def keepalive() -> None:
            await send({"type": "http.response.body", "body": self.keepalive, "more_body": True})

        relay: Relay[bytes] = Relay()
        task = asyncio.ensure_future(self.work(lambda events: relay.put([events] if events else [])))
        if not await relay.run(task, until_disconnect(receive), write, keepalive):
            return
        try:
            closing = self._closing(task.result())
        except Exception as exc:
            closing = self._closing(exc)
        await send({"type": "http.response.body", "body": closing, "more_body": False})


_E = TypeVar("_E")


class Relay(Generic[_E]):
    """A running call's events, queued by plain callbacks (a token sink) and written by a coroutine as
    they come: everything queued since the last write goes in one, `keepalive` when nothing came
    for KEEPALIVE_S. The SSE response and the Responses WebSocket both stream through it."""

    def __init__(self) -> None:
        self.pending: list[_E] = []
        self.ready = asyncio.Event()

    def put(self, events: Sequence[_E]) -> None:
        if events:
            self.pending.extend(events)
            self.ready.set()

    async def run(
        self,
        task: asyncio.Future[Any],
        gone: Awaitable[Any],
        write: Callable[[list[_E]], Awaitable[None]],
        keepalive: Callable[[], Awaitable[None]],
    ) -> bool:
        """Write `task`'s events until it is done and they are all written (True), or until `gone`
        completes (the client left: the task is cancelled, False)."""
        watcher = asyncio.ensure_future(gone)
        waiter: asyncio.Future[Any] | None = None
        try:
            while True:
                waiter = asyncio.ensure_future(self.ready.wait())
                done, _ = await asyncio.wait(
                    {task, watcher, waiter}, timeout=KEEPALIVE_S, return_when="FIRST_COMPLETED"
                )
                waiter.cancel()
                if watcher in done:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, GatewayError):
                        await task
                    return False
                if self.pending:
                    self.ready.clear()
                    events = self.pending[:]
                    self.pending.clear()
                    await write(events)
                elif not done:
                    await keepalive()
                if task.done() and not self.pending:
                    return True
        finally:
            watcher.cancel()
            if waiter is not None:
                waiter.cancel()
            if not task.done():
                task.cancel()
