"""The worker side of the openforge rollout replica: veRL's `BaseRollout` in each training worker.

veRL's hybrid workers (`ActorRolloutRefWorker`) build one rollout adapter each
(`get_rollout_class(rollout.name, rollout.mode)`) and, after every update, hand it the actor's
full weights as `(name, tensor)` pairs (`update_weights`, checkpoint engine "naive"). This adapter
gathers them on the CPU and sends them to its replica's `OpenForgeServer` (`replica.py`), found by
its Ray actor name; only the first worker of each replica sends (the others hold the same full
tensors: FSDP's `get_per_tensor_param` gathers every shard on every rank).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout

from openforgerl.integrations.verl.replica import server_name

log = logging.getLogger(__name__)


class OpenForgeRolloutAdapter(BaseRollout):
    """veRL's rollout adapter for `rollout.name: openforge` (see the module doc)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.server: Any = None
        self.syncs = 0

    def _server(self) -> Any:
        if self.server is None:
            self.server = ray.get_actor(server_name(self.replica_rank))
        return self.server

    async def resume(self, tags: list[str]) -> None:
        return None  # the engine never frees its weights or cache

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the openforge rollout takes full named tensors, not {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the openforge rollout takes merged weights (model.lora.merge=true)")
        t0 = time.monotonic()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in weights:  # every rank must drain the generator: it runs collectives
            if self.rollout_rank == 0:
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                state[name] = full.detach().to("cpu", copy=True).contiguous()
        if self.rollout_rank != 0:
            return
        version = await self._server().update_weights.remote(state, global_steps)
        self.syncs += 1
        log.info(
            "openforge rollout %d: %d tensors synced (engine version %s, step %s) in %.2fs",
            self.replica_rank,
            len(state),
            version,
            global_steps,
            time.monotonic() - t0,
        )
