"""What serves a run while it runs: its engine, the embedded gateway in front of it, and the
rollout service on that gateway, started in that order and closed in the reverse one.

    with serving(model_dir, run.gateway_store, backend=opts.backend, run_id=run.name,
                 max_tokens=256, temperature=0.7) as stack:
        results = stack.service.run(tasks, n, job)
        stack.load_weights(checkpoint)          # new weights into the engine, on the gateway's loop

The gateway's settings are `GatewayConfig`'s (gateway/config.py), declared there once: a recipe
names those it sets; the run owns the rest of an embedded gateway's: a free port, the address its
sandboxes reach (the backend's `gateway_host`), the store in the run folder. The engine is the one
given (tests, the oracle teacher, veRL's), or the one a spec names (builtin, vllm:URL,
sglang:URL), started at the run's policy version. The engine's async API lives on the gateway's
event loop (docs/architecture.md, "Who runs where"): `load_weights` hands it over there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from openforgerl.engines import make_engine
from openforgerl.engines.base import PREFIX_CACHE_MB, Engine
from openforgerl.gateway.server import GatewayConfig, RunningGateway, serve_in_thread
from openforgerl.rollouts.service import RolloutService
from openforgerl.sandbox.choice import BackendChoice

T = TypeVar("T")


def gateway_config(
    model: str | Path, store: str | Path, backend: BackendChoice | None = None, **settings: Any
) -> GatewayConfig:
    """An embedded gateway's settings: `settings` (GatewayConfig's fields) on a free port, at the
    address the backend's sandboxes reach, recording into `store`."""
    host = backend.gateway_host if backend is not None else GatewayConfig.host
    return GatewayConfig(model=str(model), host=host, port=0, store=str(store), **settings)


def start_engine(
    spec: str,
    model_dir: Path,
    version: int,
    *,
    threads: int | None = None,
    prefix_cache_mb: float = PREFIX_CACHE_MB,
) -> tuple[Engine, bool]:
    """The engine of `spec` and whether `model_dir` must be pushed into it before the first rollout.

    The builtin engine loads `model_dir` itself: a resumed run's engine starts on the checkpoint's
    weights, so its calls carry that version. A server holds weights of its own: it starts one
    version back, and the push of `model_dir` brings it to `version`.
    """
    if spec == "builtin":
        engine = make_engine(
            spec, str(model_dir), policy_version=version, threads=threads, prefix_cache_mb=prefix_cache_mb
        )
        return engine, False
    return make_engine(spec, str(model_dir), policy_version=version - 1), True


@dataclass
class RunStack:
    """A run's engine, the embedded gateway serving it, and the rollout service on that gateway."""

    engine: Engine
    gateway: RunningGateway
    service: RolloutService

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The gateway's event loop, which owns the engine's async API."""
        return self.gateway.loop

    def on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the gateway's loop and wait for its result."""
        if not self.loop.is_running():  # the gateway's thread has ended: nothing would ever run it
            coro.close()
            raise RuntimeError("the gateway's event loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def load_weights(self, weights: Path) -> int:
        """Load `weights` into the engine in place (an absolute path: a server resolves paths on its
        side); returns the engine's new policy version."""
        return self.on_loop(self.engine.load_weights(str(weights.resolve())))


@contextlib.contextmanager
def serving(
    model: str | Path,
    store: str | Path,
    *,
    engine: Engine | str | None = None,
    policy_version: int = 0,
    backend: BackendChoice | None = None,
    run_id: str = "",
    **settings: Any,
) -> Iterator[RunStack]:
    """The run's engine, gateway and rollout service for the block; the gateway closes the engine
    (and its store) as it stops. `engine`: one already made (tests, the oracle teacher, veRL's),
    or the spec of one to start on `model` at `policy_version` (builtin, vllm:URL, sglang:URL;
    None: builtin); a server is first loaded with `model`, which brings it to that version.
    `settings` are the rest of GatewayConfig's fields (max_tokens, temperature...). Sandboxes are
    the backend's for `run_id` (local ones without a backend)."""
    push_first = False
    if engine is None or isinstance(engine, str):  # a spec: the run starts its engine here
        cfg = gateway_config(model, store, backend, engine=engine or GatewayConfig.engine, **settings)
        engine, push_first = start_engine(
            cfg.engine,
            Path(model),
            policy_version,
            threads=cfg.engine_threads,
            prefix_cache_mb=cfg.prefix_cache_mb,
        )
    else:
        cfg = gateway_config(model, store, backend, **settings)
    sandboxes = backend.make(run_id) if backend is not None else None
    with serve_in_thread(cfg, engine) as gateway:
        stack = RunStack(engine, gateway, RolloutService.of(gateway, sandboxes))
        if push_first:  # a server holds weights of its own: the run's model first
            version = stack.load_weights(Path(model))
            if version != policy_version:
                raise RuntimeError(f"the engine is at policy version {version}, the run at {policy_version}")
        yield stack
