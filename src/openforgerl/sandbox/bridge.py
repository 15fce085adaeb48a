"""A byte relay from a sandbox without network to the gateway, through a Unix socket bound into it.

Host end: `HostBridge` forwards each connection on the socket to the gateway's TCP address.
Inside end: `python -I -S bridge.py PORT SOCKET -- CMD...` listens on 127.0.0.1:PORT in the sandbox's
own network namespace, forwards each connection to SOCKET, and execs CMD. The listener is bound before
CMD starts, so CMD never races it. Standard library only: it runs under the bare interpreter inside.
asyncio is imported where it is used, so that CMD starts without waiting for it.
"""

from __future__ import annotations

import os
import socket
import sys

# Not `typing.TYPE_CHECKING`: importing typing would delay every command started through the bridge.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Awaitable, Callable

    Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        # A reset on one side ends the other too (closing its writer ends the opposite pipe's read).
        writer.close()


async def _splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    connect: Connect,
    live: set[asyncio.StreamWriter],
) -> None:
    import asyncio

    try:
        up_reader, up_writer = await connect()
    except OSError:
        writer.close()
        return
    live.update((writer, up_writer))
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        for w in (writer, up_writer):
            w.close()
            live.discard(w)


class HostBridge:
    """The host end: each connection on the Unix socket `path` goes to host:port."""

    def __init__(self, path: str, host: str, port: int) -> None:
        self.path, self.host, self.port = path, host, port
        self._server: asyncio.Server | None = None
        self._live: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        import asyncio

        # A Unix socket path must fit in 108 bytes; a deep state dir does not. Binding through the
        # directory's /proc/self/fd link keeps the name short and puts the socket in the same place.
        dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/{os.path.basename(self.path)}")
        except OSError:
            sock.close()
            raise
        finally:
            os.close(dir_fd)
        self._server = await asyncio.start_unix_server(self._handle, sock=sock)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import asyncio

        await _splice(reader, writer, lambda: asyncio.open_connection(self.host, self.port), self._live)

    def close(self) -> None:
        """Stop accepting and cut every open connection (closing a writer ends its reader too)."""
        if self._server is not None:
            self._server.close()
        for w in list(self._live):
            w.close()


async def _serve_inside(listener: socket.socket, path: str) -> None:
    import asyncio

    live: set[asyncio.StreamWriter] = set()
    server = await asyncio.start_server(
        lambda r, w: _splice(r, w, lambda: asyncio.open_unix_connection(path), live), sock=listener
    )
    await server.serve_forever()


def main(argv: list[str]) -> None:
    port, path, sep, *cmd = argv
    if sep != "--" or not cmd:
        sys.exit("usage: bridge.py PORT SOCKET -- CMD...")
    listener = socket.create_server(("127.0.0.1", int(port)), backlog=128)
    # Double fork: the relay is re-parented to the sandbox's init (which kills it when CMD ends), so
    # CMD never finds an unknown child of its own.
    if os.fork() == 0:
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            import asyncio

            asyncio.run(_serve_inside(listener, path))
        os._exit(0)
    os.wait()
    listener.close()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"{cmd[0]}: {e.strerror}", file=sys.stderr)
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    main(sys.argv[1:])
