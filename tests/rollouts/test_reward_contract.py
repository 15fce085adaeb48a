"""The reward's contract (docs/architecture.md): what the agent can cause scores 0 and stays in every
figure; only what it cannot cause is infrastructure, retried and counted beside pass@k. Also
timeouts in RL (left out of the update by default, counted per step) and verifier details bounded."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from click.testing import CliRunner

from openforgerl.engines.base import EngineUnavailable
from openforgerl.evaluate import EvalOptions, run_eval
from openforgerl.harnesses.launch import HarnessLaunch
from openforgerl.rl import loop, runs
from openforgerl.rl.loop import TrainOptions, collect_step, step_line
from openforgerl.rollouts.results import RunState, Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.rollouts.service import RolloutService
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import CommandVerifier, PythonVerifier, Task, load_tasks
from openforgerl.tasks.verify import DETAILS_LIMIT, bounded_details
from tests.gateway_helpers import ScriptEngine, running_gateway

REWARD = "/logs/verifier/reward.txt"


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def agent(engine: ScriptEngine) -> ScriptEngine:
    """A SCRIPTED agent: runs the shell command its task's instruction gives after `Run: `, then
    submits."""

    def step(prompt: list[int]) -> str:
        text = str(engine.tokenizer.decode(prompt))
        if "<tool_response>" in text:
            return tool_call("submit", {"answer": "done"})
        match = re.search(r"Run: (.*?)<\|im_end\|>", text)
        assert match, text[-500:]
        return tool_call("bash", {"command": match.group(1).strip()})

    engine.script = step
    return engine


def task_set(path: Path, tasks: list[dict[str, Any]]) -> str:
    path.write_text(yaml.safe_dump([{"split": "test", **t} for t in tasks]))
    return str(path)


# What an agent can do to its verifier, each scored 0; and a task whose sandbox cannot start.
SABOTAGE = [
    {"id": "solved", "instruction": "Run: printf ok > a.txt", "verifier": {"command": "grep -qx ok a.txt"}},
    {  # the test runs a program the agent left, which hangs: the verifier times out
        "id": "leaves-a-program-hanging",
        "instruction": "Run: printf 'sleep 60' > check.sh",
        "verifier": {"command": "sh check.sh", "timeout": 1},
    },
    {  # the reward file cannot be written
        "id": "locks-the-reward-dir",
        "instruction": f"Run: chmod 555 {Path(REWARD).parent}",
        "verifier": {"command": f"echo 1 > {REWARD}", "reward_files": [REWARD]},
    },
    {  # a reward written ahead, in a folder the verifier can no longer clear: it must not count
        "id": "forges-the-reward",
        "instruction": f"Run: echo 1 > {REWARD}; chmod 444 {REWARD}; chmod 555 {Path(REWARD).parent}",
        "verifier": {"command": f"echo 0 > {REWARD}", "reward_files": [REWARD]},
    },
    {  # the tests cannot run what the agent left (pytest's exit 2: collection failed)
        "id": "breaks-the-tests",
        "instruction": "Run: printf 'syntax error(' > code.py",
        "verifier": {"command": "python3 -c 'import ast; ast.parse(open(\"code.py\").read())' || exit 2"},
    },
    {  # a folder where the verifier's own file goes: it cannot even be put in place
        "id": "blocks-the-tests",
        "instruction": "Run: mkdir -p /tests/test.sh",
        "verifier": {"command": "sh /tests/test.sh", "files": {"test.sh": "exit 0"}, "at": "/tests"},
    },
    {  # the agent cannot cause this: the sandbox never comes up (its set-up fails every time)
        "id": "sandbox-fails",
        "instruction": "Run: true",
        "setup": ["exit 3"],
        "verifier": {"command": "true"},
    },
]


def test_what_the_agent_causes_scores_0_and_only_infrastructure_is_left_out(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tasks = task_set(tmp_path / "tasks.yaml", SABOTAGE)
    opts = EvalOptions(tasks=tasks, model=str(tiny_model_dir), out=tmp_path / "eval", progress=False)
    report = run_eval(opts, agent(ScriptEngine(tiny_model_dir)))
    results = RunState(opts.out / "runner.db").load()
    rewards = {t["task_id"]: t["mean_reward"] for t in report["summary"]["per_task"]}
    assert rewards == {
        "solved": 1.0,
        "leaves-a-program-hanging": 0.0,
        "locks-the-reward-dir": 0.0,
        "forges-the-reward": 0.0,
        "breaks-the-tests": 0.0,
        "blocks-the-tests": 0.0,
    }
    # Every figure counts them: pass@1 is 1 of 6, not 1 of the 1 (or 2, forged) left after exclusions.
    assert report["summary"]["pass@k"]["1"]["estimate"] == pytest.approx(1 / 6)
    assert report["summary"]["mean_reward"]["estimate"] == pytest.approx(1 / 6)
    errors = {key.split("#")[0]: r.details.get("verifier_error", "") for key, r in results.items()}
    assert "ran over its timeout" in errors["leaves-a-program-hanging"]
    assert "wrote none of /logs/verifier/reward.txt" in errors["locks-the-reward-dir"]
    assert "could not clear the reward files" in errors["forges-the-reward"]
    assert "exited with status 2" in errors["breaks-the-tests"]
    assert "could not put the verifier's files at /tests" in errors["blocks-the-tests"]
    # The sandbox that never started: retried, then counted beside pass@k and in no figure.
    failed = results["sandbox-fails#0"]
    assert (failed.status, failed.reward, failed.attempts) == (Status.INFRA_FAILED, None, 3)
    assert report["tasks_without_k_scored_runs"] == ["sandbox-fails"]
    assert (report["infra_failed"], report["verifier_errors"], report["timed_out"]) == (1, 5, 0)
    md = (opts.out / "report.md").read_text()
    figures = md.index("| pass@1 |")
    assert 0 < md.index("infrastructure failures: 1 (retried, then in no figure)") < figures
    assert "verifier errors on the agent's state: 5 (scored 0)" in md


class Outage(ScriptEngine):
    """The engine is unavailable to the first `outages` calls (a server restarting)."""

    outages = 1

    async def generate(
        self, prompt_ids: list[int], sampling: Any, images: Any = (), on_tokens: Any = None
    ) -> Any:
        if self.outages > 0:
            self.outages -= 1
            raise EngineUnavailable("restarting", retry_after=0.1)
        return await super().generate(prompt_ids, sampling, images, on_tokens)


def test_an_engine_outage_is_infrastructure_whatever_the_rollout_scored(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The harness retried past the outage and passed, but the rollout did not meet the policy
    alone: it runs again (a rollout that failed on it would not count against the policy either)."""
    tasks = task_set(tmp_path / "tasks.yaml", SABOTAGE[:1])
    opts = EvalOptions(tasks=tasks, model=str(tiny_model_dir), out=tmp_path / "eval", progress=False)
    report = run_eval(opts, agent(Outage(tiny_model_dir)))
    [r] = RunState(opts.out / "runner.db").load().values()
    assert (r.status, r.reward, r.attempts) == (Status.DONE, 1.0, 2)
    assert report["infra_failed"] == 0 and report["summary"]["pass@k"]["1"]["estimate"] == 1.0


