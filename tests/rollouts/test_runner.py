"""The runner: rollouts in local sandboxes through the gateway, failures, retries and restarts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from openforgerl.evaluate import EvalOptions, run_eval, run_rollouts
from openforgerl.harnesses.launch import HarnessLaunch, react_harness
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import SandboxSpec, SandboxStartError
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import CommandVerifier, Task, load_tasks
from openforgerl.tasks.suites.tools_tiny import oracle
from tests.gateway_helpers import ScriptEngine, running_gateway

TASKS = load_tasks("tools-tiny", split="heldout")[:3]
DONE = "SELECT key, gateway_rollout_id FROM rollouts WHERE status='done'"


def oracle_engine(model_dir: Path) -> ScriptEngine:
    """A SCRIPTED policy for tests: the tools-tiny oracle's calls, then submit."""
    engine = ScriptEngine(model_dir)

    def step(prompt: list[int]) -> str:
        text = engine.tokenizer.decode(prompt)
        task = next(t for t in TASKS if t.instruction in text)
        solution = oracle(task)
        done = text.count("<tool_response>")
        if done < len(solution.calls):
            return solution.calls[done].text()
        answer = json.dumps({"name": "submit", "arguments": {"answer": solution.final_answer}})
        return f"<tool_call>\n{answer}\n</tool_call>"

    engine.script = step
    return engine


def config(gw: Any, tmp_path: Path, **kw: Any) -> RunnerConfig:
    return RunnerConfig(
        gateway_url=gw.url,
        admin_token=gw.gateway.admin_token,
        run_id="test",
        state_path=tmp_path / "runner.db",
        **kw,
    )


