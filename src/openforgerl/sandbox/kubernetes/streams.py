"""The exec API's channels (one byte in front of each WebSocket message), as a command's stdin goes in
and its output and exit status come back."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from openforgerl.sandbox import base, container

# v5 can close stdin; servers that only know v4 pick it, and the wrapper's counted stdin does without.
EXEC_PROTOCOLS = "v5.channel.k8s.io,v4.channel.k8s.io"
_STDIN, _STDOUT, _STDERR, _STATUS, _CLOSE = 0, 1, 2, 3, 255
_CHUNK = 256 << 10


async def pump(ws: Any, stdin: container.Stdin | None, output: base.Output, status: bytearray) -> None:
    """Sends `stdin` (then closes it), and feeds what comes back to `output` and `status` until the
    stream ends."""
    if stdin is not None:
        for chunk in container.stdin_chunks(stdin, _CHUNK):
            await ws.send_bytes(bytes([_STDIN]) + chunk)
        await ws.send_bytes(bytes([_CLOSE, _STDIN]))
    async for msg in ws:
        if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
            break
        data = msg.data if isinstance(msg.data, bytes) else msg.data.encode()
        if not data:
            continue
        if data[0] == _STDOUT:
            output.stdout.feed(data[1:])
        elif data[0] == _STDERR:
            output.stderr.feed(data[1:])
        elif data[0] == _STATUS:
            status.extend(data[1:])


def exit_code(status: bytes) -> int:
    """The exit code in the exec's status (channel 3): Success, or NonZeroExitCode with an ExitCode."""
    try:
        doc = json.loads(status)
    except ValueError as e:
        raise container.StreamLost(f"unreadable exec status {status[:200]!r}") from e
    if doc.get("status") == "Success":
        return 0
    for cause in (doc.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    raise container.StreamLost(f"the command did not run: {doc.get('message', doc)}")
