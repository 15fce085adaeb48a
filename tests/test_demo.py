"""`make demo`'s pipeline end to end at toy sizes: teacher, SFT, GRPO, three held-out evaluations,
the report and the curve; and a rerun that continues instead of starting over."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from openforgerl import demo
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
    concurrency=4,
    progress=False,
)


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

    # Held-out evaluations only, each with n runs per task and an interval: on the faulted tasks
    # before SFT, after SFT and after RL, and on the clean ones after SFT and after RL; beside those
    # after SFT and after RL a greedy one: one run per task at temperature 0.
    assert list(report["evaluations"]) == ["before-faults", "sft-faults", "sft", "rl-faults", "rl"]
    families = [t.metadata["family"] for t in load_tasks("tools-tiny", split="heldout")[:2]]
    faulted = [bool(t.faults) for t in load_tasks("tools-tiny-faults", split="heldout")[:2]]
    assert faulted == [True, True]  # both toy tasks carry their fault
    for name, ev in report["evaluations"].items():
        assert ev["rollouts"] == 4, name
        assert 0.0 <= ev["pass@1"]["low"] <= ev["pass@1"]["estimate"] <= ev["pass@1"]["high"] <= 1.0
        sampled = json.loads((out / "eval" / name / "report.json").read_text())
        assert sampled["seed"] == cfg.seed, name  # every stage on the same random numbers
        runs = sampled["summary"]["per_task"]
        assert {r["task_id"] for r in runs} == {"tools-tiny-heldout-0000", "tools-tiny-heldout-0001"}
        # Per task family: the two tasks' families, one task each (`faulted`, a tag both toy tasks
        # have on the faulted suite, is left out like the suite's own tag).
        assert {f: v["tasks"] for f, v in ev["by_family"].items()} == {f: 1 for f in families}, name
        # What the rollouts did, read from their conversations (a toy model may never reach a read,
        # so how many met their fault is not fixed here: tests/test_faults.py checks that).
        assert ev["behaviour"] == sampled["acting"]["all"] and ev["behaviour"]["rollouts"] == 4, name
        assert 0 <= ev["behaviour"]["rollouts_with_errors"] <= 4, name
        if name == "before-faults":  # the untrained model: no greedy evaluation
            assert ev["greedy pass@1"] is None and not (out / "eval" / "before-faults-greedy").exists()
            continue
        greedy = json.loads((out / "eval" / f"{name}-greedy" / "report.json").read_text())
        assert greedy["rollouts"] == 2 and greedy["temperature"] == 0.0, name
        assert ev["greedy pass@1"]["estimate"] == greedy["summary"]["pass@k"]["1"]["estimate"]

    # RL's gain over SFT, paired by task, with and without the faults: the mean change, inside its
    # interval; and the recovery rate of each model on the faulted tasks.
    ev = report["evaluations"]
    for condition, suffix in (("faults", "-faults"), ("clean", "")):
        for metric in ("pass@1", "greedy pass@1"):
            gain = report[f"rl_minus_sft_{condition}"][metric]
            change = ev[f"rl{suffix}"][metric]["estimate"] - ev[f"sft{suffix}"][metric]["estimate"]
            assert gain["estimate"] == pytest.approx(change)
            assert -1.0 <= gain["low"] <= gain["estimate"] <= gain["high"] <= 1.0
    assert set(report["recovery_rate"]) == {"before", "sft", "rl"}
    assert report["recovery_rate"]["rl"] == ev["rl-faults"]["behaviour"]["recovery_rate"]
    # The teacher, said in the report: the fallback, a few demonstrations met a fault and retried.
    met = sum(bool(t.faults) for t in load_tasks("tools-tiny-faults", split="train")[:4])
    assert met == 2 and report["teacher"].startswith("2 of its 4 demonstrations met a transient fault")

    # Two GRPO steps, logged; the evaluation after RL used the last checkpoint.
    assert [r["step"] for r in report["rl_steps"]] == [1, 2]
    for r in report["rl_steps"]:  # the table's "groups dropped" column reads the trainer's own count
        assert 0 <= r["groups_dropped_zero_variance"] <= 1
    rl_summary = json.loads((out / "rl" / "rl_summary.json").read_text())
    assert Path(rl_summary["checkpoint"]).name == "step-000002"

    md = (out / "report.md").read_text()
    for row in (
        "| before SFT, faulted tasks |",
        "| after SFT, faulted tasks |",
        "| after SFT, clean tasks |",
        "| after RL (GRPO), faulted tasks |",
        "| after RL (GRPO), clean tasks |",
        "| greedy pass@1 (1 run per task) | met an error | recovered |",
        "RL over SFT on held-out pass@1, faults: ",
        "RL over SFT on held-out greedy pass@1, clean: ",
        "The teacher's weakness, on purpose: 2 of its 4 demonstrations",
        "![reward curve](reward_curve.png)",
        "held-out teacher trajectories (never trained on) ",
        "| model | " + " | ".join(f"{f} (1)" for f in sorted(families)) + " |",
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
        "eval-before-faults",
        "sft",
        *(f"eval-sft{s}" for s in ("-faults", "-faults-greedy", "", "-greedy")),
        "rl",
        *(f"eval-rl{s}" for s in ("-faults", "-faults-greedy", "", "-greedy")),
        "report",
    ]
    assert {p["state"] for p in status["phases"].values()} == {"finished"}
    assert status["phases"]["eval-rl-faults"]["folder"] == "eval/rl-faults"
    for folder in ("rl", "eval/rl-faults"):
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
