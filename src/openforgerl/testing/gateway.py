"""Run a gateway on a free loopback port in a background thread (tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from openforgerl.engines.base import Engine
from openforgerl.gateway.app import Gateway
from openforgerl.gateway.server import GatewayConfig, build_app


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
def gateway_thread(cfg: GatewayConfig, engine: Engine | None = None) -> Iterator[RunningGateway]:
    cfg.port = cfg.port or free_port()
    cfg.admin_token = cfg.admin_token or "test-admin"
    app, gateway = build_app(cfg, engine)
    server = uvicorn.Server(
        uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False, backlog=4096)
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield RunningGateway(f"http://{cfg.host}:{cfg.port}", gateway, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
