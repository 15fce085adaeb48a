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
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from openforgerl.engines import make_engine
from openforgerl.engines.base import PREFIX_CACHE_MB, Engine
from openforgerl.gateway.app import Gateway
from openforgerl.gateway.core import GatewayCore
from openforgerl.gateway.upstream import Upstream, UpstreamSpec
from openforgerl.rendering import renderer_for
from openforgerl.sampling import SamplingPolicy
from openforgerl.store import Store


@dataclass
class GatewayConfig:
    model: str
    engine: str = "builtin"
    host: str = "127.0.0.1"
    port: int = 8000
    store: str = "openforge.db"
    admin_token: str = ""
    public_url: str = ""
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    max_tokens: int = 1024
    max_context: int | None = None  # prompt + completion; None: the model's own context length
    max_inflight: int = 1024
    max_body: int = 32 << 20
    durability: str = "full"
    # External models a rollout can be answered by instead of the policy (`"upstream": NAME`).
    upstreams: list[UpstreamSpec] = field(default_factory=list)
    engine_threads: int | None = None  # the built-in engine's CPU threads (None: torch's default)
    prefix_cache_mb: float = PREFIX_CACHE_MB  # the built-in engine's prefix cache (0: off)


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
    )
    gateway = Gateway(
        core,
        admin_token=cfg.admin_token or secrets.token_urlsafe(24),
        public_url=cfg.public_url or f"http://{cfg.host}:{cfg.port}",
        max_body=cfg.max_body,
    )
    app = gateway.app()

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

    app.router.lifespan_context = lifespan
    return app, gateway


def serve(cfg: GatewayConfig) -> None:
    app, gateway = build_app(cfg)
    if not cfg.admin_token:
        print(f"admin token: {gateway.admin_token}", flush=True)
    for spec in cfg.upstreams:
        missing = (
            "" if os.environ.get(spec.env) else f" (WARNING: ${spec.env} is not set: its calls will fail)"
        )
        print(f"upstream {spec.describe()}{missing}", flush=True)
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=75,
        backlog=4096,
        ws_max_size=cfg.max_body,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            access_log=False,
            backlog=4096,
            ws_max_size=cfg.max_body,
        )
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield RunningGateway(f"http://{cfg.host}:{cfg.port}", gateway, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
