"""`make demo`'s pipeline end to end at toy sizes: teacher, SFT, GRPO, three held-out evaluations,
the report and the curve; and a rerun that continues instead of starting over."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from openforgerl import demo
from openforgerl.settings import settings_of
from openforgerl.tasks import load_tasks

pytestmark = pytest.mark.timeout(900)

TOY = dict(
    teacher_tasks=4,
    sft_epochs=2,
    rl_steps=2,
    rl_group=2,
    rl_batch_tasks=1,
    eval_tasks=2,
    eval_n=2,
    headroom_tasks=2,
    headroom_k=2,
    concurrency=4,
    progress=False,
)


def test_every_demo_setting_is_an_option_and_a_recipe_yields_to_the_options_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m openforgerl.demo`'s options are DemoConfig's settings: a field added there is an
    option at once. The run gets the defaults, then the recipe's settings, then the options given."""
    from openforgerl.demo import command

    params = {p.name for p in command.demo_cmd.params}
    assert {s.param for s in settings_of(demo.DemoConfig)} <= params
    seen: list[demo.DemoConfig] = []

    class Stop(Exception):
        pass

    def fake_run(cfg: demo.DemoConfig) -> None:
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(command.pipeline, "run", fake_run)
    args = ["--recipe", "smollm2", "--rl-steps", "9", "--no-greedy-eval", "--eval-tasks", "none"]
    result = CliRunner().invoke(command.demo_cmd, [*args, "--out", str(tmp_path / "d"), "--until", "sft"])
    assert isinstance(result.exception, Stop), result.output
    (cfg,) = seen
    assert cfg.pretrained == "smollm2-135m-instruct" and cfg.rl_lr == demo.RECIPES["smollm2"]["rl_lr"]
    assert (cfg.teacher_suite, cfg.rl_suite) == ("tools-tiny", "tools-tiny-varied")  # `make demo`'s
    assert cfg.rl_steps == 9 and cfg.greedy_eval is False and cfg.eval_tasks is None  # given: they win
    assert cfg.out == tmp_path / "d" and cfg.until == "sft"
    assert cfg.sft_eval_every == demo.DemoConfig.sft_eval_every  # in neither: the default
    result = CliRunner().invoke(command.demo_cmd, ["--quick", "--seed", "3"])
    assert isinstance(result.exception, Stop) and seen[-1].teacher_tasks == demo.QUICK["teacher_tasks"]
    assert seen[-1].seed == 3
    result = CliRunner().invoke(command.demo_cmd, ["--recipe", "tiny", "--out", str(tmp_path / "t")])
    assert isinstance(result.exception, Stop)  # `make demo RECIPE=tiny`: the defaults, the tiny model
    assert seen[-1] == demo.DemoConfig(out=tmp_path / "t")
    for bad in (["--quick", "--recipe", "smollm2"], ["--rl-lr", "0"], ["--size", "huge"]):
        result = CliRunner().invoke(command.demo_cmd, bad)
        assert result.exit_code == 2 and len(seen) == 3, (bad, result.output)
    # The recipe's RL tasks and --faults' contradict: the error says how to have the faults.
    result = CliRunner().invoke(command.demo_cmd, ["--recipe", "smollm2", "--faults"])
    assert result.exit_code == 2 and "--no-rl-varied" in result.output
    result = CliRunner().invoke(command.demo_cmd, ["--recipe", "smollm2", "--faults", "--no-rl-varied"])
    assert isinstance(result.exception, Stop) and seen[-1].faults and seen[-1].rl_suite == "tools-tiny-faults"


def test_demo_rl_settings_reach_the_trainer(tmp_path: Path) -> None:
    """The demo's RL knobs become `openforge train`'s settings: updates per step, the scale of the
    negative advantages and the ptx term on the teacher's trajectories."""
    teacher = tmp_path / "teacher" / "samples.jsonl"
    plain = demo.rl_options(demo.DemoConfig(), tmp_path / "sft", tmp_path / "rl", teacher)
    assert plain.trainer.mini_batches == plain.trainer.ppo_epochs == 1
    assert plain.trainer.neg_adv_scale == 1.0 and plain.trainer.ptx_coef == 0 and plain.ptx_data is None
    assert plain.trainer.lr == 1e-4 and plain.trainer.warmup_steps == 3 and plain.temperature == 0.7
    cfg = demo.DemoConfig(rl_mini_batches=4, rl_ppo_epochs=2, rl_neg_adv_scale=0.25, rl_ptx_coef=0.5)
    opts = demo.rl_options(cfg, tmp_path / "sft", tmp_path / "rl", teacher)
    assert (opts.trainer.mini_batches, opts.trainer.ppo_epochs) == (4, 2)
    assert opts.trainer.neg_adv_scale == 0.25
    assert opts.trainer.ptx_coef == 0.5 and opts.ptx_data == str(teacher)
    assert (
        not opts.curriculum
        and demo.rl_options(
            demo.DemoConfig(rl_curriculum=True), tmp_path / "sft", tmp_path / "rl", teacher
        ).curriculum
    )