def shell_harness(command: str) -> Any:
    async def launch(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
        return HarnessLaunch(["sh", "-c", command], {})

    return launch


def test_eval_with_the_oracle_policy_scores_every_task(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = oracle_engine(tiny_model_dir)
    opts = EvalOptions(
        tasks="tools-tiny",
        split="heldout",
        limit=3,
        k=2,
        model=str(tiny_model_dir),
        out=tmp_path,
        progress=False,
    )
    report = run_eval(opts, engine)
    assert report["status"] == {"done": 6}
    assert report["summary"]["pass@k"]["2"]["estimate"] == 1.0
    assert report["summary"]["pass^k"]["2"]["estimate"] == 1.0
    # One merged sequence per rollout: the ReAct loop extends its conversation every turn.
    training = report["tokens"]["training"]
    assert training["samples"] == 6 and training["tokens_merged"] < training["tokens_per_call"]
    assert "pass@2" in (tmp_path / "report.md").read_text()
    # Figures per task family (the tag every task has, the suite's, is left out).
    families = {t.metadata["family"] for t in TASKS}
    assert len(families) > 1 and set(report["by_tag"]) == families
    assert all(v["pass@k"]["1"] == 1.0 and v["runs"] == 2 * v["tasks"] for v in report["by_tag"].values())
    assert "| tag | tasks |" in (tmp_path / "report.md").read_text()


def test_a_seeded_evaluation_repeats_exactly_and_each_run_of_a_task_has_its_own_seed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real engine at temperature 1 with 4 rollouts in flight (batched decoding): the same seed
    gives the same tokens for every (task, run); another seed and another run of a task do not."""

    def tokens(seed: int, out: str) -> dict[tuple[str, int], list[list[int]]]:
        opts = EvalOptions(
            tasks="tools-tiny",
            split="heldout",
            limit=2,
            n=2,
            model=str(tiny_model_dir),
            out=tmp_path / out,
            max_tokens=12,
            max_turns=2,
            temperature=1.0,
            seed=seed,
            progress=False,
        )
        results = run_rollouts(opts)  # the embedded gateway's own TransformersEngine
        assert len(results) == 4 and all(r.status == Status.DONE for r in results)
        return {(r.task_id, r.sample): [list(c.completion_ids) for c in r.calls] for r in results}

    first, again, other = tokens(3, "a"), tokens(3, "b"), tokens(4, "c")
    assert first == again
    assert all(first[key] != other[key] for key in first)
    assert all(first[(task, 0)] != first[(task, 1)] for task, _ in first)


@pytest.mark.parametrize(
    ("command", "on_failure", "status", "outcome", "reward"),
    [
        ("exit 3", "zero", Status.DONE, "crash", 0.0),
        # 3 MB of output: captured head and tail only, and the run goes on.
        ("head -c 3000000 /dev/zero | tr '\\0' x; exit 3", "zero", Status.DONE, "crash", 0.0),
        ("sleep 60", "zero", Status.DONE, "timeout", 0.0),
        ("exit 3", "drop", Status.DROPPED, "crash", None),
        # The verifier judges the partial state: the right answer was written before the crash.
        ('for f in *.txt; do cp "$f" answer.txt; done; exit 3', "verify", Status.DONE, "crash", None),
    ],
)
def test_policy_failures_are_scored_by_the_configured_policy(
    tiny_model_dir: Path,
    tmp_path: Path,
    command: str,
    on_failure: Any,
    status: Status,
    outcome: str,
    reward: Any,
) -> None:
    copy_task = next(t for t in load_tasks("tools-tiny", split="train") if t.metadata["family"] == "copy")
    task = copy_task.model_copy(update={"timeout": 2.0})
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        runner = Runner(config(gw, tmp_path, on_failure=on_failure), LocalBackend(), shell_harness(command))

        async def go() -> Any:
            try:
                return await runner.run([task])
            finally:
                await runner.close()

        [r] = asyncio.run(go())
        row = httpx.get(f"{gw.url}/admin/rollouts/{r.gateway_rollout_id}", headers=gw.admin_headers).json()
    assert (r.status, r.outcome) == (status, outcome)
    if on_failure == "verify":
        assert r.reward == 1.0
    else:
        assert r.reward == reward
    assert row["status"] == ("closed" if status == Status.DONE else "failed")


@pytest.mark.parametrize(("multiplier", "outcome", "reward"), [(1.0, "timeout", 0.0), (3.0, "ok", 1.0)])
def test_the_timeout_multiplier_stretches_every_harness_wall_clock(
    tiny_model_dir: Path, tmp_path: Path, multiplier: float, outcome: str, reward: float
) -> None:
    """A harness that needs 3 s of a 2 s task: stopped at 2 s, or finishes and passes at x3 (a
    loaded machine's rollouts are not scored by its load)."""
    copy_task = next(t for t in load_tasks("tools-tiny", split="train") if t.metadata["family"] == "copy")
    task = copy_task.model_copy(update={"timeout": 2.0})
    harness = shell_harness('sleep 3; for f in *.txt; do cp "$f" answer.txt; done')
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        runner = Runner(config(gw, tmp_path, timeout_multiplier=multiplier), LocalBackend(), harness)

        async def go() -> Any:
            try:
                return await runner.run([task])
            finally:
                await runner.close()

        [r] = asyncio.run(go())
    assert (r.status, r.outcome, r.reward) == (Status.DONE, outcome, reward)


class FlakyBackend(LocalBackend):
    """Fails to start the first sandbox (an infrastructure fault), then works."""

    failures = 1

    def create(self, spec: SandboxSpec, name: str) -> Any:
        sandbox = super().create(spec, name)
        if FlakyBackend.failures > 0:
            FlakyBackend.failures -= 1

            async def broken_start() -> None:
                raise SandboxStartError("injected: the sandbox did not come up")

            sandbox.start = broken_start  # type: ignore[method-assign]
        return sandbox


def test_infrastructure_failures_are_retried_not_counted(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = oracle_engine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        runner = Runner(config(gw, tmp_path), FlakyBackend(), react_harness())

        async def go() -> Any:
            try:
                return await runner.run(TASKS[:1])
            finally:
                await runner.close()

        [r] = asyncio.run(go())
        failed = httpx.get(f"{gw.url}/admin/rollouts?status=failed", headers=gw.admin_headers).json()
    assert r.status == Status.DONE and r.reward == 1.0 and r.attempts == 2
    assert len(failed["rollouts"]) == 1  # the broken attempt's gateway rollout, closed as failed


def test_restart_resumes_without_redoing_finished_rollouts(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = oracle_engine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:

        async def run_once() -> Any:
            runner = Runner(config(gw, tmp_path, concurrency=2), LocalBackend(), react_harness())
            try:
                return await runner.run(TASKS, samples=1)
            finally:
                await runner.close()

        first = asyncio.run(run_once())
        calls_before = len(engine.prompts)
        # As if the runner had been killed while the last rollout ran: its state says running.
        with sqlite3.connect(tmp_path / "runner.db") as db:
            db.execute("UPDATE rollouts SET status='running' WHERE key=?", (first[-1].key,))
        second = asyncio.run(run_once())
        listed = httpx.get(f"{gw.url}/admin/rollouts?run_id=test", headers=gw.admin_headers).json()[
            "rollouts"
        ]
    assert [r.status for r in second] == [Status.DONE] * 3
    assert [r.gateway_rollout_id for r in second[:2]] == [r.gateway_rollout_id for r in first[:2]]
    assert second[-1].gateway_rollout_id != first[-1].gateway_rollout_id  # only the interrupted one re-ran
    assert len(engine.prompts) - calls_before == len(oracle(TASKS[-1]).calls) + 1
    assert sorted(r["status"] for r in listed) == ["cancelled", "closed", "closed", "closed"]


def test_cancellation_leaves_no_sandbox_behind(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "sandboxes"
    state.mkdir()
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        backend = LocalBackend(state_dir=state)
        runner = Runner(config(gw, tmp_path, concurrency=3), backend, shell_harness("sleep 60"))

        async def go() -> None:
            task = asyncio.ensure_future(runner.run([t.model_copy(update={"timeout": 120}) for t in TASKS]))
            await asyncio.sleep(3)
            task.cancel()  # what Ctrl-C does to the running event loop
            with pytest.raises(asyncio.CancelledError):
                await task
            await runner.close()

        asyncio.run(go())
    assert not any(state.iterdir())  # every sandbox's directory is gone


def test_eval_killed_mid_run_resumes_without_losing_or_repeating(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`openforge eval` killed with SIGKILL, then run again on the same folder."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "openforgerl.cli", "eval", "--tasks", "tools-tiny", "--split", "heldout"]
    cmd += ["--limit", "4", "--k", "2", "--model", str(tiny_model_dir), "--out", str(out)]
    cmd += ["--concurrency", "2", "--max-tokens", "8", "--max-turns", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = out / "runner.db"

    def finished() -> int:
        if not state.exists():
            return 0
        try:
            with sqlite3.connect(state) as db:
                return int(db.execute("SELECT COUNT(*) FROM rollouts WHERE status='done'").fetchone()[0])
        except sqlite3.OperationalError:  # the file exists before the runner has created its table
            return 0

    deadline = time.monotonic() + 300
    while finished() < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and everything it started, no clean-up at all
    proc.wait()
    with sqlite3.connect(state) as db:
        before = dict(
            db.execute("SELECT key, gateway_rollout_id FROM rollouts WHERE status='done'").fetchall()
        )
    assert 2 <= len(before) < 8
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    with sqlite3.connect(state) as db:
        after = dict(
            db.execute("SELECT key, gateway_rollout_id FROM rollouts WHERE status='done'").fetchall()
        )
        statuses = [r[0] for r in db.execute("SELECT status FROM rollouts")]
    assert len(after) == 8 and statuses == ["done"] * 8  # every task sample exactly once
    assert all(after[k] == v for k, v in before.items())  # finished rollouts were not run again
    report = json.loads((out / "report.json").read_text())
    assert report["rollouts"] == 8 and report["scored"] == 8


def test_rollouts_finish_in_unisolated_sandboxes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Without bwrap a sandbox's paths are host paths: the harness's task file, the verifier's files and
    the work dir's copy-out go to the sandbox's own temp dir, never the host's /tmp."""
    answer = oracle(TASKS[1]).final_answer
    command = CommandVerifier(
        command='sh "$OPENFORGE_VERIFIER_DIR/check.sh"',
        files={"check.sh": f'test "$(cat answer.txt)" = "{answer}"\n'},
    )
    tasks = [TASKS[0], TASKS[1].model_copy(update={"verifier": command})]
    state = tmp_path / "sandboxes"
    state.mkdir()
    with running_gateway(tiny_model_dir, tmp_path, oracle_engine(tiny_model_dir)) as gw:
        runner = Runner(config(gw, tmp_path), LocalBackend(bwrap=False, state_dir=state), react_harness())

        async def go() -> Any:
            try:
                return await runner.run(tasks)
            finally:
                await runner.close()

        results = asyncio.run(go())
    assert [(r.status, r.outcome, r.reward) for r in results] == [(Status.DONE, "ok", 1.0)] * 2, [
        r.details for r in results
    ]
    assert not any(state.iterdir())
