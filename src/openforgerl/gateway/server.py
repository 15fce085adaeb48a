"""Assemble and serve a gateway: engine + chat template + store + HTTP app."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette

from openforgerl.engines import make_engine
from openforgerl.engines.base import Engine
from openforgerl.gateway.app import Gateway
from openforgerl.gateway.config import GatewayConfig as GatewayConfig
from openforgerl.gateway.connections import ConnectionLimits, protocol_class
from openforgerl.gateway.core import GatewayCore
from openforgerl.gateway.upstream import Upstream
from openforgerl.gateway.workers import Workers
from openforgerl.rendering import renderer_for
from openforgerl.sampling import SamplingPolicy
from openforgerl.store import Store


def build_app(cfg: GatewayConfig, engine: Engine | None = None) -> tuple[Starlette, Gateway]:
    """The ASGI app; the engine starts and the store closes with the app's lifespan."""
    renderer = renderer_for(cfg.model)  # a VisionRenderer for a vision-language model directory
    engine = engine or make_engine(
        cfg.engine, cfg.model, threads=cfg.engine_threads, prefix_cache_mb=cfg.prefix_cache_mb
    )
    upstreams = {spec.name: Upstream(spec) for spec in cfg.upstreams}
    if len(upstreams) != len(cfg.upstreams):
        raise ValueError("two upstreams have the same name")
    store = Store(Path(cfg.store), durability=cfg.durability)
    core = GatewayCore(
        engine,
        renderer,
        store,
        policy=SamplingPolicy(cfg.temperature, cfg.top_p, cfg.max_tokens, cfg.max_context),
        max_context=cfg.max_context,
        max_inflight=cfg.max_inflight,
        upstreams=upstreams,
        workers=Workers(cfg.work_threads),
    )
    gateway = Gateway(
        core,
        admin_token=cfg.admin_token or secrets.token_urlsafe(24),
        public_url=cfg.public_url or f"http://{cfg.host}:{cfg.port}",
        max_body=cfg.max_body,
    )
    app = gateway.app()
    app.state.body_timeout_s = cfg.body_timeout_s  # read by http.read_body

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.close()
            for upstream in upstreams.values():
                await upstream.aclose()
            await store.close()
            core.workers.close()

    app.router.lifespan_context = lifespan
    return app, gateway


def server_options(cfg: GatewayConfig) -> dict[str, Any]:
    """uvicorn's settings for a gateway, the same for `serve` and `serve_in_thread`."""
    limits = ConnectionLimits(cfg.header_timeout_s, cfg.max_connections_per_peer)
    return {
        "host": cfg.host,
        "port": cfg.port,
        "http": protocol_class(limits),  # httptools (uvicorn's default here) with connection limits
        "log_level": "warning",
        "access_log": False,
        "backlog": 4096,
        "ws_max_size": cfg.max_body,
    }


def serve(cfg: GatewayConfig) -> None:
    app, gateway = build_app(cfg)
    if not cfg.admin_token:
        print(f"admin token: {gateway.admin_token}", flush=True)
    for spec in cfg.upstreams:
        missing = (
            "" if os.environ.get(spec.env) else f" (WARNING: ${spec.env} is not set: its calls will fail)"
        )
        print(f"upstream {spec.describe()}{missing}", flush=True)
    uvicorn.run(app, timeout_keep_alive=75, **server_options(cfg))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GATEWAY_START_S = 120.0  # the gateway's own start (a built-in engine loads its model in it)


@dataclass
class RunningGateway:
    url: str
    gateway: Gateway
    loop: asyncio.AbstractEventLoop

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.gateway.admin_token}"}


@contextlib.contextmanager
def serve_in_thread(cfg: GatewayConfig, engine: Engine | None = None) -> Iterator[RunningGateway]:
    """A gateway on its own event loop in a background thread (port 0: a free port is picked).

    The embedded default for one machine: `openforge eval` runs its rollouts against one of these.
    """
    cfg.port = cfg.port or free_port()
    cfg.admin_token = cfg.admin_token or secrets.token_urlsafe(24)
    app, gateway = build_app(cfg, engine)
    config = uvicorn.Config(app, **server_options(cfg))
    # The engine starts in the gateway's lifespan: a server engine (a vLLM CPU build compiles its
    # graphs first) has a start deadline of its own, which the gateway's wait must not cut short.
    wait = GATEWAY_START_S + float(getattr(gateway.core.engine, "start_timeout", 0.0))
    with uvicorn_in_thread(config, "the gateway", start_timeout=wait, stop_timeout=60) as loop:
        yield RunningGateway(f"http://{cfg.host}:{cfg.port}", gateway, loop)


@contextlib.contextmanager
def uvicorn_in_thread(
    config: uvicorn.Config, what: str, *, start_timeout: float, stop_timeout: float
) -> Iterator[asyncio.AbstractEventLoop]:
    """Serve `config` on a new event loop in a daemon thread; yields that loop once it has started.

    On exit the server is told to stop and its thread is given `stop_timeout` seconds to end.
    """
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True  # one still starting stops as soon as it can, serving nothing
            raise RuntimeError(f"{what} did not start within {start_timeout:.0f} s")
        time.sleep(0.02)
    try:
        yield loop
    finally:
        server.should_exit = True
        thread.join(timeout=stop_timeout)
