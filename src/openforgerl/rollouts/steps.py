"""A task's steps inside one sandbox: the sandbox it asks for, its set-up, its reference solution and
its verifier. The runner runs them around a harness; `openforge tasks check` runs them around the
reference solution instead.

A task's files travel as bytes: a folder becomes the sandbox's workspace (`SandboxSpec.workspace`:
copied file by file with its modes and its symlinks, never read as text), inline files are UTF-8 text.
A verifier sees the final state the same way: a command verifier runs on it in place, a Python
verifier gets a byte-exact copy (a tar made inside, unpacked here).
"""

from __future__ import annotations

import asyncio
import io
import posixpath
import tarfile
import tempfile
from pathlib import Path

from openforgerl.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxError,
    SandboxSpec,
    SandboxStartError,
    SandboxUnavailable,
)
from openforgerl.sandbox.base import Network
from openforgerl.tasks import CommandVerifier, PythonVerifier, Task
from openforgerl.tasks.schema import Files
from openforgerl.tasks.verify import (
    GatewayAccess,
    VerifierError,
    VerifierResult,
    parse_verifier_output,
    reward_from_file,
    run_python_verifier,
    verifier_env,
    write_files,
)

# In the sandbox's temp dir (`Sandbox.tmpdir`), outside the work dir: the agent never sees them.
VERIFIER_DIR = "openforge-verifier"  # a command verifier's files (unless the verifier says `at`)
SOLUTION_DIR = "openforge-solution"  # a reference solution's files (unless the solution says `at`)
WORKDIR_TAR = "openforge-workdir.tar"  # the work dir, copied out for a Python verifier


def task_spec(
    task: Task,
    *,
    limits: Limits,
    network: Network,
    gateway_url: str | None,
    ro_binds: list[str | tuple[str, str]] | None = None,
    hidden: list[str] | None = None,
    timeout_multiplier: float = 1.0,
) -> SandboxSpec:
    """The sandbox a task asks for: its workspace, work dir and verifier dirs, resources and image.
    `limits` are the run's, which the task's own resources override; its wall clock outlasts the
    harness's (the task's timeout x `timeout_multiplier`) by the set-up's and verifier's margin."""
    res = task.resources
    return SandboxSpec(
        files={} if isinstance(task.files, Path) else dict(task.files),
        workspace=task.files if isinstance(task.files, Path) else None,
        workdir=task.workdir,
        extra_dirs=task.inside_dirs(),
        limits=Limits(
            memory_bytes=int(res.memory) if res.memory else limits.memory_bytes,
            cpus=res.cpus or limits.cpus,
            pids=res.pids or limits.pids,
            wall_time_s=task.timeout * timeout_multiplier + 300,
        ),
        network="gateway" if task.offline and network == "host" else network,
        gateway_url=gateway_url,
        ro_binds=ro_binds or [],
        hidden=hidden or [],
        image=task.image,
        build=task.build,
        labels={"task": task.id},
    )


async def set_up(task: Task, sandbox: Sandbox) -> None:
    """The task's setup commands; one that fails is the task's fault, never the policy's."""
    for command in task.setup:
        done = await sandbox.exec(command, timeout=task.timeout)
        if not done.ok:
            raise SandboxStartError(f"setup {command!r} failed ({done.exit_code}): {done.stderr[-500:]}")


async def _put_files(sandbox: Sandbox, files: Files, dest: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        await asyncio.to_thread(write_files, files, Path(tmp))
        await sandbox.put_dir(tmp, dest)


async def run_solution(task: Task, sandbox: Sandbox) -> ExecResult:
    """Runs the task's reference solution in the work dir (its files put first)."""
    solution = task.solution
    if solution is None:
        raise ValueError(f"task {task.id!r} has no reference solution")
    where = solution.at or posixpath.join(sandbox.tmpdir, SOLUTION_DIR)
    if solution.files is not None:
        await _put_files(sandbox, solution.files, where)
    env = {**solution.env, "OPENFORGE_TASK_ID": task.id, "OPENFORGE_SOLUTION_DIR": where}
    return await sandbox.exec(solution.command, env=env, timeout=solution.timeout)


async def verify(task: Task, sandbox: Sandbox, gateway: GatewayAccess | None = None) -> VerifierResult:
    """Scores the sandbox's final state with the task's verifier; VerifierError when the verifier
    fails on that state (the runner scores it 0), VerifierUnavailable when what it needs beyond the
    state fails; the sandbox failing is SandboxStartError, as anywhere."""
    verifier = task.verifier
    if isinstance(verifier, PythonVerifier):
        with tempfile.TemporaryDirectory() as tmp:
            await copy_out(sandbox, Path(tmp))
            return await asyncio.to_thread(run_python_verifier, verifier, Path(tmp), gateway)
    assert isinstance(verifier, CommandVerifier)
    verifier_dir = verifier.at or posixpath.join(sandbox.tmpdir, VERIFIER_DIR)
    if verifier.files is not None:
        try:
            await _put_files(sandbox, verifier.files, verifier_dir)
        except (SandboxStartError, SandboxUnavailable):
            raise
        except (SandboxError, OSError, ValueError) as exc:  # the agent left something in the way
            raise VerifierError(f"could not put the verifier's files at {verifier_dir}: {exc}") from exc
    if verifier.reward_files:  # what an earlier verification (or the agent) wrote must not count
        cleared = await sandbox.exec(["rm", "-f", "--", *verifier.reward_files], timeout=60)
        if not cleared.ok:  # a reward file the agent made undeletable would be read as the reward
            why = cleared.stderr[-500:].strip()
            raise VerifierError(f"could not clear the reward files before the verifier ran: {why}")
    env = {**verifier.env, **verifier_env(task.id, verifier_dir)}
    done = await sandbox.exec(verifier.command, env=env, timeout=verifier.timeout)
    if done.timed_out:
        raise VerifierError(f"the verifier ran over its timeout of {verifier.timeout} s")
    if not verifier.reward_files:
        return parse_verifier_output(done.stdout, done.exit_code, done.stderr)
    for path in verifier.reward_files:
        try:
            data = await sandbox.get_file(path)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise VerifierError(f"could not read the reward file {path}: {exc}") from exc
        result = reward_from_file(path, data)
        return VerifierResult(result.reward, {**result.details, "exit_code": done.exit_code})
    tail = (done.stdout + done.stderr)[-2000:]
    raise VerifierError(
        f"the verifier wrote none of {', '.join(verifier.reward_files)} (exit {done.exit_code}): {tail}"
    )


async def copy_out(sandbox: Sandbox, dest: Path) -> None:
    """Copy the work dir out of the sandbox, byte for byte with modes and symlinks: a tar file made
    inside, read back with get_file, whose limit (hundreds of MiB) is far above an exec's output cap
    (1 MiB), so a state with files like the GUI harness's screenshots comes out whole."""
    archive = posixpath.join(sandbox.tmpdir, WORKDIR_TAR)  # outside the work dir, which it must not contain
    done = await sandbox.exec(["tar", "-cf", archive, "."], timeout=120)
    if not done.ok:
        raise VerifierError(f"could not copy the work dir out of the sandbox: {done.stderr[-300:]}")
    try:
        data = await sandbox.get_file(archive)
    except (OSError, ValueError) as exc:
        raise VerifierError(f"could not copy the work dir out of the sandbox: {exc}") from exc
    finally:
        await sandbox.exec(["rm", "-f", archive], timeout=60)
    # "data": nothing outside `dest`, no device files; the files' own modes stay (less group/other write).
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(dest, filter="data")
