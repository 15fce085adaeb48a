"""Connection limits for the gateway's HTTP server: a deadline for each request's headers, a hard
deadline on idle keep-alive connections, and a cap on the connections one peer address holds open.

uvicorn's httptools protocol has none of these: a connection that sends nothing, or a byte now and
then ("slowloris"), stays open until the client leaves, since its keep-alive timer is armed only
after a response and cancelled by any byte that arrives. Only the open-file limit bounded them.
Bodies are timed in `http.read_body`, where a timeout is answered in the caller's dialect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ConnectionLimits:
    # From the connection's opening, or from the first byte of a request on a reused connection,
    # to the end of that request's headers. None: no deadline.
    header_timeout_s: float | None = 30.0
    # Open connections (busy or idle) one peer address may hold; the next one is refused. None: no cap.
    max_connections_per_peer: int | None = 2048


def _reply(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(message)).encode() + b"\r\nconnection: close\r\n\r\n" + message
    )


TIMEOUT_408 = _reply(b"408 Request Timeout", b"The request headers did not arrive in time.")
REFUSED_503 = _reply(b"503 Service Unavailable", b"Too many open connections from this address.")


@dataclass
class PeerCounts:
    """One server's open connections per peer address."""

    open: dict[str, int] = field(default_factory=dict)
    warned_at: float = float("-inf")  # a flood is logged once a minute, not once per refusal

    def take(self, peer: str, cap: int) -> bool:
        if self.open.get(peer, 0) >= cap:
            if time.monotonic() - self.warned_at >= 60:
                self.warned_at = time.monotonic()
                log.warning("%s holds %d open connections, the cap per peer: refusing more", peer, cap)
            return False
        self.open[peer] = self.open.get(peer, 0) + 1
        return True

    def release(self, peer: str) -> None:
        left = self.open.pop(peer) - 1
        if left:
            self.open[peer] = left


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's default HTTP/1.1 protocol with the limits above. Use `protocol_class(limits)`: each
    server needs its own count of connections per peer."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    peers: ClassVar[PeerCounts] = PeerCounts()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._peer: str | None = None  # set while this connection counts against its peer's cap
        self._in_head = False  # part of a request's head has arrived, not all of it
        self._idle = False  # between requests: the deadline is the keep-alive one

    # -- the deadline ---------------------------------------------------------------------
    def _arm(self, delay: float | None) -> None:
        self._disarm()
        if delay is not None:
            self._deadline = self.loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # never cut a request being answered (no deadline is armed then anyway)
        if self._in_head:
            self.transport.write(TIMEOUT_408)  # a courtesy: the client may not read it
        self.transport.close()

    # -- the peer's count -----------------------------------------------------------------
    def _release(self) -> None:
        peer, self._peer = self._peer, None
        if peer is not None:
            self.peers.release(peer)

    # -- uvicorn's hooks ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap, peer = self.limits.max_connections_per_peer, self.client[0] if self.client else None
        if cap is not None and peer is not None:
            if not self.peers.take(peer, cap):
                # Before any request: a client that reads it learns why; others see a close.
                transport.write(REFUSED_503)
                transport.close()
                return
            self._peer = peer
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:  # the first byte of a request's method
        super().on_message_begin()
        self._in_head = True
        if self._idle:  # a reused connection: the head's clock starts now
            self._idle = False
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        # The app owns the request now: its body is timed by read_body, its answer by nothing here.
        self._in_head = False
        self._idle = False
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or not self.cycle.response_complete:
            return  # closed, or a pipelined request started
        if self._in_head:  # the next request's head began while this one was answered
            self._arm(self.limits.header_timeout_s)
        else:
            # uvicorn's own keep-alive timer is cancelled by any byte (a stray CRLF, the unread
            # rest of a body); this one is not.
            self._idle = True
            self._arm(self.timeout_keep_alive)

    def handle_websocket_upgrade(self) -> None:
        # The WebSocket protocol takes the transport; this connection still counts against its peer
        # until the socket closes, so the new protocol's connection_lost releases it.
        self._disarm()
        super().handle_websocket_upgrade()
        ws = self.transport.get_protocol()
        if self._peer is not None and ws is not self:
            lost = ws.connection_lost

            def connection_lost(exc: Exception | None) -> None:
                try:
                    lost(exc)
                finally:
                    self._release()

            ws.connection_lost = connection_lost  # type: ignore[method-assign]


def protocol_class(connection_limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for one server (uvicorn's `Config(http=...)`), with its own peer counts."""

    class GatewayHTTPProtocol(LimitedHttpToolsProtocol):
        limits = connection_limits
        peers = PeerCounts()

    return GatewayHTTPProtocol