def test_rl_varied_moves_rl_to_the_paraphrased_suite_and_leaves_the_teacher_on_tools_tiny(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openforgerl.demo import command

    args = (tmp_path / "sft", tmp_path / "rl", tmp_path / "t.jsonl")
    assert demo.rl_options(demo.DemoConfig(), *args).tasks == "tools-tiny"
    varied = demo.DemoConfig(rl_varied=True)
    assert demo.rl_options(varied, *args).tasks == "tools-tiny-varied"
    assert varied.teacher_suite == "tools-tiny"  # what the teacher solves for SFT
    with pytest.raises(ValueError, match="choose one"):
        demo.DemoConfig(rl_varied=True, faults=True)
    monkeypatch.setattr(command.pipeline, "run", lambda cfg: pytest.fail("ran with contradicting settings"))
    result = CliRunner().invoke(command.demo_cmd, ["--rl-varied", "--faults"])
    assert result.exit_code == 2 and "choose one" in result.output


def test_the_demos_engine_serves_rl_and_every_evaluation(tmp_path: Path, monkeypatch: Any) -> None:
    """`--engine vllm`: the GRPO run and each held-out evaluation start that engine, not the built-in one."""
    from openforgerl import evaluate

    cfg = demo.DemoConfig(out=tmp_path, engine="vllm")
    assert demo.rl_options(demo.DemoConfig(), tmp_path, tmp_path, tmp_path).engine == "builtin"
    assert demo.rl_options(cfg, tmp_path / "sft", tmp_path / "rl", tmp_path / "t.jsonl").engine == "vllm"
    seen: list[Any] = []
    monkeypatch.setattr(evaluate, "run_eval", lambda opts: seen.append(opts) or {})
    demo.evaluate_model(cfg, tmp_path / "sft", "sft")
    demo.evaluate_model(cfg, tmp_path / "sft", "sft-greedy", greedy=True)
    assert [(o.engine, o.temperature, o.n) for o in seen] == [("vllm", 0.7, 4), ("vllm", 0.0, 1)]


def test_demo_runs_every_phase_writes_the_report_and_a_rerun_redoes_nothing(tmp_path: Path) -> None:
    cfg = dataclasses.replace(demo.DemoConfig(out=tmp_path / "demo"), **TOY)  # type: ignore[arg-type]
    report = demo.run(cfg)
    out = tmp_path / "demo"

    # The oracle teacher solves every task it is given; SFT trains on all of them and learns.
    assert report["sft"]["samples"] == 4
    assert report["sft"]["loss_after"] < report["sft"]["loss_before"]
    # The evaluated held-out tasks' oracle trajectories are measured during SFT, never trained on.
    assert report["sft"]["val_samples"] == 2
    assert report["sft"]["val_loss_after"] < report["sft"]["val_loss_before"]

    # Held-out evaluations only, each with n runs per task and an interval: before SFT, after SFT and
    # after RL on the held-out tasks, and after SFT and after RL on the reworded ones (the same skills
    # in other words); beside the held-out ones after SFT and after RL a greedy one: one run per task
    # at temperature 0.
    assert list(report["evaluations"]) == ["before", "sft", "sft-reworded", "rl", "rl-reworded"]
    for name, ev in report["evaluations"].items():
        suite = "tools-tiny-reworded" if name.endswith("-reworded") else "tools-tiny"
        families = [t.metadata["family"] for t in load_tasks(suite, split="heldout")[:2]]
        assert ev["rollouts"] == 4, name
        assert 0.0 <= ev["pass@1"]["low"] <= ev["pass@1"]["estimate"] <= ev["pass@1"]["high"] <= 1.0
        sampled = json.loads((out / "eval" / name / "report.json").read_text())
        assert sampled["seed"] == cfg.seed, name  # every stage on the same random numbers
        assert sampled["tasks"] == suite, name
        runs = sampled["summary"]["per_task"]
        assert {r["task_id"] for r in runs} == {f"{suite}-heldout-0000", f"{suite}-heldout-0001"}
        # Per task family: the two tasks' families, one task each.
        assert {f: v["tasks"] for f, v in ev["by_family"].items()} == {f: 1 for f in families}, name
        # What the rollouts did, read from their conversations.
        assert ev["behaviour"] == sampled["acting"]["all"] and ev["behaviour"]["rollouts"] == 4, name
        assert 0 <= ev["behaviour"]["rollouts_with_errors"] <= 4, name
        if name != "sft" and name != "rl":  # greedy only for the headline's models
            assert ev["greedy pass@1"] is None and not (out / "eval" / f"{name}-greedy").exists()
            continue
        greedy = json.loads((out / "eval" / f"{name}-greedy" / "report.json").read_text())
        assert greedy["rollouts"] == 2 and greedy["temperature"] == 0.0, name
        assert ev["greedy pass@1"]["estimate"] == greedy["summary"]["pass@k"]["1"]["estimate"]

    # RL's gain over SFT, paired by task: the mean change, inside its interval; on the reworded tasks
    # too; SFT's over the untrained model.
    ev = report["evaluations"]
    for key, before, after, metrics in (
        ("rl_minus_sft", "sft", "rl", ("pass@1", "greedy pass@1")),
        ("rl_minus_sft_reworded", "sft-reworded", "rl-reworded", ("pass@1",)),
        ("sft_minus_before", "before", "sft", ("pass@1",)),
    ):
        assert list(report[key]) == list(metrics)
        for metric in metrics:
            gain = report[key][metric]
            change = ev[after][metric]["estimate"] - ev[before][metric]["estimate"]
            assert gain["estimate"] == pytest.approx(change)
            assert -1.0 <= gain["low"] <= gain["estimate"] <= gain["high"] <= 1.0
    assert "rl_minus_sft_faults" not in report and "recovery_rate" not in report
    assert report["teacher"].startswith("clean")
    # The SFT policy measured before RL on train tasks: what RL had to work with.
    headroom = report["headroom"]
    assert headroom["tasks"] == 2 and headroom["k"] == 2 and headroom["rollouts"] == 4
    assert 0.0 <= headroom["pass_at_1"] <= headroom["pass_at_k"] <= 1.0 and headroom["verdict"]
    assert headroom == json.loads((out / "rl" / "headroom.json").read_text())

    # Two GRPO steps, logged; the evaluation after RL used the last checkpoint.
    assert [r["step"] for r in report["rl_steps"]] == [1, 2]
    for r in report["rl_steps"]:  # the table's "groups dropped" column reads the trainer's own count
        assert 0 <= r["groups_dropped_zero_variance"] <= 1
        assert r["groups_zero_variance_fraction"] == r["groups_dropped_zero_variance"]  # one group a step
        assert r["sampled_nll"] > 0
    rl_summary = json.loads((out / "rl" / "rl_summary.json").read_text())
    assert Path(rl_summary["checkpoint"]).name == "step-000002"

    md = (out / "report.md").read_text()
    for row in (
        "| before SFT |",
        "| after SFT |",
        "| after SFT, reworded tasks |",
        "| after RL (GRPO) |",
        "| after RL (GRPO), reworded tasks |",
        "| greedy pass@1 (1 run per task) | met an error | recovered |",
        "RL over SFT, pass@1 on the held-out tasks: ",
        "RL over SFT, greedy pass@1 on the held-out tasks: ",
        "RL over SFT, pass@1 on the reworded held-out tasks: ",
        "The SFT policy before RL (train tasks, rl/headroom.json): ",
        "![reward curve](reward_curve.png)",
        "held-out teacher trajectories (never trained on) ",
        "| GRPO step | mean reward | pass rate | groups dropped (equal rewards) | entropy |",
    ):
        assert row in md
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The run's own record of its state (the viewer reads it): every phase finished, in order; the
    # evaluations and RL wrote theirs too.
    status = json.loads((out / "status.json").read_text())
    assert status["kind"] == "demo" and status["state"] == "finished"
    assert list(status["phases"]) == [
        "model",
        "teacher",
        "eval-before",
        "sft",
        *(f"eval-sft{s}" for s in ("", "-greedy", "-reworded")),
        "rl",
        *(f"eval-rl{s}" for s in ("", "-greedy", "-reworded")),
        "report",
    ]
    assert {p["state"] for p in status["phases"].values()} == {"finished"}
    assert status["phases"]["eval-rl-reworded"]["folder"] == "eval/rl-reworded"
    for folder in ("rl", "eval/rl-reworded"):
        assert json.loads((out / folder / "status.json").read_text())["state"] == "finished", folder
    assert demo.viewer_line(out).endswith(
        f"openforge view --runs {out} --model {out / 'model'}  (then http://127.0.0.1:8600/#/run/demo)"
    )

    # A rerun finds every phase done: no rollout, no training, the same numbers.
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.suffix in {".json", ".jsonl", ".db"}}
    again = demo.run(cfg)
    assert again["evaluations"] == report["evaluations"]
    assert again["seconds"] == report["seconds"]
    changed = [
        p
        for p, t in stamps.items()
        if p.stat().st_mtime_ns != t and p.name not in {"report.json", "timings.json"}
    ]
    assert changed == [out / "status.json"]  # the rerun's own record; no phase's
    again_status = json.loads((out / "status.json").read_text())
    assert again_status["phases"] == status["phases"] | {"report": again_status["phases"]["report"]}


