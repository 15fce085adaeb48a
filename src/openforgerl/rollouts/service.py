"""The one seam between running agents and training on them: tasks in, one RolloutResult per rollout out.

    job = RolloutJob(HarnessChoice("react"), run_id="eval", state_path=out / "runner.db")
    job.check(tasks)                                    # before a model is loaded
    with serving(model_dir, out / "gateway.db") as stack:       # run/stack.py
        for r in stack.service.run(tasks, n, job):
            r.status, r.reward, r.calls, r.samples      # calls: typed records; samples: with r.reward

A service talks to one gateway (its URL and admin token): `RolloutService.of` takes a gateway this
process serves (the run layer's `run/stack.py` serving: engine, embedded gateway and service for a
run), `RolloutService(url, token)` a running one anywhere.

`run` (or `collect`, from inside an event loop) runs every task n times through the runner
(runner.py: sandboxes, harnesses, verifiers, and the run's durable state, so a rerun finishes only
what is left), then completes each result with what the gateway recorded: the calls the runner read
at close, or for a rollout an earlier process finished the calls read now through the admin client
(admin.py), and the samples built of them with the result's reward (trajectory.py). Eval
(evaluate.py), RL (rl/loop.py), SFT's teacher (rl/sft.py) and the veRL agent loop
(integrations/verl/agent_loop.py) take their rollouts from here; none of them reads the gateway's
calls or builds samples itself. The reward's one source of truth is the result (results.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from openforgerl.gateway.server import RunningGateway
from openforgerl.harnesses.launch import HarnessChoice, python_binds
from openforgerl.rollouts.admin import AdminClient
from openforgerl.rollouts.results import RolloutResult, Status
from openforgerl.rollouts.runner import (
    Runner,
    RunnerConfig,
    check_images,
    check_network,
)
from openforgerl.rollouts.settings import RolloutSettings, settings_in
from openforgerl.rollouts.trajectory import build_samples
from openforgerl.sandbox import SandboxBackend
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import Task


@dataclass
class RolloutJob(RolloutSettings):
    """One run of rollouts (RolloutSettings: its state, concurrency, failures, sampling, network),
    each task under its harness, and what its samples include."""

    harness: HarnessChoice
    include_side_requests: bool = True  # titles, routers: their own samples, with the reward

    def check(self, tasks: Sequence[Task], backend: str = "local") -> None:
        """Refuse, before any model is loaded, tasks that need a network the job does not allow
        (NetworkNotAllowed), their own image where `backend` cannot give it (TaskNeedsImage) or a
        harness that is not installed (HarnessNotInstalled)."""
        check_network(tasks, self.network)
        check_images(tasks, backend)
        self.harness.check(tasks)


class Cancel:
    """Stops a service's `run` from another thread: the run attaches its task, `cancel` cancels it
    (the runner cleans up as on Ctrl-C; its state says which rollouts a rerun must redo)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self.cancelled = False

    def attach(self) -> None:
        """Called inside the run: from now on `cancel` cancels the running task."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("attach() must be called from inside a task")
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), task
            if self.cancelled:
                task.cancel()  # cancelled before this run started

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._loop is not None and self._task is not None:
                try:
                    self._loop.call_soon_threadsafe(self._task.cancel)
                except RuntimeError:  # that run has ended and its loop is closed
                    pass


class RolloutService:
    """Rollouts against one gateway, in sandboxes of one backend (local ones unless told)."""

    def __init__(self, url: str, admin_token: str, backend: SandboxBackend | None = None) -> None:
        self.url = url.rstrip("/")
        self.admin_token = admin_token
        self.backend = backend or LocalBackend()

    @classmethod
    def of(cls, gateway: RunningGateway, backend: SandboxBackend | None = None) -> RolloutService:
        """The service of a gateway this process serves (serve_in_thread)."""
        return cls(gateway.url, gateway.gateway.admin_token, backend)

    async def collect(
        self,
        tasks: Sequence[Task],
        n: int,
        job: RolloutJob,
        on_done: Callable[[RolloutResult], None] | None = None,
    ) -> list[RolloutResult]:
        """Run every task n times (a rerun of the job finishes only what is left); one complete
        result per rollout, in task order. `on_done` sees each result as its rollout finishes."""
        cfg = RunnerConfig(
            gateway_url=self.url,
            admin_token=self.admin_token,
            **settings_in(job),
            ro_binds=[*python_binds(self.backend.name), *job.harness.ro_binds(tasks)],
        )
        runner = Runner(cfg, self.backend, job.harness)
        try:
            results = await runner.run(tasks, n, on_done=on_done)
            for r in results:
                await _complete(r, runner.admin, job)
        finally:
            await runner.close()
        return results

    def run(
        self,
        tasks: Sequence[Task],
        n: int,
        job: RolloutJob,
        *,
        progress: bool = True,
        desc: str = "rollouts",
        leave: bool = True,
        cancel: Cancel | None = None,
    ) -> list[RolloutResult]:
        """`collect` on an event loop of its own, with a progress bar; `cancel` lets another thread
        stop it."""
        bar = tqdm(total=len(tasks) * n, desc=desc, unit="rollout", disable=not progress, leave=leave)

        def done(r: RolloutResult) -> None:
            bar.update(1)
            bar.set_postfix_str(f"last {r.task_id}: {r.outcome or r.status.value} reward={r.reward}")

        async def go() -> list[RolloutResult]:
            if cancel is not None:
                cancel.attach()
            return await self.collect(tasks, n, job, on_done=done)

        try:
            return asyncio.run(go())
        finally:
            bar.close()


async def _complete(r: RolloutResult, admin: AdminClient, job: RolloutJob) -> None:
    """What the gateway recorded of the rollout: its calls (read now if the runner did not read
    them: a rollout an earlier process finished), and samples of them with the result's reward."""
    if r.calls is None and r.gateway_rollout_id:
        r.calls = await admin.calls(r.gateway_rollout_id)
    if r.calls is not None and r.status != Status.DROPPED:
        reward = float(r.reward or 0.0)
        r.samples = build_samples(r.calls, reward, include_side_requests=job.include_side_requests)
