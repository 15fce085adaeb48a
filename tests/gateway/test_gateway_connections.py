"""Slow and stalled clients (slowloris) are cut off, one address cannot hold unbounded connections,
and well-behaved clients notice none of it. Raw sockets play the hostile clients; every wait has a
generous deadline only so that a failure cannot hang the run."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import websockets.sync.client
from openai import OpenAI

from openforgerl.gateway import server
from openforgerl.gateway.connections import ConnectionLimits, LimitedHttpToolsProtocol, protocol_class
from tests.gateway_helpers import ScriptEngine, new_rollout, running_gateway

DEADLINE_S = 30.0  # only against hanging: every behaviour here happens in well under a second
CAP = 4


def start(tiny_model_dir: Path, tmp: Path, **cfg: Any) -> Iterator[Any]:
    """A gateway whose protocol class (and so its count of connections per peer) the test can see."""
    made: list[type[LimitedHttpToolsProtocol]] = []

    def capture(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
        made.append(protocol_class(limits))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "protocol_class", capture)
        with running_gateway(tiny_model_dir, tmp, ScriptEngine(tiny_model_dir), **cfg) as gw:
            gw.protocol = made[-1]
            yield gw


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Short read deadlines (the cap is far away)."""
    yield from start(
        tiny_model_dir, tmp_path_factory.mktemp("timeouts"), header_timeout_s=0.5, body_timeout_s=0.5
    )


