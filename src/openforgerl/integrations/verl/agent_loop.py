"""`OpenForgeAgentLoop`: one veRL rollout = one OpenForgeRL rollout (harness, sandbox, verifier).

veRL builds an agent loop per dataset row (with hydra, from the registry entry "openforge" that
importing this module adds; the `verl.plugins` entry point imports it in every veRL process) and
awaits `run(sampling_params, **row)`. Ours:

1. reads the task from the row (`data.task_from_row`: `extra_info.task`, or `tasks` + `task_id`);
2. opens a rollout on this worker process's gateway (one per process, started on first use, shared
   by all loops), whose engine is veRL's own `server_manager` (`engine.VerlServerEngine`), with
   veRL's temperature and top_p as the rollout's sampling;
3. runs the task through the rollouts service (`rollouts/service.py`): a local sandbox (bubblewrap
   where present), the harness (the task's, else `openforge.harness`: the built-in ReAct harness by
   default), the verifier;
4. returns the merged samples the service built of the calls the gateway recorded as
   `list[AgentLoopOutput]` (V1 trainer; the legacy trainer gets the single
   sample, or an error naming the fix when the rollout branched).

Options come from the trainer config's `openforge:` section (see `LoopOptions`), and from keyword
arguments when the loop is declared in an `agent_loop_config_path` file (those win).

Failures: infrastructure that fails every retry raises (veRL marks the prompt's group failed);
a rollout dropped by `on_failure: drop`, or one without any model call, returns no output.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from openforgerl.harnesses.launch import HarnessChoice, LaunchOptions
from openforgerl.integrations.verl.data import AGENT_NAME, task_from_row
from openforgerl.integrations.verl.engine import ServerManager, VerlServerEngine
from openforgerl.integrations.verl.samples import split_sample
from openforgerl.rollouts.results import RolloutResult, Status
from openforgerl.rollouts.service import RolloutJob, RolloutService
from openforgerl.rollouts.settings import OnFailure, OnTimeout
from openforgerl.run.folder import RunFolder
from openforgerl.run.stack import serving
from openforgerl.sampling import derive_seed
from openforgerl.tasks import Task

log = logging.getLogger(__name__)


class RolloutInfraError(RuntimeError):
    """The infrastructure (sandbox, verifier) failed every retry: not the policy's fault."""


@dataclass
class LoopOptions:
    """The `openforge:` section of the trainer config."""

    harness: str = "react"  # for tasks that name none: "react" or a name in openforgerl.harnesses
    harness_cache: str | None = None  # install folder of CLI harnesses (default: theirs)
    max_turns: int = 8  # ReAct harness turns (a task's harness_options.max_turns wins)
    max_tokens: int | None = None  # per model call; None: rollout.response_length
    max_context: int | None = None  # prompt + completion of one call; None: veRL's max model length
    on_failure: OnFailure = "zero"  # a crashed harness: reward 0, dropped, or verified
    # A harness stopped by the task's wall clock: left out of the update ("exclude": how long a rollout
    # takes depends on the machine's load) or scored 0 ("zero"), as in `openforge train --on-timeout`.
    on_timeout: OnTimeout = "exclude"
    infra_retries: int = 2
    include_side_requests: bool = True  # titles, routers: their own samples, with the reward
    store_dir: str | None = None  # where each worker's gateway writes its SQLite file; None: a temp dir
    # Seeded sampling: a rollout's calls draw seeds from (seed, step, task, sample); None: unseeded.
    seed: int | None = None
    # Read by the launcher, not the loop: "cpu" runs veRL on the project's CPU platform.
    device: str | None = None
    # The reward: the task's verifier ("verifier"), or veRL's reward loop ("verl": the loop leaves
    # reward_score unset and veRL's reward manager scores the sequence, e.g. with
    # reward.custom_reward_function.path).
    reward: str = "verifier"
    # Also write every output handed to veRL (ids, mask, logprobs, rollout id) as JSON Lines next to
    # the gateway's store (store_dir): for audits and tests.
    dump_outputs: bool = False

    @classmethod
    def build(cls, section: Any, overrides: Mapping[str, Any]) -> LoopOptions:
        values: dict[str, Any] = {}
        if isinstance(section, DictConfig):
            values.update(OmegaConf.to_container(section, resolve=True))  # type: ignore[arg-type]
        elif section is not None:
            values.update(section)
        values.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown openforge options {sorted(unknown)}; known: {sorted(known)}")
        options = cls(**values)
        if options.reward not in ("verifier", "verl"):
            raise ValueError(f"openforge.reward={options.reward!r}: 'verifier' or 'verl'")
        if options.dump_outputs and not options.store_dir:
            raise ValueError("openforge.dump_outputs needs openforge.store_dir (where the outputs go)")
        return options


