"""Engines as the engine tests run them: the built-in one started and closed around a test, the
FAKE SGLang server (openforgerl.testing.fake_sglang) on a loopback port, and a poll."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette

from openforgerl.engines.base import Engine
from openforgerl.engines.sglang import SGLangEngine
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.testing.fake_sglang import FakeSGLangState, fake_sglang_app

T = TypeVar("T")


@asynccontextmanager
async def running(model_dir: Path, **kwargs: Any) -> AsyncIterator[TransformersEngine]:
    engine = TransformersEngine(model_dir, device="cpu", **kwargs)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    app: Starlette

    @property
    def fake(self) -> FakeSGLangState:
        state: FakeSGLangState = self.app.state.fake
        return state


@contextmanager
def serve(app: Starlette) -> Iterator[Served]:
    """Run `app` under uvicorn on a free loopback port in a background thread."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake SGLang server did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def fake_server(engine: Engine, **kw: Any) -> Iterator[Served]:
    with serve(fake_sglang_app(engine, **kw)) as s:
        yield s


async def until(predicate: Callable[[], bool], within_s: float = 5.0) -> bool:
    """Poll `predicate` until it holds or `within_s` passes; whether it held."""
    for _ in range(int(within_s / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def run_sglang(fn: Callable[[SGLangEngine], Awaitable[T]], url: str, **kw: Any) -> T:
    """Start an SGLangEngine on `url`, run `fn(engine)`, close it."""

    async def main() -> T:
        eng = SGLangEngine(url, start_timeout=5.0, **kw)
        try:
            await eng.start()
            return await fn(eng)
        finally:
            await eng.close()

    return asyncio.run(main())
