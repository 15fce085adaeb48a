"""Run a gateway on a free loopback port in a background thread (tests and benchmarks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from openforgerl.engines.base import Engine
from openforgerl.gateway.server import GatewayConfig, RunningGateway, free_port, serve_in_thread

__all__ = ["RunningGateway", "free_port", "gateway_thread"]


@contextlib.contextmanager
def gateway_thread(cfg: GatewayConfig, engine: Engine | None = None) -> Iterator[RunningGateway]:
    cfg.admin_token = cfg.admin_token or "test-admin"
    with serve_in_thread(cfg, engine) as gw:
        yield gw
