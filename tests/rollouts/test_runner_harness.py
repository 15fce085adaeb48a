"""A real harness CLI inside a bwrap sandbox, on a claw-basic task, through the runner.

Marked `harness`: it needs the pinned CLIs that `make test-harnesses` installs. The policy is the
SCRIPTED test kit playing the task's reference solution, so the verifier must pass.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from openforgerl import tasks as tasks_pkg
from openforgerl.harnesses.adapters import get
from openforgerl.harnesses.launch import cli_harness, python_binds
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import load_tasks
from openforgerl.testing.policy_engine import ScriptedPolicyEngine
from tests.gateway_helpers import calls_of, running_gateway

SOLUTIONS = Path(tasks_pkg.__file__).parent / "suites" / "claw_basic" / "solutions"


@pytest.mark.harness
@pytest.mark.parametrize("name", ["qwen-code", "mini-swe-agent"])
def test_real_harness_solves_a_claw_task_in_a_sandbox(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    harness = get(name)
    if not harness.check().ok:
        pytest.skip(f"{name} is not installed: {harness.check().missing}")
    if not LocalBackend().bwrap:
        pytest.skip("bubblewrap is not installed")
    task = next(t for t in load_tasks("claw-basic") if t.id == "create-hello-script")
    solution = (SOLUTIONS / f"{task.id}.sh").read_text()
    commands = [f"bash -c {_quote(solution)}", "ls"]
    if name == "mini-swe-agent":
        commands.append("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    engine = ScriptedPolicyEngine(tiny_model_dir, commands=commands)
    with running_gateway(tiny_model_dir, tmp_path, engine, max_context=131072) as gw:
        cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="claw",
            state_path=tmp_path / "runner.db",
            ro_binds=[*python_binds(), str(harness.cache_dir)],
        )
        runner = Runner(cfg, LocalBackend(), cli_harness(harness))

        async def go() -> Any:
            try:
                return await runner.run([task.model_copy(update={"timeout": 240})])
            finally:
                await runner.close()

        [r] = asyncio.run(go())
        calls = calls_of(gw, r.gateway_rollout_id)
    assert r.outcome == "ok", r.details
    assert (r.status, r.reward) == (Status.DONE, 1.0), r.details
    assert r.details["verifier"]["passed"] and not r.details["verifier"]["failed"]
    main = [c for c in calls if not c["side_request"]]
    assert len(main) >= 3 and len({c["branch_id"] for c in main}) == 1


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
