"""What a dialect is to the gateway: the contract between the gateway's one route skeleton
(gateway/routes.py) and the dialect translators (gateway/dialects/).

A dialect declares its routes as specs and renders errors in its own shape; the skeleton answers
every route alike: authentication, the body, parsing on a worker thread, the call, streaming, a
client that went away, and errors. A dialect sees the gateway only as a `Host`, and no dialect
imports the app.

- `CallRoute`: one model call. `parse` turns the body into an `Exchange`, which holds the
  `Conversation` for the core and renders the outcome: a JSON body, or SSE: the first events at
  once, then the answer's deltas as the engine samples them (text, reasoning, tool calls), the
  closing events once the call is recorded, or an error event when it failed after the stream began.
- `CountRoute`: the prompt's length in tokens, without a call.
- `InfoRoute`: an answer that makes no call (model lists, probes).
- `SocketRoute`: a WebSocket, authenticated on its handshake.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from openforgerl.conversation import Conversation
from openforgerl.engines.parsers import Delta
from openforgerl.gateway.core import CallOutcome, PreparedCall, Session
from openforgerl.gateway.errors import GatewayError
from openforgerl.gateway.http import JSONResponse
from openforgerl.images import Image
from openforgerl.store import Store

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Incoming:
    """What a dialect's parse reads of its request besides the body and the files it names."""

    rollout_id: str
    path_params: Mapping[str, Any]
    query_params: Mapping[str, str]


class Exchange(ABC):
    """One request of a `CallRoute`, parsed: the conversation for the core, and how its answer is
    written. The shared handler calls these hooks; a subclass writes the wire format."""

    conv: Conversation
    keepalive: bytes = b": keep-alive\n\n"  # SSE while the engine works

    @property
    def streams(self) -> bool:
        """Whether the answer is SSE (else one JSON body)."""
        return self.conv.stream

    @property
    def headers(self) -> Mapping[str, str]:
        """Headers on the answer (JSON or SSE), not on an error."""
        return {}

    def without_model(self) -> Response | None:
        """The answer to a request that asks for no call (None: make the call)."""
        return None

    def prepared(self, call: PreparedCall) -> None:
        """Seen once the core has prepared the call, before it runs (e.g. ids kept with its record)."""
        return None

    def stream_start(self, call: PreparedCall) -> bytes:
        """The SSE events sent at once, before generation."""
        return b""

    @abstractmethod
    def body(self, out: CallOutcome) -> bytes:
        """The JSON answer for a finished call."""

    @abstractmethod
    def stream_delta(self, delta: Delta) -> bytes:
        """The SSE events for a piece of the answer, as it is sampled (b"" to send it later)."""

    @abstractmethod
    def stream_end(self, out: CallOutcome) -> bytes:
        """The SSE events that close the stream of a finished, recorded call (its deltas are sent)."""

    @abstractmethod
    def stream_error(self, err: GatewayError) -> bytes:
        """An error after the stream began (the status is spent): an event the client raises."""


Parse = Callable[[bytes, Mapping[str, Image], Incoming], _T]


@dataclass(frozen=True, slots=True)
class CallRoute:
    """`POST path`: one model call; `parse` (on a worker thread) reads the body and the uploaded
    images it names (GatewayError 400 when malformed)."""

    path: str
    parse: Parse[Exchange]


@dataclass(frozen=True, slots=True)
class CountRoute:
    """`POST path`: the prompt's length in tokens, without a call; `render` writes the count."""

    path: str
    parse: Parse[Conversation]
    render: Callable[[int], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class InfoRoute:
    """A route that makes no call: `answer(request)` is the JSON body (authenticate with
    `Host.session` where it needs a key); a GatewayError is answered in the dialect's shape."""

    path: str  # '' under the bare prefix is '/'
    answer: Callable[[Request], Awaitable[Any]]
    methods: tuple[str, ...] = ("GET",)


@dataclass(frozen=True, slots=True)
class SocketRoute:
    """A WebSocket on `path`: its handshake is authenticated (refused in the dialect's shape), then
    `serve(websocket, session)` runs the accepted connection until the client goes away."""

    path: str
    serve: Callable[[WebSocket, Session], Awaitable[None]]


RouteSpec = CallRoute | CountRoute | InfoRoute | SocketRoute


class Host(Protocol):
    """The gateway as a dialect sees it (gateway/routes.py serves it)."""

    @property
    def store(self) -> Store: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def decode(self, ids: Sequence[int]) -> str:
        """The policy tokenizer's text for token ids."""
        ...

    async def session(self, conn: HTTPConnection) -> Session:
        """The open rollout the request's key belongs to (GatewayError 401/403 otherwise)."""
        ...

    async def parse(
        self, session: Session, body: bytes, parse: Callable[[bytes, Mapping[str, Image]], _T]
    ) -> _T:
        """`parse(body, files)` on a worker thread, with the rollout's uploads the body names."""
        ...

    async def prepare(self, session: Session, exchange: Exchange) -> PreparedCall:
        """The core's call for the exchange (GatewayError before anything was sent)."""
        ...

    async def run(self, call: PreparedCall, on_delta: Callable[[Delta], None] | None = None) -> CallOutcome:
        """Generate and record the call (cancel it to abort the generation); `on_delta` gets the
        answer's pieces as they are sampled, all of them before this returns."""
        ...

    def release(self, call: PreparedCall) -> None:
        """End the call's slot in flight (idempotent)."""
        ...


class Dialect(Protocol):
    name: str

    def routes(self, host: Host) -> list[RouteSpec]:
        """The dialect's routes, without the prefix ('' or '/r/{rollout_id}') the gateway adds."""
        ...

    def owns_path(self, path: str) -> bool:
        """Whether errors on this path (e.g. an unknown sub-route) belong to this dialect."""
        ...

    def error_response(self, err: GatewayError) -> Response:
        """The error in this dialect's own shape, with its status and retry headers."""
        ...


class JSONErrors:
    """`owns_path` and `error_response` for a dialect whose errors are JSON bodies."""

    owned: re.Pattern[str] | None = None  # None: every path (the fallback dialect)
    error_body: Callable[[GatewayError], bytes]

    def error_status(self, err: GatewayError) -> int:
        return err.status

    def owns_path(self, path: str) -> bool:
        return self.owned is None or self.owned.match(path) is not None

    def error_response(self, err: GatewayError) -> Response:
        return JSONResponse(self.error_body(err), status_code=self.error_status(err), headers=err.headers())
