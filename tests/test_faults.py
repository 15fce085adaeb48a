"""Transient faults as task data: declared, validated, fired exactly as declared and the same way on
every run; the ReAct harness's tools and any harness's shell (a PATH shim) honour them, and so does
the gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from openforgerl.evaluate import EvalOptions, run_rollouts
from openforgerl.faults import ToolFaults, environment
from openforgerl.harnesses.launch import react_harness
from openforgerl.harnesses.react import run_tool
from openforgerl.rl.oracle_teacher import OracleTeacherEngine
from openforgerl.rollouts.results import RolloutResult
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import Fault, Task, load_tasks
from openforgerl.tasks.suites import tools_tiny
from tests.gateway_helpers import calls_of, running_gateway


def _install(faults: list[Fault], root: Path) -> dict[str, str]:
    """What the runner does in a sandbox, on the host: the spec and shims under `root`."""
    files, env = environment(faults, str(root), path=os.environ["PATH"])
    for path, (content, mode) in files.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
        Path(path).chmod(mode)
    return env


def _sh(command: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", command], env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True
    )


def test_a_fault_is_a_tool_or_command_fault_or_a_gateway_one() -> None:
    assert Fault(tool="read_file", match="b.txt").times == 1
    assert Fault(gateway=[503, 429]).gateway == [503, 429]
    for bad in ({}, {"tool": "read_file", "gateway": [503]}, {"gateway": [404]}, {"command": "rm -rf /"}):
        with pytest.raises(ValidationError):
            Fault.model_validate(bad)
    with pytest.raises(ValidationError, match="times"):
        Fault(tool="bash", times=0)


def test_a_tool_fault_fails_exactly_times_matching_calls_then_lets_them_through(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "b.txt").write_text("7\n")
    (tmp_path / "work" / "a.txt").write_text("3\n")
    env = _install([Fault(tool="read_file", match="b.txt", times=2, error="b.txt: busy")], tmp_path / "tmp")
    faults = ToolFaults.from_env(env)
    assert faults is not None
    work = tmp_path / "work"
    assert run_tool("read_file", {"path": "a.txt"}, work, 5, faults) == "3\n"  # does not match
    for _ in range(2):
        with pytest.raises(OSError, match=r"b\.txt: busy"):
            run_tool("read_file", {"path": "b.txt"}, work, 5, faults)
    assert run_tool("read_file", {"path": "b.txt"}, work, 5, faults) == "7\n"
    # A second process reading the same counters (the next harness step) sees them used up.
    again = ToolFaults.from_env(env)
    assert again is not None and again.error("read_file", "b.txt") is None


def test_a_command_fault_is_a_shim_on_path_that_fails_once_then_runs_the_real_program(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("7\n")
    (tmp_path / "a.txt").write_text("3\n")
    fault = Fault(command="cat", match="b.txt", error="b.txt: Resource temporarily unavailable", exit_code=3)
    env = _install([fault], tmp_path / "tmp")
    assert _sh("cat a.txt", env, tmp_path).stdout == "3\n"
    first = _sh("cat b.txt", env, tmp_path)
    assert first.returncode == 3 and first.stdout == ""
    assert first.stderr == "cat: b.txt: Resource temporarily unavailable\n"
    second = _sh("cat b.txt", env, tmp_path)
    assert (second.returncode, second.stdout) == (0, "7\n")
    # A harness that put its own folders first on PATH still meets the shim, and the real cat after.
    later = {**env, "PATH": f"/nonexistent:{env['PATH']}"}
    assert _sh("cat b.txt", later, tmp_path).stdout == "7\n"


def test_a_fault_on_a_tool_and_a_command_counts_once_whichever_way_the_file_is_read(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "b.txt").write_text("7\n")
    env = _install([tools_tiny.transient_fault("b.txt")], tmp_path / "tmp")
    faults = ToolFaults.from_env(env)
    assert faults is not None
    with pytest.raises(OSError, match="Resource temporarily unavailable"):
        run_tool("read_file", {"path": "b.txt"}, work, 5, faults)
    assert _sh("cat b.txt", env, work).stdout == "7\n"  # its one failure is spent
    # The other order, fresh counters: the ReAct harness's bash tool goes through the shim.
    env = _install([tools_tiny.transient_fault("b.txt")], tmp_path / "tmp2")
    faults = ToolFaults.from_env(env)
    os.environ["PATH"], saved = env["PATH"], os.environ["PATH"]
    try:
        out = run_tool("bash", {"command": "cat b.txt"}, work, 5, faults)
    finally:
        os.environ["PATH"] = saved
    assert out.startswith("exit code 1\n") and "cat: b.txt: Resource temporarily unavailable" in out
    assert run_tool("read_file", {"path": "b.txt"}, work, 5, faults) == "7\n"


def test_tools_tiny_faults_is_tools_tiny_with_a_stated_fraction_faulted_the_same_every_time() -> None:
    clean, faulted = load_tasks("tools-tiny"), load_tasks("tools-tiny-faults")
    assert [(t.id, t.files, t.instruction) for t in clean] == [
        (t.id, t.files, t.instruction) for t in faulted
    ]
    assert not any(t.faults for t in clean)
    assert [t.faults for t in faulted] == [
        t.faults for t in tools_tiny.generate(faults=tools_tiny.FAULT_FRACTION)
    ]
    for split in ("train", "heldout"):
        tasks = [t for t in faulted if t.split == split]
        share = sum(bool(t.faults) for t in tasks) / len(tasks)
        assert abs(share - tools_tiny.FAULT_FRACTION) < 0.1, (split, share)
    for t in faulted:
        if t.faults:  # one fault, on one of the task's own input files, and the tag says so
            (fault,) = t.faults
            assert fault.match in t.metadata["inputs"] and "faulted" in t.tags
            assert fault.error == f"{fault.match}: Resource temporarily unavailable"
    # Another seed draws other faults.
    assert [t.faults for t in tools_tiny.generate(seed=1, faults=0.5)] != [t.faults for t in faulted]


def _faulted(n: int, **changes: object) -> list[Task]:
    tasks = [t for t in load_tasks("tools-tiny-faults", split="train") if t.faults][:n]
    return [t.model_copy(update=changes) for t in tasks]


def test_a_faulted_task_in_a_real_sandbox_meets_its_fault_and_the_retrying_teacher_recovers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = _faulted(3)
    opts = EvalOptions(
        tasks="tools-tiny-faults", split="train", model=str(tiny_model_dir), out=tmp_path, progress=False
    )
    teacher = OracleTeacherEngine(tiny_model_dir, tasks, show_work=True)
    results = run_rollouts(opts, teacher, tasks)
    for task, r in zip(tasks, results, strict=True):
        assert r.reward == 1.0, r.details
        acted = r.details["behaviour"]
        assert (acted["tool_errors"], acted["recovered"], acted["gave_up"]) == (1, True, False)
        # The recorded conversation shows the fault's error where the file was first read.
        (fault,) = task.faults
        text = json.dumps([dataclasses.asdict(c) for c in r.calls])
        assert f"error: {fault.match}: Resource temporarily unavailable" in text
        assert f"{fault.match} could not be read: reading it again." in text


@pytest.mark.parametrize(
    ("statuses", "solved"),
    [([503, 429], True), ([503] * 5, False)],  # the ReAct harness makes 1 + 4 retries
    ids=["retried", "more-than-its-retries"],
)
def test_gateway_faults_answer_the_first_calls_and_the_harness_retries_them(
    statuses: list[int], solved: bool, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = _faulted(1, faults=[Fault(gateway=statuses)])
    teacher = OracleTeacherEngine(tiny_model_dir, tasks)
    with running_gateway(tiny_model_dir, tmp_path, teacher) as gw:
        cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="faults",
            state_path=tmp_path / "runner.db",
        )
        runner = Runner(cfg, LocalBackend(), react_harness())

        async def go() -> list[RolloutResult]:
            try:
                return await runner.run(tasks)
            finally:
                await runner.close()

        (result,) = asyncio.run(go())
        # Every queued error was answered (none is left) ...
        left = httpx.post(
            f"{gw.url}/admin/rollouts/{result.gateway_rollout_id}/faults",
            json={"errors": []},
            headers=gw.admin_headers,
        )
        calls = calls_of(gw, result.gateway_rollout_id)
    assert left.json()["pending_faults"] == []
    if solved:  # ... and the harness's retries then solved the task,
        assert result.reward == 1.0 and calls and all(c["status"] == "ok" for c in calls)
        assert result.details["behaviour"]["tool_errors"] == 0  # an API error is not a tool error
    else:  # ... or ran out: it gave up before the policy answered anything.
        assert (result.outcome, result.reward, calls) == ("crash", 0.0, [])
        assert "HTTP 503" in result.details["harness"]["tail"]
