"""Headroom (rl/headroom.py): the statistics on hand-made runs, `openforge train --check` on a real
model, the loop's measurement before its first step, and the oracle, whose groups never differ."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from openforgerl.cli.train import train_cmd
from openforgerl.eval_stats import pass_at_k
from openforgerl.rl import headroom
from openforgerl.rl.headroom import Headroom, draw_tasks, headroom_of
from openforgerl.rl.loop import TrainOptions, train
from openforgerl.rl.runs import training_tasks
from openforgerl.rollouts.results import RolloutResult, Status
from openforgerl.rollouts.trajectory import Sample

NOTHING = "RL has nothing to work with"


def _runs(rewards: dict[str, list[float]], logprob: float = -0.5) -> list[RolloutResult]:
    """Scored results with one sample each: a prompt token and two sampled tokens at `logprob`."""
    out = []
    for task, rs in rewards.items():
        for i, r in enumerate(rs):
            sample = Sample(
                f"{task}#{i}",
                r,
                0,
                "",
                input_ids=[1, 2, 3],
                loss_mask=[0, 1, 1],
                logprobs=[0.0, logprob, logprob],
            )
            out.append(RolloutResult(task, i, Status.DONE, r, samples=[sample]))
    return out


def test_statistics_of_hand_made_runs() -> None:
    results = _runs({"a": [1, 0, 0, 1], "b": [0, 0, 0, 0], "c": [1, 1, 1, 1], "d": [0, 0, 1, 0]})
    results.append(RolloutResult("a", 4, Status.INFRA_FAILED, None))  # unscored: counted, not used
    results += [RolloutResult("e", 0, Status.DONE, 1.0), RolloutResult("e", 1, Status.INFRA_FAILED, None)]
    h = headroom_of(results, 4, seconds=1.23, temperature=0.7)
    assert h.tasks == 4 and h.rollouts == 19 and h.unscored == 2  # e has fewer than k scored runs
    assert h.pass_at_1 == pytest.approx((0.5 + 0 + 1 + 0.25) / 4)
    assert h.pass_at_k == pytest.approx(3 / 4)  # n = k: pass@k is whether any run passed
    assert h.mixed_fraction == 0.5 and h.all_fail_fraction == 0.25 and h.all_pass_fraction == 0.25
    assert h.sampled_nll == pytest.approx(0.5) and h.sampled_tokens == 2 * 16
    assert h.task_pass_rates == {"a": 0.5, "b": 0.0, "c": 1.0, "d": 0.25}
    assert h.verdict == ["room for RL: pass@4 - pass@1 = 0.312; a share 0.50 of tasks give a signal"]
    # pass@k with more runs than k: the unbiased estimator, as eval_stats computes it.
    h2 = headroom_of(_runs({"a": [1, 0, 0, 0, 0, 0], "b": [1, 1, 0, 0, 0, 0]}), 2)
    assert h2.pass_at_k == pytest.approx((pass_at_k(6, 1, 2) + pass_at_k(6, 2, 2)) / 2)
    assert h2.k == 2 and h2.pass_at_1 == pytest.approx(0.25)
    assert Headroom.from_json(json.loads(json.dumps(h.to_json()))) == h
    metrics = h.metrics()
    assert metrics["headroom/pass_at_k"] == h.pass_at_k and metrics["headroom/mixed_fraction"] == 0.5


def test_verdicts_say_when_rl_has_nothing_to_work_with() -> None:
    # Never solved: no signal, SFT first.
    none = headroom_of(_runs({"a": [0, 0], "b": [0, 0]}), 2)
    assert none.pass_at_k == 0 and none.mixed_fraction == 0 and none.all_fail_fraction == 1
    assert none.verdict[0].startswith(NOTHING) and "no task had mixed outcomes in 2 runs" in none.verdict[0]
    assert "SFT first" in none.verdict[1] and len(none.verdict) == 2
    # Always solved: nothing left to learn.
    solved = headroom_of(_runs({"a": [1, 1], "b": [1, 1]}), 2)
    assert solved.pass_at_1 == solved.pass_at_k == 1 and solved.all_pass_fraction == 1
    assert solved.verdict[0].startswith(NOTHING) and "passed all 2 runs" in solved.verdict[1]
    # Deterministic: the groups agree because sampling barely varies.
    greedy = headroom_of(_runs({"a": [1, 1], "b": [0, 0]}, logprob=-0.01), 2)
    assert greedy.sampled_nll == pytest.approx(0.01)
    assert greedy.verdict[0].startswith(NOTHING)
    assert any(
        "nearly deterministic (sampled NLL 0.010 per token): raise the temperature" in v
        for v in greedy.verdict
    )
    # Little gap between pass@k and pass@1, though some groups are mixed.
    close = headroom_of(_runs({f"t{i}": [1] * 20 for i in range(30)} | {"x": [1] * 19 + [0]}), 2)
    assert 0 < close.mixed_fraction and close.pass_at_k - close.pass_at_1 < headroom.SMALL_GAP
    assert close.verdict == [
        f"pass@1 {close.pass_at_1:.3f} is close to pass@2 {close.pass_at_k:.3f}: little to turn into pass@1"
    ]
    assert "nothing was measured" in headroom_of([], 2).verdict[0]


def test_tasks_are_drawn_from_the_seed_alone(tmp_path: Path) -> None:
    tasks = training_tasks(TrainOptions(model="m", out=tmp_path))
    assert draw_tasks(tasks, 5, 1) == draw_tasks(tasks, 5, 1) != draw_tasks(tasks, 5, 2)
    assert len(draw_tasks(tasks[:3], 5, 0)) == 3


def test_train_check_measures_a_real_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "check"
    args = ["--model", str(tiny_model_dir), "--out", str(out), "--check", "--headroom-tasks", "2"]
    args += ["--headroom-k", "3", "--skip-tasks", "990", "--max-tokens", "8", "--max-turns", "1"]
    got = CliRunner().invoke(train_cmd, args, catch_exceptions=False)
    assert got.exit_code == 0, got.output
    h = json.loads((out / "headroom.json").read_text())
    assert h["k"] == 3 and h["rollouts"] == 6 and h["tasks"] == 2
    for key in ("pass_at_1", "pass_at_k", "mixed_fraction", "all_fail_fraction", "all_pass_fraction"):
        assert 0.0 <= h[key] <= 1.0, key
    assert h["pass_at_1"] <= h["pass_at_k"]
    assert h["sampled_nll"] > 0 and h["sampled_tokens"] > 0  # a random model samples freely
    assert set(h["task_pass_rates"]) <= {t.id for t in training_tasks(TrainOptions(model="m", out=out))[990:]}
    assert "pass@3" in got.output and h["verdict"] and all(f"- {v}" in got.output for v in h["verdict"])
    assert not (out / "run.json").exists() and not (out / "checkpoints").exists()  # nothing trained
    assert (out / "headroom" / "runner.db").is_file()


def test_train_measures_headroom_before_the_first_step_and_not_again_on_resume(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    opts = TrainOptions(
        model=str(tiny_model_dir),
        out=run,
        steps=0,
        skip_tasks=990,
        max_tokens=8,
        max_turns=1,
        concurrency=2,
        progress=False,
        headroom_tasks=2,
        headroom_k=2,
    )
    train(opts)
    h = json.loads((run / "headroom.json").read_text())
    assert h["rollouts"] == 4 and h["sampled_nll"] > 0
    (m,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m["step"] == 0 and m["policy_version"] == 0
    assert m["headroom/pass_at_k"] == h["pass_at_k"] and m["headroom/k"] == 2
    written = (run / "headroom.json").stat().st_mtime_ns
    train(opts, resume=True)
    assert (run / "headroom.json").stat().st_mtime_ns == written
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_the_oracle_leaves_rl_nothing_to_work_with(tiny_model_dir: Path, tmp_path: Path) -> None:
    from openforgerl.rl.oracle_teacher import OracleTeacherEngine

    opts = TrainOptions(
        model=str(tiny_model_dir),
        out=tmp_path / "oracle",
        max_tokens=256,
        concurrency=2,
        progress=False,
        headroom_tasks=3,
        headroom_k=2,
    )
    tasks = draw_tasks(training_tasks(opts), 3, opts.seed)
    h = headroom.check(opts, engine=OracleTeacherEngine(tiny_model_dir, tasks))
    assert h.tasks == 3 and h.rollouts == 6 and h.unscored == 0
    assert h.pass_at_1 == h.pass_at_k == 1.0 and h.mixed_fraction == 0 and h.all_pass_fraction == 1
    assert h.task_pass_rates == {t.id: 1.0 for t in tasks}
    assert h.sampled_nll == 0 and not math.isnan(h.sampled_nll)  # the oracle records logprob 0.0
    assert h.verdict[0] == f"{NOTHING}: no task had mixed outcomes in 2 runs (every group would be dropped)"
    assert headroom.read(opts.out) == h
