"""The runner: many rollouts, each a harness solving a task in its own sandbox, scored by a verifier.

For every (task, sample) it opens a gateway rollout (its own key and base URL), starts a sandbox
with the task's files, runs the harness inside it against the gateway, runs the verifier on the
final state, and closes the gateway rollout with the reward. Concurrency is bounded; infrastructure
failures (a sandbox that does not start) are retried and never counted as the policy's failure; a
harness that crashes or times out is a policy outcome, scored by `on_failure`:
"zero" (reward 0), "drop" (excluded from training and scores) or "verify" (the verifier judges the
partial state). A harness may name an exit code that means its environment failed (the GUI harness's
site or browser did not start): that is an infrastructure failure too, retried and never scored.
Every state change is written to the run's SQLite file before the runner moves on, so a restarted
run skips finished rollouts and redoes only the interrupted ones.

Sandboxes reach only the gateway (network "gateway"), unless the run allows the host's network
(`RunnerConfig.network = "host"`, `openforge eval --network host`), which tasks on live web sites
(`harness_options.start_url`) need; a run that has such tasks without it is refused before it starts.
"""

from __future__ import annotations

import asyncio
import enum
import io
import json
import posixpath
import sqlite3
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from openforgerl import behaviour, faults
from openforgerl.gui_agent import EXIT_INFRA as GUI_EXIT_INFRA
from openforgerl.harnesses.base import Harness
from openforgerl.sampling import derive_seed
from openforgerl.sandbox import ExecResult, Limits, Sandbox, SandboxBackend, SandboxSpec, SandboxStartError
from openforgerl.tasks import CommandVerifier, PythonVerifier, Task
from openforgerl.tasks.verify import (
    GatewayAccess,
    VerifierError,
    VerifierResult,
    parse_verifier_output,
    run_python_verifier,
    verifier_env,
    write_files,
)

OnFailure = Literal["zero", "drop", "verify"]
RunNetwork = Literal["gateway", "host"]  # what a run's sandboxes reach (see the module's doc)
# In the sandbox's temp dir (`Sandbox.tmpdir`), outside the work dir: the agent never sees them.
TASK_FILE = "openforge-task.txt"  # the built-in harnesses' instruction
VERIFIER_DIR = "openforge-verifier"  # a command verifier's files
WORKDIR_TAR = "openforge-workdir.tar"  # the work dir, copied out for a Python verifier


class Status(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"  # scored (reward set)
    DROPPED = "dropped"  # a policy failure excluded by on_failure="drop"
    INFRA_FAILED = "infra_failed"  # the infrastructure failed every retry: not the policy's fault


@dataclass
class RolloutResult:
    task_id: str
    sample: int
    status: Status
    reward: float | None = None
    outcome: str = ""  # how the harness ended: ok | crash | timeout | killed:oom | killed:pids | ...
    gateway_rollout_id: str = ""
    attempts: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    # The gateway's record of the rollout's calls (GET /admin/rollouts/{id}/calls) as the runner read
    # it at close, for consumers to reuse instead of asking again; not persisted (None after a restart).
    calls: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.task_id}#{self.sample}"


class RunState:
    """The run's durable record of every rollout's state (SQLite, one row per task sample)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS rollouts (key TEXT PRIMARY KEY, task_id TEXT, sample INTEGER,"
            " status TEXT, reward REAL, outcome TEXT, gateway_rollout_id TEXT, attempts INTEGER,"
            " details TEXT, seconds TEXT, updated REAL)"
        )

    def save(self, r: RolloutResult) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO rollouts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    r.key,
                    r.task_id,
                    r.sample,
                    r.status.value,
                    r.reward,
                    r.outcome,
                    r.gateway_rollout_id,
                    r.attempts,
                    json.dumps(r.details),
                    json.dumps(r.seconds),
                    time.time(),
                ),
            )

    def load(self) -> dict[str, RolloutResult]:
        with self._lock:
            rows = self._db.execute(
                "SELECT task_id, sample, status, reward, outcome, gateway_rollout_id, attempts, details,"
                " seconds FROM rollouts"
            ).fetchall()
        out = {}
        for task_id, sample, status, reward, outcome, gw_id, attempts, details, seconds in rows:
            r = RolloutResult(task_id, sample, Status(status), reward, outcome, gw_id, attempts)
            r.details, r.seconds = json.loads(details), json.loads(seconds)
            out[r.key] = r
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass(frozen=True)
class HarnessLaunch:
    """How to run a harness inside a sandbox: argv and environment, given the rollout's endpoint."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # extra files to put in the sandbox first
    # The exit code by which the harness says its environment failed, not the policy (e.g. a browser
    # that did not start): the rollout is retried as an infrastructure failure, never scored.
    infra_exit_code: int | None = None


