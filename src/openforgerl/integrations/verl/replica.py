"""A veRL rollout replica served by OpenForgeRL's own engine (`rollout.name: openforge`).

veRL's V1 trainer samples through rollout replicas (`RolloutReplica`: vLLM, SGLang, TRT-LLM
servers as Ray actors) and syncs the trained weights into them each step. Where none of those runs
(a CPU machine), this replica serves the same interface with the project's `TransformersEngine`:

- `OpenForgeReplica.launch_servers` starts one `OpenForgeServer` Ray actor per replica on the node of
  the replica's first training worker (hybrid mode: veRL's colocated actor/rollout workers), named
  `openforge_server_{replica}_{node}` so the worker-side adapter (`rollout.OpenForgeRolloutAdapter`)
  finds it;
- `OpenForgeServer.generate(request_id, prompt_ids, sampling_params)` -> veRL's `TokenOutput`
  (sampled ids, their logprobs, `extra_fields["global_steps"]`: the weights' trainer step), what
  veRL's `LLMServerClient` and so our gateway's `VerlServerEngine` read;
- `OpenForgeServer.update_weights(named tensors, global_steps)`: the FSDP actor's full weights, copied
  into the engine in place once no request is mid-generation (so every sequence is sampled by one
  policy version), its prefix cache cleared.

Sampling: temperature, top_p, max_tokens, stop_token_ids, seed (reproducible); `logprobs` are the
sampled tokens' log-probabilities under logits / temperature (the engine's contract), which with
temperature 1 is what veRL's actor recomputes. top_k and repetition_penalty are not supported other
than as their neutral values (-1, 1.0): anything else is refused rather than ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

log = logging.getLogger(__name__)

NAME = "openforge"  # rollout.name, in veRL's replica and rollout-adapter tables
SERVER_PREFIX = "openforge_"
# A file to append one JSON line per weight sync to (replica, node, step, engine version, the L2 norm
# of the change, requests served so far): set in the trainer's environment for audits and tests.
SYNC_LOG_ENV = "OPENFORGE_VERL_SYNC_LOG"


def server_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_PREFIX}server_{replica_rank}_{node_rank}"


def _append_line(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def model_path(model_config: Any) -> str:
    """The model directory of veRL's model config (a DictConfig or an HFModelConfig)."""
    get = model_config.get if hasattr(model_config, "get") else lambda k, d=None: getattr(model_config, k, d)
    return str(get("local_path", None) or get("path"))


class OpenForgeServer:
    """A Ray actor holding one `TransformersEngine` (see the module doc)."""

    def __init__(self, model_path: str, max_model_len: int, max_batch_size: int, replica_rank: int) -> None:
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.replica_rank = replica_rank
        self.global_steps = 0
        self.engine: Any = None

    async def launch_server(self) -> None:
        from openforgerl.engines.transformers_engine import TransformersEngine

        threads = int(os.environ.get("OPENFORGE_ROLLOUT_THREADS", "0")) or None
        self.engine = TransformersEngine(
            self.model_path,
            device="cpu",
            max_batch_size=self.max_batch_size,
            max_context=self.max_model_len,
            threads=threads,
        )
        await self.engine.start()

    def get_server_address(self) -> tuple[str, int]:
        return f"{NAME}-replica-{self.replica_rank}", 0

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        from openforgerl.engines.base import SamplingParams

        if image_data or video_data:
            raise ValueError("the openforge rollout replica takes no images or videos")
        params = dict(sampling_params)
        top_k = int(params.pop("top_k", -1) or -1)
        penalty = float(params.pop("repetition_penalty", 1.0) or 1.0)
        if top_k not in (-1, 0) or penalty != 1.0:
            raise ValueError(f"unsupported sampling: top_k={top_k}, repetition_penalty={penalty}")
        room = max(1, self.max_model_len - len(prompt_ids))
        max_tokens = int(params.get("max_tokens") or params.get("max_new_tokens") or room)
        seed = params.get("seed")
        sampling = SamplingParams(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            max_tokens=min(max_tokens, room),
            stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()),
            seed=None if seed is None else int(seed),
        )
        steps = self.global_steps
        result = await self.engine.generate(list(prompt_ids), sampling)
        return TokenOutput(
            token_ids=list(result.completion_ids),
            log_probs=[float(x) for x in result.logprobs],
            stop_reason="aborted" if result.finish_reason == "abort" else "completed",
            extra_fields={"global_steps": steps},
        )

    async def update_weights(self, state: dict[str, Any], global_steps: int | None = None) -> int:
        sync_log = os.environ.get(SYNC_LOG_ENV)
        before = None
        if sync_log:  # the change the sync made, for audits and tests (a copy of every weight)
            before = {k: v.detach().clone() for k, v in self.engine._model.state_dict().items()}
        version = int(await self.engine.load_state(state))
        if global_steps is not None:
            self.global_steps = int(global_steps)
        if sync_log and before is not None:
            after = self.engine._model.state_dict()
            delta = sum(float((after[k].double() - v.double()).pow(2).sum()) for k, v in before.items())
            record = {
                "replica": self.replica_rank,
                "node_id": self.node_id(),
                "global_steps": self.global_steps,
                "version": version,
                "tensors": len(state),
                "delta_l2": delta**0.5,
                "requests": int(self.engine.stats.get("requests", 0)),
                "time": time.time(),
            }
            await asyncio.to_thread(_append_line, sync_log, json.dumps(record))
        return version

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    # The engine keeps its weights and KV in the process's memory: nothing to free or restore.
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        if self.engine is not None:
            self.engine.prefix_cache.clear()

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def engine_stats(self) -> dict[str, Any]:
        stats = dict(self.engine.stats)
        return {"stats": stats, "version": self.engine.policy_version, "steps": self.global_steps}


class OpenForgeReplica(RolloutReplica):
    """veRL's rollout replica over `OpenForgeServer` (hybrid mode: one per training worker group
    slice of `rollout.tensor_model_parallel_size` workers; the engine runs whole, unsharded)."""

    def rollout_worker_use_gpu(self) -> bool:
        return True

    async def launch_servers(self) -> None:
        assert self.workers, "the openforge replica runs in hybrid mode (colocated with the actor)"

        def node(worker: Any) -> str:
            return str(ray.get_runtime_context().get_node_id())

        node_ids: list[str] = list(await asyncio.gather(*[w.__ray_call__.remote(node) for w in self.workers]))
        max_model_len = int(
            self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        )
        server_cls: Any = ray.remote(OpenForgeServer)
        server: Any = server_cls.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_ids[0], soft=False
            ),
            name=server_name(self.replica_rank),
            max_concurrency=self.max_concurrency,
            num_cpus=0,
        ).remote(
            model_path=model_path(self.model_config),
            max_model_len=max_model_len,
            max_batch_size=min(int(self.config.max_num_seqs or 16), 32),
            replica_rank=self.replica_rank,
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        address, port = await server.get_server_address.remote()
        self._server_address = f"{address}:{port}"
        log.info("openforge rollout replica %d on node %s", self.replica_rank, node_ids[0])