def test_the_faulted_condition_trains_on_faulted_tasks_and_reports_recovery(tmp_path: Path) -> None:
    """`faults`: RL on tools-tiny-faults, every model also on the faulted held-out tasks, the teacher's
    few faulted demonstrations said, and the recovery rate of each model."""
    cfg = dataclasses.replace(
        demo.DemoConfig(out=tmp_path / "demo"),
        **(TOY | dict(faults=True, greedy_eval=False, reworded_eval=False, headroom_tasks=0)),  # type: ignore[arg-type]
    )
    report = demo.run(cfg)
    assert list(report["evaluations"]) == ["before", "before-faults", "sft", "sft-faults", "rl", "rl-faults"]
    assert json.loads((tmp_path / "demo" / "rl" / "run.json").read_text())["tasks"] == "tools-tiny-faults"
    gain = report["rl_minus_sft_faults"]["pass@1"]
    ev = report["evaluations"]
    change = ev["rl-faults"]["pass@1"]["estimate"] - ev["sft-faults"]["pass@1"]["estimate"]
    assert gain["estimate"] == pytest.approx(change)
    assert set(report["recovery_rate"]) == {"before", "sft", "rl"}
    assert report["recovery_rate"]["rl"] == ev["rl-faults"]["behaviour"]["recovery_rate"]
    met = sum(bool(t.faults) for t in load_tasks("tools-tiny-faults", split="train")[:4])
    assert met == 2 and report["teacher"].startswith("2 of its 4 demonstrations met a transient fault")
    assert report["headroom"] is None  # not measured
    assert (
        "RL over SFT, pass@1 on the faulted held-out tasks: " in (tmp_path / "demo" / "report.md").read_text()
    )