# A harness factory: (task, inside base_url, api_key, sandbox) -> launch.
HarnessFactory = Callable[[Task, str, str, Sandbox], Awaitable[HarnessLaunch]]


def react_harness(
    max_turns: int = 12, max_tokens: int | None = None, python: str = sys.executable
) -> HarnessFactory:
    """The built-in ReAct harness (openforgerl.react_agent), run with `python`: this interpreter for
    local sandboxes (bound read-only inside), the image's `python3` (with openforgerl installed) in
    containers and Pods."""

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        turns = int(task.harness_options.get("max_turns", max_turns))
        task_file = posixpath.join(sandbox.tmpdir, TASK_FILE)
        argv = [python, "-m", "openforgerl.react_agent", "--base-url", base_url, "--api-key", api_key]
        argv += ["--task", f"@{task_file}", "--max-turns", str(turns)]
        if max_tokens:
            argv += ["--max-tokens", str(max_tokens)]
        return HarnessLaunch(argv, {}, {task_file: task.instruction})

    return launch


GUI_MAX_STEPS = 15  # OSWorld's smallest limit; it also runs 50 and 100


def gui_harness(
    max_steps: int | None = None,
    max_tokens: int | None = None,
    python: str = sys.executable,
    a11y: bool = False,
    width: int = 640,
    height: int = 480,
) -> HarnessFactory:
    """The built-in GUI harness (openforgerl.gui_agent): headless Chromium on the task's local site
    (`harness_options.site`, e.g. web-basic's) or at `harness_options.start_url`. `max_steps` (e.g.
    15, 50 or 100) overrides the task's own `harness_options.max_steps` (default 15); `a11y` adds
    the accessibility tree to each screenshot (for text-only policies)."""

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        opts = task.harness_options
        steps = max_steps or int(opts.get("max_steps", GUI_MAX_STEPS))
        task_file = posixpath.join(sandbox.tmpdir, TASK_FILE)
        argv = [python, "-m", "openforgerl.gui_agent", "--base-url", base_url, "--api-key", api_key]
        argv += ["--task", f"@{task_file}", "--max-steps", str(steps)]
        if opts.get("site"):
            argv += ["--site", str(opts["site"])]
        elif opts.get("start_url"):
            argv += ["--start-url", str(opts["start_url"])]
        else:
            raise ValueError(f"task {task.id}: the gui harness needs harness_options.site or start_url")
        argv += ["--width", str(width), "--height", str(height)]
        if a11y or opts.get("a11y"):
            argv.append("--a11y")
        if max_tokens:
            argv += ["--max-tokens", str(max_tokens)]
        return HarnessLaunch(argv, {}, {task_file: task.instruction}, infra_exit_code=GUI_EXIT_INFRA)

    return launch


def cli_harness(harness: Harness, model: str = "policy", max_turns: int | None = None) -> HarnessFactory:
    """A real agent CLI (see openforgerl.harnesses) inside the sandbox; `max_turns` (or the task's
    `harness_options.max_turns`) reaches the CLI's own turn limit where it has one.

    The adapter writes its config files into a scratch HOME on the host; they are copied into the
    sandbox's own HOME, and host paths in the environment are rewritten to the inside ones. The
    harness's install folder must be visible inside (RunnerConfig.ro_binds).
    """

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        probe = await sandbox.exec(["sh", "-c", 'printf %s "$HOME"'], timeout=30)
        home = probe.stdout.strip() or sandbox.tmpdir
        turns = task.harness_options.get("max_turns", max_turns)
        return await asyncio.to_thread(
            _prepare_cli, harness, task, base_url, api_key, model, home, sandbox.workdir, turns
        )

    return launch