@pytest.fixture(scope="module")
def capped(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A small cap per peer, and no header deadline, so idle connections stay until closed."""
    yield from start(
        tiny_model_dir, tmp_path_factory.mktemp("cap"), header_timeout_s=None, max_connections_per_peer=CAP
    )


def open_here(gw: Any) -> int:
    """Connections the gateway counts against 127.0.0.1, where every test client is."""
    counts: dict[str, int] = gw.protocol.peers.open
    return counts.get("127.0.0.1", 0)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, "the gateway never got there"
        time.sleep(0.01)


def connect(gw: Any) -> socket.socket:
    url = urlsplit(gw.url)
    return socket.create_connection((url.hostname, url.port), timeout=DEADLINE_S)


def read_to_close(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a reset counts as a close)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a content-length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response"
        data += chunk
    status, headers, body = parse(data)
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a response"
        body += chunk
    return status, headers, body


# -- headers --------------------------------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed(gw: Any) -> None:
    with connect(gw) as sock:
        assert read_to_close(sock) == b""  # nothing had begun: a plain close
    wait_for(lambda: open_here(gw) == 0)


def test_a_stalled_request_head_gets_408_and_is_closed(gw: Any) -> None:
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/compl")
        status, headers, _ = parse(read_to_close(sock))
    assert status == 408 and headers["connection"] == "close"
    wait_for(lambda: open_here(gw) == 0)


def test_a_trickled_request_head_is_cut_off(gw: Any) -> None:
    """Bytes that keep arriving do not extend the deadline: the head as a whole has one."""
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 1000 + b"\r\n\r\n"
    cut_off = False
    with connect(gw) as sock:
        for byte in head:  # about 20 s at this pace, 40 times the deadline
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # reset or broken pipe: the server has closed
                cut_off = True
                break
            time.sleep(0.02)
        if not cut_off:  # every byte went out (an unlikely slow machine): the server must have closed
            status, _, _ = parse(read_to_close(sock))
            cut_off = status == 408
    assert cut_off
    wait_for(lambda: open_here(gw) == 0)


def test_a_keep_alive_client_is_not_cut_off_between_requests(gw: Any) -> None:
    """Idle between requests is the keep-alive timeout's business, not the header deadline's."""
    with connect(gw) as sock:
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            status, _, body = read_response(sock)
            assert status == 200 and json.loads(body)["status"] == "ok"
            time.sleep(1.0)  # twice the header deadline, well under the keep-alive timeout


def test_well_behaved_clients_are_unaffected(gw: Any) -> None:
    rollout = new_rollout(gw)
    client = OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0)
    with client:
        for _ in range(3):
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi " * 100}]
            )
            assert reply.choices[0].message.content == "Hello from the script."
            time.sleep(1.0)  # the SDK's pooled connection, reused after the header deadline


# -- bodies ---------------------------------------------------------------------------------------

TIMED_OUT = "request_timeout"
STALLED_BODY = [
    # (path, key header, what tells the caller's dialect)
    ("/v1/chat/completions", "authorization: Bearer {key}", lambda e: e["error"]["code"] == TIMED_OUT),
    ("/v1/messages", "x-api-key: {key}", lambda e: e["error"]["type"] == "invalid_request_error"),
    ("/v1beta/models/m:generateContent", "x-goog-api-key: {key}", lambda e: e["error"]["code"] == 408),
]


@pytest.mark.parametrize(("path", "key_header", "in_dialect"), STALLED_BODY)
def test_a_stalled_body_gets_408_in_the_callers_dialect(
    gw: Any, path: str, key_header: str, in_dialect: Callable[[Any], bool]
) -> None:
    rollout = new_rollout(gw)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: x\r\n{key_header.format(key=rollout['api_key'])}\r\n"
        "anthropic-version: 2023-06-01\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    )
    with connect(gw) as sock:
        sock.sendall(head.encode() + b'{"model": "m"')
        status, headers, body = parse(read_to_close(sock))
    assert status == 408 and headers["connection"] == "close"
    assert in_dialect(json.loads(body))
    wait_for(lambda: open_here(gw) == 0)


def test_a_trickled_body_is_cut_off(gw: Any) -> None:
    """The body as a whole has one deadline, however steadily its bytes come."""
    rollout = new_rollout(gw)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 900}]}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {rollout['api_key']}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with connect(gw) as sock:
        sock.sendall(head.encode())
        for byte in body:  # about 20 s at this pace, 40 times the deadline
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.02)
        answered = read_to_close(sock)
    status, _, reply = parse(answered)
    assert status == 408 and json.loads(reply)["error"]["code"] == TIMED_OUT


def test_an_admin_body_is_timed_too(gw: Any) -> None:
    head = (
        f"POST /admin/rollouts HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {gw.gateway.admin_token}\r\n"
        "content-type: application/json\r\ncontent-length: 100\r\n\r\n"
    )
    with connect(gw) as sock:
        sock.sendall(head.encode() + b"{")
        status, _, _ = parse(read_to_close(sock))
    assert status == 408


# -- connections per peer ------------------------------------------------------------------------


def test_the_cap_refuses_one_more_connection_while_it_is_full(capped: Any) -> None:
    wait_for(lambda: open_here(capped) == 0)
    idle = [connect(capped) for _ in range(CAP)]
    try:
        wait_for(lambda: open_here(capped) == CAP)  # all taken in, none refused
        with connect(capped) as extra:
            status, headers, body = parse(read_to_close(extra))
        assert status == 503 and headers["connection"] == "close" and b"Too many" in body
        assert open_here(capped) == CAP
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: open_here(capped) == 0)
    assert httpx.get(capped.url + "/health", timeout=DEADLINE_S).status_code == 200


def test_a_websocket_counts_until_it_closes(capped: Any) -> None:
    rollout = new_rollout(capped)
    wait_for(lambda: open_here(capped) == 0)
    url = rollout["base_url"].replace("http://", "ws://") + "/v1/responses"
    headers = {"authorization": f"Bearer {rollout['api_key']}"}
    with websockets.sync.client.connect(url, additional_headers=headers, open_timeout=DEADLINE_S):
        idle = [connect(capped) for _ in range(CAP - 1)]
        wait_for(lambda: open_here(capped) == CAP)
        with connect(capped) as extra:
            assert parse(read_to_close(extra))[0] == 503
    wait_for(lambda: open_here(capped) == CAP - 1)  # the socket's close gave its place back
    for sock in idle:
        sock.close()
    wait_for(lambda: open_here(capped) == 0)