@dataclass
class WorkerGateway:
    """The gateway of one worker process, serving veRL's server manager to every loop in it."""

    url: str
    admin_token: str
    engine: VerlServerEngine
    store: Path
    service: RolloutService  # its rollouts, in local sandboxes
    _stack: contextlib.ExitStack = field(repr=False)

    def close(self) -> None:
        self._stack.close()


_GATEWAYS: dict[tuple[int, int], WorkerGateway] = {}
_GATEWAYS_LOCK = threading.Lock()


def worker_gateway(
    server_manager: ServerManager,
    loop: asyncio.AbstractEventLoop,
    *,
    model: str,
    max_context: int,
    max_tokens: int,
    base_params: Mapping[str, Any],
    store_dir: str | None,
) -> WorkerGateway:
    """This process's gateway for (server manager, event loop), started on first use (blocking)."""
    key = (id(server_manager), id(loop))
    with _GATEWAYS_LOCK:
        gw = _GATEWAYS.get(key)
        if gw is not None and gw.engine.server_manager is server_manager and gw.engine.loop is loop:
            return gw
        if gw is not None:  # ids reused by new objects: the old gateway serves nobody any more
            gw.close()
        engine = VerlServerEngine(server_manager, loop, max_context=max_context, base_params=base_params)
        folder = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="openforge-verl-"))
        folder.mkdir(parents=True, exist_ok=True)
        store = folder / f"gateway-{os.getpid()}-{len(_GATEWAYS)}.db"
        stack = contextlib.ExitStack()
        served = stack.enter_context(
            serving(
                model,
                store,
                engine=engine,
                max_tokens=max_tokens,
                max_context=max_context,
                # Per rollout, the runner sets veRL's temperature and top_p (train or validation).
                temperature=1.0,
                top_p=1.0,
                durability="normal",  # veRL's step is the unit of recovery, not a single call
            )
        )
        gw = WorkerGateway(
            served.gateway.url, served.gateway.gateway.admin_token, engine, store, served.service, stack
        )
        if not _GATEWAYS:
            atexit.register(close_worker_gateways)
        _GATEWAYS[key] = gw
        log.info("openforge gateway for veRL at %s (store %s)", gw.url, store)
        return gw


def worker_gateways() -> list[WorkerGateway]:
    """The gateways this process runs (for inspection: their stores hold every recorded call)."""
    with _GATEWAYS_LOCK:
        return list(_GATEWAYS.values())


def close_worker_gateways() -> None:
    """Stop every gateway of this process (at exit; tests call it to clean up)."""
    with _GATEWAYS_LOCK:
        gateways = list(_GATEWAYS.values())
        _GATEWAYS.clear()
    for gw in gateways:
        gw.close()


