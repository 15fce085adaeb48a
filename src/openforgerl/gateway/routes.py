"""Every dialect's routes, answered by one skeleton.

A dialect declares its routes as specs (gateway/serving.py); `Routes` turns them into
Starlette routes under both prefixes ('' and '/r/{rollout_id}') and answers them all alike:
authenticate the key, read the body (size and time bounded, JSON only), parse it on a worker thread
(JSON, validation and image decoding off the event loop; images for a model that takes none are
refused before they are decoded), prepare the call, then either stream it (SSE: the first events at
once, the answer's deltas as they are sampled, keep-alives while the engine is silent, the closing
events once the call is recorded, an error event if it fails after the stream began) or run it to
its record and answer one body; a client that goes away aborts the generation (499); every error is
answered in the dialect's own shape. `Routes` is also the `Host` the dialects see.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from openforgerl.engines.parsers import Delta
from openforgerl.gateway.core import CallOutcome, GatewayCore, PreparedCall, Session
from openforgerl.gateway.errors import GatewayError, images_refused, unauthorized
from openforgerl.gateway.http import JSONResponse, SSEResponse, api_key_of, race_disconnect, read_body
from openforgerl.gateway.serving import (
    CallRoute,
    CountRoute,
    Dialect,
    Exchange,
    Incoming,
    InfoRoute,
    Parse,
    RouteSpec,
    SocketRoute,
)
from openforgerl.images import Image, digest_of_file_id, file_id, file_ids_in
from openforgerl.store import Store

_T = TypeVar("_T")


class Routes:
    """The dialects' routes over a GatewayCore; the `Host` each dialect is given."""

    def __init__(self, core: GatewayCore, max_body: int) -> None:
        self.core = core
        self.max_body = max_body

    # -- the Host ---------------------------------------------------------------------------
    @property
    def store(self) -> Store:
        return self.core.store

    @property
    def policy_version(self) -> int:
        return self.core.engine.policy_version

    @property
    def max_context(self) -> int:
        return self.core.max_context

    def decode(self, ids: Sequence[int]) -> str:
        return self.core.renderer.decode(list(ids))

    async def session(self, conn: HTTPConnection) -> Session:
        key = api_key_of(conn)
        if key is None:
            raise unauthorized("Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key'.")
        session = await self.core.sessions.for_key(key)
        if session is None:
            raise unauthorized()
        prefix = conn.path_params.get("rollout_id")
        if prefix is not None and prefix != session.rollout.id:
            raise unauthorized("The API key does not belong to the rollout in the URL.")
        if session.rollout.status != "open":
            raise GatewayError(
                403, f"Rollout {session.rollout.id} is {session.rollout.status}.", kind="permission"
            )
        return session

    async def files_in(self, session: Session, body: bytes) -> dict[str, Image]:
        """The images this rollout uploaded that a request body names, by file id (read before it is
        parsed, so the parse reads no store; an id that is not there is the parse's 400)."""
        ids = file_ids_in(body)
        if not ids:
            return {}
        digests = [d for i in ids if (d := digest_of_file_id(i))]
        found = await self.core.store.uploads(session.rollout.id, digests)
        return {file_id(d): im for d, (im, _) in found.items()}

    async def parse(
        self, session: Session, body: bytes, parse: Callable[[bytes, Mapping[str, Image]], _T]
    ) -> _T:
        """`parse(body, files)` on a worker thread: JSON, validation and image decoding off the event
        loop; an image for a model that takes none is refused before it is decoded."""
        files = await self.files_in(session, body)
        refused = self.core.images_refused(session)

        def run() -> _T:
            images_refused.set(refused)  # in the worker's own copy of the context
            return parse(body, files)

        return await self.core.workers.run(run, share=session.rollout.id)

    async def prepare(self, session: Session, exchange: Exchange) -> PreparedCall:
        prepared = await self.core.prepare(session, exchange.conv)
        exchange.prepared(prepared)
        return prepared

    async def run(self, call: PreparedCall, on_delta: Callable[[Delta], None] | None = None) -> CallOutcome:
        return await self.core.run(call, on_delta)

    def release(self, call: PreparedCall) -> None:
        self.core.release(call)

    # -- the skeleton -----------------------------------------------------------------------
    def for_dialect(self, dialect: Dialect, prefix: str) -> list[BaseRoute]:
        """The dialect's routes under `prefix` ('' or '/r/{rollout_id}')."""
        return [self._route(dialect, spec, prefix) for spec in dialect.routes(self)]

    def _route(self, dialect: Dialect, spec: RouteSpec, prefix: str) -> BaseRoute:
        path = prefix + spec.path or "/"
        if isinstance(spec, SocketRoute):

            async def socket(websocket: WebSocket) -> None:
                await self._socket(dialect, spec, websocket)

            return WebSocketRoute(path, socket)
        answer: Callable[[Request], Awaitable[Response]]
        methods = ["POST"]
        if isinstance(spec, CallRoute):
            answer = functools.partial(self._call, spec)
        elif isinstance(spec, CountRoute):
            answer = functools.partial(self._count, spec)
        else:
            answer, methods = functools.partial(self._info, spec), list(spec.methods)

        async def endpoint(request: Request) -> Response:
            try:
                return await answer(request)
            except GatewayError as err:
                return dialect.error_response(err)

        return Route(path, endpoint, methods=methods)

    async def _parsed(self, request: Request, parse: Parse[_T]) -> tuple[Session, _T]:
        """Authenticate, read the body and parse it (raises GatewayError)."""
        session = await self.session(request)
        body = await read_body(request, self.max_body)
        incoming = Incoming(session.rollout.id, request.path_params, request.query_params)
        return session, await self.parse(session, body, lambda b, files: parse(b, files, incoming))

    async def _call(self, spec: CallRoute, request: Request) -> Response:
        session, exchange = await self._parsed(request, spec.parse)
        answer = exchange.without_model()
        if answer is not None:
            return answer
        prepared = await self.prepare(session, exchange)
        if exchange.streams:
            try:
                first = exchange.stream_start(prepared)
            except BaseException:
                self.core.release(prepared)
                raise
            sse = SSEResponse(
                first,
                lambda send: self.core.run(prepared, lambda d: send(exchange.stream_delta(d))),
                lambda: self.core.release(prepared),
                exchange.stream_end,
                exchange.stream_error,
                exchange.keepalive,
            )
            sse.headers.update(exchange.headers)
            return sse
        try:
            outcome = await race_disconnect(request.receive, self.core.run(prepared))
        finally:
            self.core.release(prepared)
        if outcome is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        return JSONResponse(exchange.body(outcome), headers=dict(exchange.headers))

    async def _count(self, spec: CountRoute, request: Request) -> Response:
        session, conv = await self._parsed(request, spec.parse)
        return JSONResponse(spec.render(await self.core.count_tokens(session, conv)))

    async def _info(self, spec: InfoRoute, request: Request) -> Response:
        return JSONResponse(await spec.answer(request))

    async def _socket(self, dialect: Dialect, spec: SocketRoute, websocket: WebSocket) -> None:
        try:
            session = await self.session(websocket)  # a WebSocket has headers, query and path params too
        except GatewayError as err:
            await websocket.send_denial_response(dialect.error_response(err))
            return
        await websocket.accept()
        with contextlib.suppress(WebSocketDisconnect):
            await spec.serve(websocket, session)