def _prepare_cli(
    harness: Harness,
    task: Task,
    base_url: str,
    api_key: str,
    model: str,
    home: str,
    workdir: str,
    max_turns: int | None,
) -> HarnessLaunch:
    with tempfile.TemporaryDirectory(prefix="openforge-home-") as scratch:
        turns = int(max_turns) if max_turns else None
        env = harness.prepare(Path(scratch), Path(workdir), base_url, api_key, model, turns)
        files = {
            f"{home}/{p.relative_to(scratch)}": p.read_text(errors="replace")
            for p in Path(scratch).rglob("*")
            if p.is_file()
        }
        env = {k: v.replace(scratch, home) for k, v in env.items()}
    return HarnessLaunch(harness.command(task.instruction), env, files)


def python_binds() -> list[str]:
    """What the sandbox must see read-only for this interpreter and package to run inside it."""
    import openforgerl

    paths = {sys.prefix, sys.base_prefix, str(Path(openforgerl.__file__).parent.parent)}
    return sorted(p for p in paths if not p.startswith(("/usr", "/bin", "/lib")))


@dataclass
class RunnerConfig:
    gateway_url: str  # as the host reaches it
    admin_token: str
    run_id: str
    state_path: Path
    concurrency: int = 4
    infra_retries: int = 2
    on_failure: OnFailure = "zero"
    sampling: dict[str, Any] = field(default_factory=dict)  # per-rollout sampling overrides
    # Seeded sampling: rollout (task, sample) samples with seeds drawn from (seed, task id, sample),
    # whatever the weights, so an evaluation repeats exactly and two models meet the same random
    # numbers (their per-task difference is less noisy). None: unseeded, as RL rollouts must be.
    seed: int | None = None
    limits: Limits = field(default_factory=lambda: Limits(memory_bytes=2 << 30, cpus=1.0, pids=512))
    ro_binds: list[str] = field(default_factory=python_binds)
    # Every sandbox's network: "gateway" (only the gateway) or "host" (also the live web; needed by
    # tasks with harness_options.start_url).
    network: RunNetwork = "gateway"


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