@pytest.mark.real_model
def test_a_pretrained_student_runs_the_whole_demo(tmp_path: Path, smollm2_dir: Path) -> None:
    """`pretrained`: SmolLM2-135M-Instruct is the run's model, untouched, and goes through every
    phase (teacher in its template, SFT, GRPO, the evaluations) with the model generating."""
    from transformers import AutoTokenizer

    sizes = {**TOY, "reworded_eval": False, "sft_lr": 5e-5, "rl_lr": 2e-6}
    cfg = demo.DemoConfig(out=tmp_path / "demo", pretrained="smollm2-135m-instruct", **sizes)  # type: ignore[arg-type]
    report = demo.run(cfg)
    model = tmp_path / "demo" / "model"
    for f in smollm2_dir.iterdir():  # a copy of the checkpoint, not a model made locally
        if f.is_file():
            assert (model / f.name).read_bytes() == f.read_bytes(), f.name
    template = AutoTokenizer.from_pretrained(model).chat_template
    assert "<|im_start|>" in template
    teacher = [json.loads(line) for line in (tmp_path / "demo" / "teacher" / "samples.jsonl").open()]
    assert len(teacher) == 4
    assert list(report["evaluations"]) == ["before", "sft", "rl"]
    assert all(ev["rollouts"] == 4 for ev in report["evaluations"].values())
    assert report["sft"]["loss_after"] < report["sft"]["loss_before"]
    assert len(report["rl_steps"]) == 2
    assert "The pretrained smollm2-135m-instruct" in (tmp_path / "demo" / "report.md").read_text()


def test_family_table_counts_each_task_set_apart() -> None:
    """report.md's pass@1 per family: the header counts the held-out split's tasks, and a row of the
    reworded set (other counts) says its own. The report is seed 1's SmolLM2 run of the recipe."""
    from openforgerl.demo.markdown import render_markdown

    report = json.loads((Path(__file__).parents[1] / "fixtures" / "demo_report_smollm2.json").read_text())
    held_out = report["evaluations"]["rl"]["by_family"]
    reworded = report["evaluations"]["rl-reworded"]["by_family"]
    assert held_out["add"]["tasks"] != reworded["add"]["tasks"]  # what the table must keep apart
    lines = render_markdown(report).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| model | add ("))
    assert f"add ({held_out['add']['tasks']})" in lines[at]
    rows = {line.split(" | ")[0]: line for line in lines[at + 2 : at + 2 + len(report["evaluations"])]}
    assert f"| {held_out['add']['pass@1']:.2f} |" in rows["| after RL (GRPO)"]
    assert (
        f"| {reworded['add']['pass@1']:.2f} ({reworded['add']['tasks']}) |"
        in rows["| after RL (GRPO), reworded tasks"]
    )
