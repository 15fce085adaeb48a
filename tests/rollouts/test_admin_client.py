"""The runner's admin client against a server that closes a kept-alive connection as a request
arrives on it: what uvicorn does to a connection idle for its 5 s keep-alive, and httpx reuses one
that old. The rollout's calls must still be read (a rollout of about 5 s lost its behaviour metrics
so), on a fresh connection."""

from __future__ import annotations

import asyncio
import json

from openforgerl.rollouts.admin import AdminClient


async def _server(served: list[str]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # One request per connection answered; the next one on it meets a close, not a response.
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = next((int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length")), 0)
        await reader.readexactly(length)
        path = head.split(b" ")[1].decode()
        served.append(path)
        if path == "/admin/rollouts":
            body = json.dumps({"rollout_id": "ro_1", "api_key": "k"}).encode()
        else:
            body = json.dumps({"rollout_id": "ro_1", "calls": []}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        try:
            await reader.readuntil(b"\r\n\r\n")  # the client reused the connection
        except asyncio.IncompleteReadError:
            pass  # or closed it
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_calls_are_read_when_the_server_closes_the_reused_connection() -> None:
    async def go() -> object:
        served: list[str] = []
        server = await _server(served)
        port = server.sockets[0].getsockname()[1]
        async with server, AdminClient(f"http://127.0.0.1:{port}", "token") as admin:
            opened = await admin.open_rollout("run", "task", {}, {})
            calls = await admin.calls(opened.rollout_id)
        assert served == ["/admin/rollouts", "/admin/rollouts/ro_1/calls"]
        return calls

    assert asyncio.run(go()) == []
