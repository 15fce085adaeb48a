"""`openforge tasks check`: what a task author runs before training on a task set.

For each task, in sandboxes of the run's backend and without any model: its verifier must fail
(reward below 1) on the untouched workspace; then, in a fresh sandbox, its reference solution runs and
the verifier must pass (reward 1) twice in a row, neither run changing the workspace (its files,
bytes, modes and links, compared before and after each). A task without a reference solution, or that
the backend cannot run (a task bound to its image, on the local backend), fails the check, saying why.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openforgerl.rollouts import steps
from openforgerl.rollouts.runner import image_need
from openforgerl.sandbox import Limits, Sandbox, SandboxBackend, SandboxError
from openforgerl.sandbox.base import Network
from openforgerl.tasks import Task
from openforgerl.tasks.files import tree_digest
from openforgerl.tasks.verify import VerifierError


@dataclass
class TaskCheck:
    """How one task's check went: `problem` is None when it passed."""

    task_id: str
    problem: str | None = None
    untouched: float | None = None  # the verifier's reward on the untouched workspace
    solved: list[float] = field(default_factory=list)  # its rewards after the solution, in order
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.problem is None

    def line(self) -> str:
        rewards = []
        if self.untouched is not None:
            rewards.append(f"untouched {self.untouched:.2f}")
        if self.solved:
            rewards.append("solved " + ", ".join(f"{r:.2f}" for r in self.solved))
        shown = f" ({'; '.join(rewards)})" if rewards else ""
        verdict = "ok  " if self.ok else "FAIL"
        why = f": {self.problem}" if self.problem else ""
        return f"{verdict} {self.task_id}{shown} {self.seconds:.1f} s{why}"


async def _snapshot(sandbox: Sandbox) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        await steps.copy_out(sandbox, Path(tmp))
        return await asyncio.to_thread(tree_digest, Path(tmp))


def _changes(before: dict[str, str], after: dict[str, str]) -> str:
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    some = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return some


class TaskChecker:
    """Checks tasks in sandboxes of `backend` (see the module's doc)."""

    def __init__(
        self,
        backend: SandboxBackend,
        *,
        network: Network = "none",
        limits: Limits | None = None,
    ) -> None:
        self.backend = backend
        self.network = network
        self.limits = limits or Limits(memory_bytes=2 << 30, cpus=1.0, pids=512)
        self.run_id = f"check-{uuid.uuid4().hex[:8]}"

    def _sandbox(self, task: Task, step: str) -> Sandbox:
        network: Network = "none" if task.offline else self.network
        spec = steps.task_spec(task, limits=self.limits, network=network, gateway_url=None)
        return self.backend.create(spec, f"{self.run_id}-{step}-{uuid.uuid4().hex[:8]}")

    async def check(self, task: Task) -> TaskCheck:
        result = TaskCheck(task.id)
        started = time.monotonic()
        try:
            result.problem = await self._check(task, result)
        except (SandboxError, VerifierError, OSError, ValueError) as exc:
            result.problem = f"{type(exc).__name__}: {exc}"
        result.seconds = time.monotonic() - started
        return result

    async def _check(self, task: Task, result: TaskCheck) -> str | None:
        if task.needs_image and self.backend.name == "local":
            return f"{image_need(task)}: check it with --backend docker"
        if task.solution is None:
            return "no reference solution (Harbor: solution/solve.sh) to check the verifier against"
        async with self._sandbox(task, "untouched") as sandbox:
            await steps.set_up(task, sandbox)
            untouched = await steps.verify(task, sandbox)
            result.untouched = untouched.reward
        if untouched.reward >= 1.0:
            return "the verifier passes the untouched workspace: it checks nothing the agent must do"
        async with self._sandbox(task, "solved") as sandbox:
            await steps.set_up(task, sandbox)
            ran = await steps.run_solution(task, sandbox)
            if not ran.ok:
                tail = (ran.stdout + ran.stderr)[-300:].strip()
                how = ran.killed_by or f"exit {ran.exit_code}"
                return f"the reference solution failed ({how}): {tail}"
            before = await _snapshot(sandbox)
            for attempt in ("first", "second"):
                verdict = await steps.verify(task, sandbox)
                result.solved.append(verdict.reward)
                if verdict.reward < 1.0:
                    detail = {k: v for k, v in verdict.details.items() if k != "reward_file"}
                    return (
                        f"the {attempt} verification after the reference solution scored {verdict.reward:.2f}"
                        + (f" {detail}" if detail else "")
                    )
                after = await _snapshot(sandbox)
                if after != before:
                    return f"the {attempt} verification changed the workspace: {_changes(before, after)}"
        return None

    async def check_all(
        self, tasks: Sequence[Task], concurrency: int = 2, on_done: Callable[[TaskCheck], None] | None = None
    ) -> list[TaskCheck]:
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task) -> TaskCheck:
            async with gate:
                result = await self.check(task)
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(one(t) for t in tasks)))


def summary(results: Sequence[TaskCheck]) -> str:
    failed = [r.task_id for r in results if not r.ok]
    passed = len(results) - len(failed)
    text = f"{len(results)} task(s): {passed} passed, {len(failed)} failed"
    return text + (f" ({', '.join(failed[:10])}{' ...' if len(failed) > 10 else ''})" if failed else "")