def shell(*commands: str) -> Any:
    """A harness running `commands[i]` in its i-th rollout (the last one after that)."""
    runs: list[str] = []

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
        runs.append(commands[min(len(runs), len(commands) - 1)])
        return HarnessLaunch(["sh", "-c", runs[-1]], {})

    return launch


def run_one(gw: Any, tmp_path: Path, task: Task, **cfg: Any) -> Any:
    """`task` run once by a runner on the local backend against `gw`, its harness doing nothing."""
    runner = Runner(
        RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="test",
            state_path=tmp_path / "runner.db",
            **cfg,
        ),
        LocalBackend(),
        shell("true"),
    )

    async def go() -> Any:
        try:
            return await runner.run([task])
        finally:
            await runner.close()

    [r] = asyncio.run(go())
    return r


def test_a_verifiers_details_are_bounded_and_say_they_were_cut(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 20 MB in one field of reward.json (what the agent's program printed, say), beside small ones.
    huge = "x" * 20_000_000
    write = (
        """{ printf '{"reward": 1, "passed": 3, "log": "'; cat big; printf '"}'; } > /logs/verifier/r.json"""
    )
    task = Task(
        id="big",
        instruction="anything",
        split="test",
        files={"big": huge},
        verifier=CommandVerifier(command=write, reward_files=["/logs/verifier/r.json"]),
    )
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        r = run_one(gw, tmp_path, task)
    stored = RunState(tmp_path / "runner.db").load()["big#0"].details["verifier"]
    assert r.reward == 1.0 and len(json.dumps(stored)) < DETAILS_LIMIT + 1000
    assert stored["passed"] == 3 and stored["reward_file"] == "/logs/verifier/r.json"
    assert stored["exit_code"] == 0  # the small fields whole, the big one cut, and said so
    assert stored["log"].startswith("xxx") and stored["log"].endswith("characters left out]")
    assert "the verifier's details were 200" in stored["_truncated"] and "log" in stored["_truncated"]
    # Small details stay as they are; many fields keep what fits and name what was left out.
    assert bounded_details({"a": 1, "b": [1, 2]}) == {"a": 1, "b": [1, 2]}
    many = bounded_details({f"f{i}": "y" * 100 for i in range(2000)}, limit=10_000)
    assert len(json.dumps(many)) < 11_000 and "field(s) cut or left out" in many["_truncated"]


# ---- timeouts in RL -----------------------------------------------------------------------------


class Shell:
    """The run's harness in an RL step: `shell`'s commands, nothing to install."""

    def __init__(self, *commands: str) -> None:
        self.launch = shell(*commands)

    def ro_binds(self, tasks: Any) -> list[str]:
        return []

    async def __call__(self, *args: Any) -> HarnessLaunch:
        return await self.launch(*args)


def one_copy_task(**update: Any) -> Task:
    copy = next(t for t in load_tasks("tools-tiny", split="train") if t.metadata["family"] == "copy")
    return copy.model_copy(update={"timeout": 1.5, **update})


SOLVE = 'for f in *.txt; do cp "$f" answer.txt; done'


@pytest.mark.parametrize(
    ("on_timeout", "timeout_is_failure", "trained"),
    [
        ("exclude", False, [1.0]),  # the default: the timed-out rollout is not in the trained batch
        ("zero", False, [0.0, 1.0]),  # --on-timeout zero: trained on with reward 0
        ("exclude", True, [0.0, 1.0]),  # the task says the time limit is part of it
    ],
)
def test_a_timed_out_rollout_in_rl_is_left_out_by_default_and_counted(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    on_timeout: Any,
    timeout_is_failure: bool,
    trained: list[float],
) -> None:
    task = one_copy_task(timeout_is_failure=timeout_is_failure)
    opts = TrainOptions(
        model=str(tiny_model_dir), out=tmp_path / "run", group=2, batch_tasks=1, concurrency=1,
        progress=False, on_timeout=on_timeout,
    )  # fmt: skip
    monkeypatch.setattr(runs, "harness_choice", lambda o: Shell("sleep 30", SOLVE))
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        got = collect_step(RolloutService.of(gw), opts, [task], 1)
        # The held-out evaluation during training scores a timeout 0, as `openforge eval` does.
        monkeypatch.setattr(runs, "harness_choice", lambda o: Shell("sleep 30"))
        held_out = loop.evaluate(RolloutService.of(gw), opts, [task], 1)
    assert [r.outcome for r in got.results] == ["timeout", "ok"]
    assert sorted(float(r.reward or 0.0) for r in got.rollouts) == trained
    excluded = len(got.results) - len(trained)
    assert got.metrics == {"timed_out": 1, "timed_out_excluded": excluded}
    line = step_line(1, {"reward_mean": 1.0, "pass_rate": 1.0, "rollouts": 1, **got.metrics})
    assert "timed out 1" in line and ("(1 left out)" in line) == bool(excluded)
    assert held_out["eval/timed_out"] == 1 and held_out["eval/tasks"] == 1
    assert held_out["eval/pass@1"] == 0.0 and held_out["eval/infra_failed"] == 0


def test_eval_scores_a_timeout_0_and_counts_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = task_set(
        tmp_path / "tasks.yaml",
        [{"id": "slow", "instruction": "Run: sleep 30", "timeout": 1.5, "verifier": {"command": "true"}}],
    )
    opts = EvalOptions(tasks=tasks, model=str(tiny_model_dir), out=tmp_path / "eval", progress=False)
    report = run_eval(opts, agent(ScriptEngine(tiny_model_dir)))
    assert report["timed_out"] == 1 and report["scored"] == 1
    assert report["summary"]["mean_reward"]["estimate"] == 0.0
    assert "timed out: 1 (scored by on_failure zero)" in (opts.out / "report.md").read_text()


def test_train_takes_on_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openforgerl.cli.train import train_cmd

    seen: list[TrainOptions] = []

    def train(opts: TrainOptions, resume: bool = False) -> dict[str, Any]:
        seen.append(opts)
        return {"steps": 0, "policy_version": 0, "checkpoint": None, "metrics": ""}

    monkeypatch.setattr(loop, "train", train)
    args = ["--model", "m", "--out", str(tmp_path / "r")]
    for extra, expected in (([], "exclude"), (["--on-timeout", "zero"], "zero")):
        done = CliRunner().invoke(train_cmd, [*args, *extra])
        assert done.exit_code == 0, done.output
        assert seen[-1].on_timeout == expected
    bad = CliRunner().invoke(train_cmd, [*args, "--on-timeout", "verify"])
    assert bad.exit_code == 2 and "--on-timeout" in bad.output
    assert TrainOptions.from_json(seen[-1].to_json()).on_timeout == "zero"  # kept for --resume
    assert "--on-timeout [exclude|zero]" in CliRunner().invoke(train_cmd, ["--help"]).output
    with pytest.raises(ValueError, match="on_timeout"):
        TrainOptions(model="m", out=tmp_path, on_timeout="drop")  # type: ignore[arg-type]


def test_a_gateway_row_says_closed_for_a_scored_verifier_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A verifier error is a scored rollout: its gateway rollout is closed with the reward 0."""
    task = one_copy_task(verifier=CommandVerifier(command="exit 2"))
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        r = run_one(gw, tmp_path, task)
        row = httpx.get(f"{gw.url}/admin/rollouts/{r.gateway_rollout_id}", headers=gw.admin_headers).json()
    assert (r.status, r.reward, r.outcome, r.attempts) == (Status.DONE, 0.0, "verifier_error", 1)
    assert (row["status"], row["reward"]) == ("closed", 0.0)


def test_a_verifier_that_cannot_be_loaded_is_infrastructure(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The task's own code, not the agent's state: retried, then infra_failed, never a 0."""
    task = one_copy_task(verifier=PythonVerifier(python="no_such_module:check"))
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        r = run_one(gw, tmp_path, task, infra_retries=1)
    assert (r.status, r.reward, r.attempts) == (Status.INFRA_FAILED, None, 2)
    assert all("cannot be loaded" in e and "no_such_module" in e for e in r.details["infra_errors"])
