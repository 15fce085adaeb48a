"""The dialect: `POST /v1/responses` (JSON or SSE) through the gateway's route skeleton, and the
WebSocket transport on `GET /v1/responses`, one connection answering its frames in order."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from openforgerl import jsonutil
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome, PreparedCall, Session
from openforgerl.gateway.dialects.openai_chat import error_body
from openforgerl.gateway.dialects.responses.chaining import (
    Context,
    Contexts,
    Turn,
    parse_turn,
    rebuilt_context,
)
from openforgerl.gateway.dialects.responses.events import Reply, ws_error
from openforgerl.gateway.dialects.responses.protocol import NAME
from openforgerl.gateway.errors import GatewayError, bad_request
from openforgerl.gateway.http import Relay
from openforgerl.images import Image
from openforgerl.store import Store


class OpenAIResponses(serving.JSONErrors):
    """`POST /v1/responses` and the WebSocket transport on `GET /v1/responses`."""

    name = NAME
    owned = re.compile(r"^(/r/[^/]+)?/v1/responses(/|$)")
    error_body = staticmethod(error_body)

    def __init__(self) -> None:
        self.contexts = Contexts()

    def turn(
        self, rollout_id: str, body: bytes | dict[str, Any], files: Mapping[str, Image], store: Store
    ) -> Turn:
        """Parse a request body, expanding its `previous_response_id` from this rollout's memory, or
        from `store` when memory has lost it (a restart; a read of the store, which is why this
        belongs on a worker thread, like the rest of parsing)."""

        def recall(response_id: str) -> Context | None:
            context = self.contexts.get(rollout_id, response_id)
            if context is None:
                context = rebuilt_context(store, rollout_id, response_id)
                if context is not None:
                    self.contexts.put(rollout_id, response_id, context)
            return context

        return parse_turn(body, recall, files)

    def reply(self, turn: Turn, rollout_id: str, stream_id: str | None = None) -> Reply:
        return Reply(turn, functools.partial(self.contexts.put, rollout_id), stream_id)

    def routes(self, host: serving.Host) -> list[serving.RouteSpec]:
        def parse(body: bytes, files: Mapping[str, Image], at: serving.Incoming) -> Reply:
            return self.reply(self.turn(at.rollout_id, body, files, host.store), at.rollout_id)

        async def serve(websocket: WebSocket, session: Session) -> None:
            await _Socket(self, host, websocket, session).serve()

        return [serving.CallRoute("/v1/responses", parse), serving.SocketRoute("/v1/responses", serve)]


class _Socket:
    """One WebSocket connection: frames are answered in order; a disconnect aborts the generation."""

    def __init__(self, dialect: OpenAIResponses, host: serving.Host, websocket: WebSocket, session: Session):
        self.dialect, self.host, self.websocket, self.session = dialect, host, websocket, session
        self.frames: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self.gone = asyncio.Event()

    async def serve(self) -> None:
        reader = asyncio.ensure_future(self._read())
        try:
            while (frame := await self.frames.get()) is not None:
                try:
                    await self._answer(frame)
                except GatewayError as err:
                    await self._send([ws_error(err)])
                except WebSocketDisconnect:
                    raise
                except Exception as exc:  # a bug must not end the connection: answer 500, as over HTTP
                    internal = GatewayError(500, f"Internal gateway error: {exc!r}", kind="internal")
                    await self._send([ws_error(internal)])
        finally:
            reader.cancel()

    async def _read(self) -> None:
        try:
            while (message := await self.websocket.receive())["type"] != "websocket.disconnect":
                await self.frames.put(message.get("text") or message.get("bytes") or b"")
        finally:  # however reading ends, the connection is over: stop generating, stop serving
            self.gone.set()
            self.frames.put_nowait(None)

    async def _send(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await self.websocket.send_text(orjson.dumps(event).decode())

    async def _answer(self, frame: str | bytes) -> None:
        try:
            event = jsonutil.loads(frame)
        except ValueError as exc:
            raise bad_request(f"The frame is not valid JSON: {exc}") from exc
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.processed":
            return  # Codex's acknowledgement of a response; it expects no answer
        if kind != "response.create":
            raise bad_request(f"Unsupported event type {kind!r}: send 'response.create'.", param="type")
        stream_id = event.get("stream_id")
        raw = frame.encode() if isinstance(frame, str) else frame
        rollout, store = self.session.rollout.id, self.host.store
        turn = await self.host.parse(
            self.session, raw, lambda _, files: self.dialect.turn(rollout, event, files, store)
        )
        reply = self.dialect.reply(turn, rollout, stream_id if isinstance(stream_id, str) else None)
        if not turn.req.generate:
            reply.remember(None)
            await self._send(reply.prewarm_events())
            return
        prepared = await self.host.prepare(self.session, reply)
        try:
            await self._send(reply.opening())
            outcome = await self._run(prepared, reply)
        except GatewayError as err:
            await self._send(reply.failed(err))
            return
        finally:
            self.host.release(prepared)
        if outcome is not None:
            reply.remember(outcome)
            await self._send(reply.end_events(outcome))

    async def _run(self, prepared: PreparedCall, reply: Reply) -> CallOutcome | None:
        """Generate, sending the answer's events as it is sampled (`response.in_progress` as
        keep-alive while the engine is silent); None if the client went away."""

        async def keepalive() -> None:
            await self._send([reply.event("response.in_progress", response=reply.response("in_progress"))])

        relay: Relay[dict[str, Any]] = Relay()
        task = asyncio.ensure_future(self.host.run(prepared, lambda d: relay.put(reply.delta_events(d))))
        if not await relay.run(task, self.gone.wait(), self._send, keepalive):
            return None
        outcome: CallOutcome = task.result()
        return outcome