class Runner:
    def __init__(self, cfg: RunnerConfig, backend: SandboxBackend, harness: HarnessFactory) -> None:
        self.cfg = cfg
        self.backend = backend
        self.harness = harness
        self.state = RunState(cfg.state_path)
        self._admin = httpx.AsyncClient(
            base_url=cfg.gateway_url, headers={"authorization": f"Bearer {cfg.admin_token}"}, timeout=60
        )

    async def close(self) -> None:
        await self._admin.aclose()
        self.state.close()

    async def run(
        self,
        tasks: Sequence[Task],
        samples: int = 1,
        on_done: Callable[[RolloutResult], None] | None = None,
    ) -> list[RolloutResult]:
        """Run every task `samples` times; finished rollouts of an earlier run are not redone."""
        check_network(tasks, self.cfg.network)
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
                        await self._close_gateway(r.gateway_rollout_id, None, interrupted, "cancelled")
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
            except SandboxStartError as exc:
                errors.append(f"attempt {attempt + 1}: {exc}")
                if r.gateway_rollout_id:
                    await self._close_gateway(r.gateway_rollout_id, None, {"infra_error": str(exc)}, "failed")
                r.gateway_rollout_id = ""
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
        resp = await self._admin.post(
            "/admin/rollouts",
            json={
                "run_id": self.cfg.run_id,
                "task_id": task.id,
                "metadata": {"sample": r.sample, "attempt": r.attempts},
                "sampling": self._sampling(task, r.sample),
            },
        )
        resp.raise_for_status()
        gw = resp.json()
        r.gateway_rollout_id = gw["rollout_id"]
        r.status = Status.RUNNING
        self.state.save(r)
        statuses = [s for f in task.faults if f.gateway for s in f.gateway]
        if statuses:  # the task's gateway faults: its first calls are answered with these errors
            queued = await self._admin.post(
                f"/admin/rollouts/{gw['rollout_id']}/faults", json={"errors": statuses}
            )
            queued.raise_for_status()
        sandbox = self.backend.create(self._spec(task), f"{self.cfg.run_id}-{gw['rollout_id']}"[:64])
        try:
            await sandbox.start()
            r.seconds["start"] = time.monotonic() - t0
            await self._setup(task, sandbox)
            inside_url = sandbox.gateway_url or self.cfg.gateway_url
            base_url = f"{inside_url.rstrip('/')}/r/{gw['rollout_id']}"
            launch = await self.harness(task, base_url, gw["api_key"], sandbox)
            for path, content in launch.files.items():
                await sandbox.put_file(path, content)
            # After the set-up: the task's transient faults meet the harness, never the set-up.
            fault_files, fault_env = faults.environment(task.faults, sandbox.tmpdir, launch.env.get("PATH"))
            for path, (content, mode) in fault_files.items():
                await sandbox.put_file(path, content, mode=mode)
            t1 = time.monotonic()
            ran = await sandbox.exec(launch.argv, env={**launch.env, **fault_env}, timeout=task.timeout)
            r.seconds["harness"] = time.monotonic() - t1
            if ran.exit_code == launch.infra_exit_code and ran.killed_by is None:
                tail = (ran.stdout + ran.stderr)[-500:].strip()
                raise SandboxStartError(f"the harness's environment failed (exit {ran.exit_code}): {tail}")
            r.outcome = _outcome(ran)
            r.details["harness"] = {"exit_code": ran.exit_code, "tail": (ran.stdout + ran.stderr)[-2000:]}
            if r.outcome != "ok" and self.cfg.on_failure == "drop":
                r.status, r.reward = Status.DROPPED, None
            elif r.outcome != "ok" and self.cfg.on_failure == "zero":
                r.status, r.reward = Status.DONE, 0.0
            else:
                t2 = time.monotonic()
                verdict = await self._verify(task, sandbox, r.gateway_rollout_id)
                r.seconds["verify"] = time.monotonic() - t2
                r.status, r.reward = Status.DONE, verdict.reward
                r.details["verifier"] = verdict.details
        except VerifierError as exc:
            # A broken verifier is not the policy's fault either: no reward, reported as such.
            r.status, r.reward, r.outcome = Status.INFRA_FAILED, None, "verifier_error"
            r.details["verifier_error"] = str(exc)
        finally:
            await asyncio.shield(sandbox.stop())
        r.seconds["total"] = time.monotonic() - t0
        gw_status = "closed" if r.status == Status.DONE else "failed"
        close: dict[str, Any] = {"outcome": r.outcome}
        r.calls = await self._recorded_calls(r.gateway_rollout_id)
        if r.calls is not None:  # how the policy acted, into the run state and the gateway's store
            acted = behaviour.of_conversation(behaviour.main_conversation(r.calls["calls"]))
            r.details["behaviour"] = close["behaviour"] = acted
        await self._close_gateway(r.gateway_rollout_id, r.reward, close, gw_status)
        self.state.save(r)
        return r

    def _spec(self, task: Task) -> SandboxSpec:
        files: dict[str, str] = {}
        if isinstance(task.files, Path):
            with tempfile.TemporaryDirectory() as tmp:
                write_files(task.files, Path(tmp))
                for p in Path(tmp).rglob("*"):
                    if p.is_file():
                        files[str(p.relative_to(tmp))] = p.read_text(errors="replace")
        else:
            files = dict(task.files)
        base = self.cfg.limits
        res = task.resources
        limits = Limits(
            memory_bytes=int(res.memory) if res.memory else base.memory_bytes,
            cpus=res.cpus or base.cpus,
            pids=res.pids or base.pids,
            wall_time_s=task.timeout + 300,
        )
        return SandboxSpec(
            files=files,
            limits=limits,
            network=self.cfg.network,
            gateway_url=self.cfg.gateway_url,
            ro_binds=self.cfg.ro_binds,
            image=task.image,
            labels={"task": task.id},
        )

    async def _setup(self, task: Task, sandbox: Sandbox) -> None:
        for command in task.setup:
            done = await sandbox.exec(command, timeout=task.timeout)
            if not done.ok:
                # The task's own set-up failing is an environment fault, not the policy's.
                raise SandboxStartError(f"setup {command!r} failed ({done.exit_code}): {done.stderr[-500:]}")

    async def _verify(self, task: Task, sandbox: Sandbox, rollout_id: str = "") -> VerifierResult:
        verifier = task.verifier
        if isinstance(verifier, PythonVerifier):
            # Python verifiers that declare a `gateway` parameter get it (e.g. an LLM judge).
            cfg = self.cfg
            gateway = GatewayAccess(cfg.gateway_url, cfg.admin_token, cfg.run_id, rollout_id, task.id)
            with tempfile.TemporaryDirectory() as tmp:
                await _copy_out(sandbox, Path(tmp))
                return await asyncio.to_thread(run_python_verifier, verifier, Path(tmp), gateway)
        assert isinstance(verifier, CommandVerifier)
        verifier_dir = posixpath.join(sandbox.tmpdir, VERIFIER_DIR)
        if verifier.files is not None:
            with tempfile.TemporaryDirectory() as tmp:
                write_files(verifier.files, Path(tmp))
                await sandbox.put_dir(tmp, verifier_dir)
        done = await sandbox.exec(
            verifier.command, env=verifier_env(task.id, verifier_dir), timeout=verifier.timeout
        )
        if done.timed_out:
            raise VerifierError(f"the verifier ran over its timeout of {verifier.timeout} s")
        return parse_verifier_output(done.stdout, done.exit_code, done.stderr)

    async def _recorded_calls(self, rollout_id: str) -> dict[str, Any] | None:
        """The rollout's recorded calls (read once: the behaviour metrics come from them, and the
        result carries them to whoever builds samples); None when the gateway cannot say."""
        try:
            resp = await self._admin.get(f"/admin/rollouts/{rollout_id}/calls")
        except httpx.HTTPError:
            return None
        payload: dict[str, Any] | None = resp.json() if resp.status_code == 200 else None
        return payload

    async def _close_gateway(
        self, rollout_id: str, reward: float | None, details: dict[str, Any], status: str
    ) -> None:
        body: dict[str, Any] = {"details": details, "status": status}
        if reward is not None:
            body["reward"] = reward
        try:
            await self._admin.post(f"/admin/rollouts/{rollout_id}/close", json=body)
        except httpx.HTTPError:
            pass  # the gateway is gone; the run state still has the result


def _outcome(ran: ExecResult) -> str:
    if ran.timed_out:
        return "timeout"
    if ran.killed_by:
        return f"killed:{ran.killed_by}"
    return "ok" if ran.exit_code == 0 else "crash"


async def _copy_out(sandbox: Sandbox, dest: Path) -> None:
    """Copy the work dir out of the sandbox for a Python verifier: a tar file made inside, read back
    with get_file, whose limit (hundreds of MiB) is far above an exec's output cap (1 MiB), so a
    state with files like the GUI harness's screenshots comes out whole."""
    archive = posixpath.join(sandbox.tmpdir, WORKDIR_TAR)  # outside the work dir, which it must not contain
    done = await sandbox.exec(["tar", "-cf", archive, "."], timeout=120)
    if not done.ok:
        raise VerifierError(f"could not copy the work dir out of the sandbox: {done.stderr[-300:]}")
    try:
        data = await sandbox.get_file(archive)
    except (OSError, ValueError) as exc:
        raise VerifierError(f"could not copy the work dir out of the sandbox: {exc}") from exc
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(dest, filter="data")