def _plain(value: Any) -> Any:
    """A row value as plain Python: the V1 trainer hands 0-d tensors (global_steps), numpy scalars."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        return item()
    return value


def rollout_seed(options: LoopOptions, task: Task, row: Mapping[str, Any]) -> int | None:
    """A rollout's seed: distinct per trainer step, task and sample of its GRPO group (veRL's
    `session_id`), the same on every rerun; None when `openforge.seed` is unset."""
    if options.seed is None:
        return None
    step = _plain(row.get("global_steps", 0))
    session = _plain(row.get("session_id", 0))
    validate = bool(_plain((row.get("trajectory") or {}).get("validate", False)))
    parts = (f"step{step}", f"sample{session}", f"val{int(validate)}")
    return derive_seed(options.seed, task.id, *parts)


@register(AGENT_NAME)
class OpenForgeAgentLoop(AgentLoopBase):
    """veRL's agent loop that runs the row's task through OpenForgeRL (see the module doc)."""

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: Any,
        data_config: Any,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("tools", None)  # veRL's own tools: the harness brings its own
        kwargs.pop("name", None)  # an agent_loop_config_path entry's own name
        hf_model_type = kwargs.pop("hf_model_type", None)
        super().__init__(
            trainer_config,
            server_manager,
            tokenizer,
            processor,
            dataset_cls,
            data_config,
            hf_model_type=hf_model_type,
        )
        self.options = LoopOptions.build(self.config.get("openforge"), kwargs)
        if self.config.actor_rollout_ref.model.get("custom_chat_template") is not None:
            raise ValueError(
                "actor_rollout_ref.model.custom_chat_template is not supported by the openforge agent loop: "
                "its gateway renders prompts with the model directory's own chat template"
            )
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.use_v1 = bool(self.config.trainer.get("use_v1", True))

    # -- the gateway ----------------------------------------------------------------------
    def _gateway_settings(self) -> dict[str, Any]:
        rollout = self.rollout_config
        max_model_len = rollout.get("max_model_len") or self.prompt_length + self.response_length
        max_context = min(self.options.max_context or max_model_len, max_model_len)
        max_tokens = min(self.options.max_tokens or self.response_length, self.response_length)
        model = str(getattr(self.tokenizer, "name_or_path", "") or "")
        if not model:
            raise ValueError("veRL's tokenizer names no model directory (the gateway's chat template)")
        return {
            "model": model,
            "max_context": int(max_context),
            "max_tokens": int(max_tokens),
            "base_params": {"top_k": int(rollout.get("top_k", -1)), "repetition_penalty": 1.0},
            "store_dir": self.options.store_dir,
        }

    async def gateway(self) -> WorkerGateway:
        loop = asyncio.get_running_loop()
        settings = self._gateway_settings()
        return await asyncio.to_thread(worker_gateway, self.server_manager, loop, **settings)

    def _job(
        self, task: Task, sampling_params: Mapping[str, Any], row: Mapping[str, Any], state: Path
    ) -> RolloutJob:
        """The row's rollout: the task's harness (harnesses/launch.py: the same choice as `openforge
        train`), veRL's temperature and top_p, the loop's failure options."""
        o = self.options
        cache = Path(o.harness_cache) if o.harness_cache else None
        choice = HarnessChoice(o.harness, LaunchOptions(o.max_turns, o.max_tokens, cache_dir=cache))
        run_id = "verl-step{}-{}-{}".format(
            _plain(row.get("global_steps", "")), _plain(row.get("uid", "")), _plain(row.get("session_id", ""))
        )
        return RolloutJob(
            choice,
            run_id=run_id,
            state_path=RunFolder(state).runner_state,
            concurrency=1,
            infra_retries=o.infra_retries,
            on_failure=o.on_failure,
            exclude_timeouts=o.on_timeout == "exclude",
            sampling={
                "temperature": float(sampling_params.get("temperature", 1.0)),
                "top_p": float(sampling_params.get("top_p", 1.0)),
            },
            include_side_requests=o.include_side_requests,
            seed=rollout_seed(self.options, task, row),
        )

    # -- one rollout ------------------------------------------------------------------------
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """Run the row's task once; `list[AgentLoopOutput]` (V1) or one `AgentLoopOutput` (legacy)."""
        t0 = time.monotonic()
        task = task_from_row(_plain(kwargs.get("extra_info")))
        gw = await self.gateway()
        with tempfile.TemporaryDirectory(prefix="openforge-verl-run-") as tmp:
            job = self._job(task, sampling_params, kwargs, Path(tmp))
            job.harness.check([task])
            [result] = await gw.service.collect([task], 1, job)
        if result.status == Status.INFRA_FAILED:
            raise RolloutInfraError(
                f"task {task.id}: the infrastructure failed ({result.outcome}): "
                f"{result.details.get('infra_errors')}"
            )
        if result.status == Status.DROPPED or not result.gateway_rollout_id:
            return self._finish([])
        assert result.reward is not None, "a done rollout has a reward"
        if result.calls is None:
            raise RuntimeError(
                f"task {task.id}: the gateway gave no calls of rollout {result.gateway_rollout_id}"
            )
        outputs = self.to_outputs(result, time.monotonic() - t0)
        if self.options.dump_outputs:
            self._dump(outputs, kwargs)
        return self._finish(outputs)

    def _dump(self, outputs: list[AgentLoopOutput], row: Mapping[str, Any]) -> None:
        assert self.options.store_dir
        path = Path(self.options.store_dir) / f"outputs-{os.getpid()}.jsonl"
        with path.open("a", encoding="utf-8") as f:
            for out in outputs:
                record = {
                    "global_steps": _plain(row.get("global_steps")),
                    "uid": str(_plain(row.get("uid", ""))),
                    "session_id": _plain(row.get("session_id")),
                    "prompt_ids": out.prompt_ids,
                    "response_ids": out.response_ids,
                    "response_mask": out.response_mask,
                    "response_logprobs": out.response_logprobs,
                    "reward_score": out.reward_score,
                    "openforge": out.extra_fields.get("openforge"),
                    "min_global_steps": out.extra_fields.get("min_global_steps"),
                    "max_global_steps": out.extra_fields.get("max_global_steps"),
                }
                f.write(json.dumps(record) + "\n")

    def to_outputs(self, result: RolloutResult, seconds: float) -> list[AgentLoopOutput]:
        """The rollout's samples -> veRL outputs: prompt before the first sampled token, masks 1 on
        sampled ids."""
        reward = float(result.reward or 0.0)
        generate_s = sum(float(c.latency_ms or 0.0) for c in result.calls or ()) / 1000.0
        metrics = AgentLoopMetrics(
            generate_sequences=generate_s,
            # Everything else the harness did between model calls: tools, its own logic.
            tool_calls=max(0.0, result.seconds.get("harness", seconds) - generate_s),
            compute_score=result.seconds.get("verify", 0.0),
        )
        outputs = []
        for sample in result.samples:
            seq = split_sample(sample, self.prompt_length, self.response_length)
            if seq is None:
                continue
            if seq.truncated:
                log.warning(
                    "task %s: sample cut to veRL's limits (%d prompt, %d response tokens dropped)",
                    result.task_id,
                    seq.prompt_truncated,
                    seq.response_truncated,
                )
            extra: dict[str, Any] = {
                # Numbers only: veRL averages these per data source in validation.
                "reward_extra_info": {"score": reward, "truncated": float(seq.truncated)},
                "openforge": {
                    "task_id": result.task_id,
                    "rollout_id": result.gateway_rollout_id,
                    "outcome": result.outcome,
                    "branch_id": sample.branch_id,
                    "side_request": sample.side_request,
                    "calls": len(sample.call_ids),
                    "prompt_truncated": seq.prompt_truncated,
                    "response_truncated": seq.response_truncated,
                },
            }
            if sample.min_policy_version is not None:
                # veRL's staleness control reads the weight versions a trajectory was sampled with.
                extra["min_global_steps"] = sample.min_policy_version
                extra["max_global_steps"] = sample.max_policy_version
            outputs.append(
                AgentLoopOutput(
                    prompt_ids=seq.prompt_ids,
                    response_ids=seq.response_ids,
                    response_mask=seq.response_mask,
                    response_logprobs=seq.response_logprobs,
                    reward_score=reward if self.options.reward == "verifier" else None,
                    num_turns=len(sample.call_ids),  # the model's turns in this sequence
                    metrics=metrics.model_copy(),
                    extra_fields=extra,
                )
            )
        return outputs

    def _finish(self, outputs: list[AgentLoopOutput]) -> Any:
        if self.use_v1:
            return outputs
        if len(outputs) == 1:
            return outputs[0]
        raise ValueError(
            f"the rollout produced {len(outputs)} samples; veRL's legacy trainer takes exactly one per "
            "rollout: set trainer.use_v1=true"
        )
