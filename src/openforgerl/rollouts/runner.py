"""The runner: many rollouts, each a harness solving a task in its own sandbox, scored by a verifier.

For every (task, sample) it opens a gateway rollout (its own key and base URL), starts a sandbox
with the task's files, runs the harness inside it against the gateway, runs the verifier on the
final state, and closes the gateway rollout with the reward. Concurrency is bounded.

The reward's contract (docs/architecture.md): what the agent cannot cause is infrastructure,
retried and, past the retries, reported as `infra_failed`, never scored: a sandbox (or its image, or
the task's set-up) that does not start, the sandbox failing under a command, the engine unavailable
to one of the rollout's model calls, a verifier that cannot be loaded or asked
(`VerifierUnavailable`), and an exit code a harness names for its environment failing (the GUI
harness's site or browser). A task's image that can be neither found nor built (`ImageUnavailable`)
is infra_failed at once: no retry makes it. What the agent can cause is scored: a harness that
crashes or times out by `on_failure` ("zero": reward 0, "drop": excluded from training and scores,
"verify": the verifier judges the partial state), and a verifier failing on the state the agent left
(it timed out on a program left running, the reward file could not be written, the tests could not
run) 0.
RL alone may leave a wall-clock timeout out (`exclude_timeouts`): how long a rollout takes depends
on the machine's load, not only on the policy.

Every state change is written to the run's SQLite file before the runner moves on, so a restarted
run skips finished rollouts and redoes only the interrupted ones.

Sandboxes reach only the gateway (network "gateway"), unless the run allows the host's network
(`RunnerConfig.network = "host"`, `openforge eval --network host`), which tasks on live web sites
(`harness_options.start_url`) need; a run that has such tasks without it is refused before it starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openforgerl import behaviour, faults
from openforgerl.gateway.errors import ENGINE_UNAVAILABLE
from openforgerl.harnesses.launch import HarnessFactory, python_binds, python_hidden
from openforgerl.rollouts import steps
from openforgerl.rollouts.admin import AdminClient
from openforgerl.rollouts.results import RolloutResult, RunState, Status
from openforgerl.rollouts.settings import OnFailure as OnFailure  # their old home, for importers
from openforgerl.rollouts.settings import OnTimeout as OnTimeout
from openforgerl.rollouts.settings import RolloutSettings
from openforgerl.rollouts.settings import RunNetwork as RunNetwork
from openforgerl.sampling import derive_seed
from openforgerl.sandbox import (
    ExecResult,
    ImageUnavailable,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SandboxStartError,
)
from openforgerl.tasks import Task
from openforgerl.tasks.verify import (
    OUTPUT_TAIL,
    GatewayAccess,
    VerifierError,
    VerifierResult,
    VerifierUnavailable,
    bounded_details,
    clip,
)

VERIFIER_DIR = steps.VERIFIER_DIR  # where they were, for importers
WORKDIR_TAR = steps.WORKDIR_TAR


@dataclass
class RunnerConfig(RolloutSettings):
    """The run's RolloutSettings (run id, state, concurrency, failures, sampling, network: declared
    there once), with the gateway the runner reaches and what every sandbox gets."""

    gateway_url: str  # as the host reaches it
    admin_token: str
    limits: Limits = field(default_factory=lambda: Limits(memory_bytes=2 << 30, cpus=1.0, pids=512))
    ro_binds: list[str | tuple[str, str]] = field(default_factory=python_binds)
    # Host paths under ro_binds that the agent must not see (local sandboxes): by default this
    # package's folder, of which only the files the harnesses run show (python_hidden).
    hidden: list[str] = field(default_factory=python_hidden)


class EngineDown(RuntimeError):
    """The engine was unavailable to one of the rollout's model calls: the rollout did not meet the
    policy alone, whatever it scored; infrastructure, retried."""


# What the agent cannot cause: retried, then reported as infra_failed (the module's doc).
INFRA_ERRORS = (SandboxStartError, VerifierUnavailable, EngineDown)


class NetworkNotAllowed(ValueError):
    """Tasks need a network the run does not allow (live web sites without network "host")."""


def needs_host_network(task: Task) -> bool:
    """A task on a live web site (the GUI harness's `start_url`) needs the host's network."""
    return bool(task.harness_options.get("start_url"))


def check_network(tasks: Sequence[Task], network: str) -> None:
    """Raises NetworkNotAllowed, naming the option to set, when tasks need more than `network`."""
    if network not in ("gateway", "host"):
        raise ValueError(f"network must be 'gateway' or 'host', not {network!r}")
    live = [t.id for t in tasks if needs_host_network(t)]
    if live and network != "host":
        some = ", ".join(live[:3]) + (f" and {len(live) - 3} more" if len(live) > 3 else "")
        raise NetworkNotAllowed(
            f"{len(live)} task(s) ({some}) run on live web sites (harness_options.start_url), which "
            "their sandboxes can reach only with the host's network: pass --network host to "
            "openforge eval / rollout (RunnerConfig.network='host'). It lets the sandbox reach the "
            "internet and whatever listens on the host."
        )


class TaskNeedsImage(ValueError):
    """Tasks run only in their own image, which the run's sandbox backend (the local one) cannot use."""


def image_need(task: Task) -> str:
    """What a task that runs only in its image needs, in words."""
    built = f", built from {task.build}/Dockerfile" if task.build else ""
    return f"task {task.id!r} runs only in its image {task.image}{built}"


def check_images(tasks: Sequence[Task], backend_name: str) -> None:
    """Raises TaskNeedsImage, naming each task's image, where the local backend meets tasks that run
    only in their image (Harbor tasks with a Dockerfile or docker_image)."""
    if backend_name != "local":
        return
    bound = [t for t in tasks if t.needs_image]
    if bound:
        lines = "\n".join(f"  {image_need(t)}" for t in bound[:10])
        more = f"\n  and {len(bound) - 10} more" if len(bound) > 10 else ""
        raise TaskNeedsImage(
            f"{len(bound)} task(s) need their own container image, which local sandboxes (the host's "
            f"tools) cannot give them:\n{lines}{more}\nRun them with the Docker backend (--backend "
            "docker), or leave them out of this run."
        )


class Runner:
    def __init__(self, cfg: RunnerConfig, backend: SandboxBackend, harness: HarnessFactory) -> None:
        self.cfg = cfg
        self.backend = backend
        self.harness = harness
        self.state = RunState(cfg.state_path)
        self.admin = AdminClient(cfg.gateway_url, cfg.admin_token)

    async def close(self) -> None:
        await self.admin.aclose()
        self.state.close()

    async def run(
        self,
        tasks: Sequence[Task],
        samples: int = 1,
        on_done: Callable[[RolloutResult], None] | None = None,
    ) -> list[RolloutResult]:
        """Run every task `samples` times; finished rollouts of an earlier run are not redone."""
        check_network(tasks, self.cfg.network)
        check_images(tasks, self.backend.name)
        previous = self.state.load()
        results: dict[str, RolloutResult] = {}
        todo: list[tuple[Task, int]] = []
        for task in tasks:
            for k in range(samples):
                r = previous.get(f"{task.id}#{k}")
                if r is not None and r.status in (Status.DONE, Status.DROPPED):
                    results[r.key] = r
                    if on_done:
                        on_done(r)
                else:
                    if r is not None and r.status == Status.RUNNING and r.gateway_rollout_id:
                        # Interrupted by a crash or Ctrl-C: close its gateway rollout, run it again.
                        interrupted = {"interrupted": True}
                        await self.admin.close_rollout(r.gateway_rollout_id, None, interrupted, "cancelled")
                    todo.append((task, k))
        gate = asyncio.Semaphore(self.cfg.concurrency)

        async def one(task: Task, k: int) -> None:
            async with gate:
                r = await self._rollout(task, k)
            results[r.key] = r
            if on_done:
                on_done(r)

        # gather, not TaskGroup: Python 3.11's TaskGroup can swallow the parent's cancellation
        # (CPython gh-116720), and Ctrl-C must stop the run.
        running = [asyncio.ensure_future(one(task, k)) for task, k in todo]
        try:
            await asyncio.gather(*running)
        except BaseException:
            # Cancel what is still running, once: a second cancel would cut short the clean-up
            # (sandbox stop) that the first one started.
            for t in running:
                if not t.done() and not t.cancelling():
                    t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        order = {f"{t.id}#{k}": i for i, (t, k) in enumerate((t, k) for t in tasks for k in range(samples))}
        return sorted(results.values(), key=lambda r: order.get(r.key, 0))

    async def _rollout(self, task: Task, sample: int) -> RolloutResult:
        r = RolloutResult(task.id, sample, Status.RUNNING)
        errors: list[str] = []
        for attempt in range(1 + self.cfg.infra_retries):
            r.attempts = attempt + 1
            try:
                return await self._attempt(task, r)
            except (*INFRA_ERRORS, ImageUnavailable) as exc:
                errors.append(f"attempt {attempt + 1}: {exc}")
                if r.gateway_rollout_id:
                    await self.admin.close_rollout(
                        r.gateway_rollout_id, None, {"infra_error": str(exc)}, "failed"
                    )
                r.gateway_rollout_id = ""
                if isinstance(exc, ImageUnavailable):
                    break  # no retry makes the image: this task is marked, the others run on
                await asyncio.sleep(min(2**attempt, 10) * 0.1)
        r.status, r.outcome, r.details = Status.INFRA_FAILED, "infra", {"infra_errors": errors}
        self.state.save(r)
        return r

    def _sampling(self, task: Task, sample: int) -> dict[str, Any]:
        if self.cfg.seed is None:
            return self.cfg.sampling
        return {**self.cfg.sampling, "seed": derive_seed(self.cfg.seed, task.id, sample)}

    async def _attempt(self, task: Task, r: RolloutResult) -> RolloutResult:
        t0 = time.monotonic()
        r.reward, r.outcome, r.details, r.seconds = None, "", {}, {}  # nothing of a failed attempt
        metadata = {"sample": r.sample, "attempt": r.attempts}
        gw = await self.admin.open_rollout(self.cfg.run_id, task.id, metadata, self._sampling(task, r.sample))
        r.gateway_rollout_id = gw.rollout_id
        r.status = Status.RUNNING
        self.state.save(r)
        statuses = [s for f in task.faults if f.gateway for s in f.gateway]
        if statuses:  # the task's gateway faults: its first calls are answered with these errors
            await self.admin.queue_faults(gw.rollout_id, statuses)
        sandbox = self.backend.create(self._spec(task), f"{self.cfg.run_id}-{gw.rollout_id}"[:64])
        try:
            await sandbox.start()
            r.seconds["start"] = time.monotonic() - t0
            await self._setup(task, sandbox)
            inside_url = sandbox.gateway_url or self.cfg.gateway_url
            base_url = f"{inside_url.rstrip('/')}/r/{gw.rollout_id}"
            launch = await self.harness(task, base_url, gw.api_key, sandbox)
            for path, content in launch.files.items():
                await sandbox.put_file(path, content)
            # After the set-up: the task's transient faults meet the harness, never the set-up.
            fault_files, fault_env = faults.environment(task.faults, sandbox.tmpdir, launch.env.get("PATH"))
            for path, (content, mode) in fault_files.items():
                await sandbox.put_file(path, content, mode=mode)
            t1 = time.monotonic()
            limit = task.timeout * self.cfg.timeout_multiplier
            ran = await sandbox.exec(launch.argv, env={**launch.env, **fault_env}, timeout=limit)
            r.seconds["harness"] = time.monotonic() - t1
            if ran.exit_code == launch.infra_exit_code and ran.killed_by is None:
                tail = (ran.stdout + ran.stderr)[-500:].strip()
                raise SandboxStartError(f"the harness's environment failed (exit {ran.exit_code}): {tail}")
            r.outcome = _outcome(ran)
            r.details["harness"] = {"exit_code": ran.exit_code, "tail": (ran.stdout + ran.stderr)[-2000:]}
            if r.outcome == "timeout" and self.cfg.exclude_timeouts and not task.timeout_is_failure:
                r.status, r.reward = Status.DROPPED, None
            elif r.outcome != "ok" and self.cfg.on_failure == "drop":
                r.status, r.reward = Status.DROPPED, None
            elif r.outcome != "ok" and self.cfg.on_failure == "zero":
                r.status, r.reward = Status.DONE, 0.0
            else:
                t2 = time.monotonic()
                try:
                    verdict = await self._verify(task, sandbox, r.gateway_rollout_id)
                except VerifierUnavailable:
                    raise
                except VerifierError as exc:
                    # It failed on what the agent left (a program left running, a reward file it
                    # could not write, tests that cannot run): the agent's doing, scored 0. Were it
                    # left out, a policy could turn its failures into exclusions.
                    verdict = VerifierResult(0.0)
                    r.outcome = "verifier_error"
                    r.details["verifier_error"] = clip(str(exc), 2 * OUTPUT_TAIL)
                r.seconds["verify"] = time.monotonic() - t2
                r.status, r.reward = Status.DONE, verdict.reward
                r.details["verifier"] = bounded_details(verdict.details)
        finally:
            await asyncio.shield(sandbox.stop())
        r.seconds["total"] = time.monotonic() - t0
        gw_status = "closed" if r.status == Status.DONE else "failed"
        close: dict[str, Any] = {"outcome": r.outcome}
        # The rollout's calls, read once: the behaviour metrics come from them, and the result carries
        # them on to whoever builds samples.
        r.calls = await self.admin.calls(r.gateway_rollout_id)
        down = [c.error for c in r.calls or () if c.error.startswith(ENGINE_UNAVAILABLE)]
        if down:
            raise EngineDown(f"{len(down)} model call(s) met an unavailable engine: {down[0][:300]}")
        if r.calls is not None:  # how the policy acted, into the run state and the gateway's store
            acted = behaviour.of_conversation(behaviour.main_conversation(r.calls))
            r.details["behaviour"] = close["behaviour"] = acted
        await self.admin.close_rollout(r.gateway_rollout_id, r.reward, close, gw_status)
        self.state.save(r)
        return r

    def _spec(self, task: Task) -> SandboxSpec:
        cfg = self.cfg
        return steps.task_spec(
            task,
            limits=cfg.limits,
            network=cfg.network,
            timeout_multiplier=cfg.timeout_multiplier,
            gateway_url=cfg.gateway_url,
            ro_binds=cfg.ro_binds,
            hidden=cfg.hidden,
        )

    async def _setup(self, task: Task, sandbox: Sandbox) -> None:
        await steps.set_up(task, sandbox)

    async def _verify(self, task: Task, sandbox: Sandbox, rollout_id: str = "") -> VerifierResult:
        # Python verifiers that declare a `gateway` parameter get it (e.g. an LLM judge).
        cfg = self.cfg
        gateway = GatewayAccess(cfg.gateway_url, cfg.admin_token, cfg.run_id, rollout_id, task.id)
        return await steps.verify(task, sandbox, gateway)


def _outcome(ran: ExecResult) -> str:
    if ran.timed_out:
        return "timeout"
    if ran.killed_by:
        return f"killed:{ran.killed_by}"
    return "ok" if ran.exit_code == 0 else "crash"
