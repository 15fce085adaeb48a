"""Learning inside real harnesses: the demo pipeline (`openforgerl.demo`) run inside agent CLIs.

For each harness and seed: a fresh tiny model, the ORACLE teacher solving train tasks through the
harness's own tools, SFT on those trajectories, GRPO with the student generating every turn inside
the CLI, and held-out evaluations (inside the same CLI) before SFT, after SFT and after RL. Reports
held-out pass@1 per stage, RL's gain over SFT paired by task, the harness version, tokens per
rollout and wall time per phase. Prints JSON (one object) and writes it to --out.

    .venv/bin/python benchmarks/harness_learning.py [--harnesses mini-swe-agent pi] [--seeds 0]
        [--preset bench|quick] [--out benchmarks/results/harness_learning.json]

Presets. The demo's own sizes (400 teacher tasks, 30 GRPO steps of 48 rollouts, 50 x 4 held-out
runs at each stage) cost about 2,300 rollouts; inside mini-swe-agent each rollout starts a Python
process that imports litellm (about 6 CPU-seconds on this machine), so `bench` is smaller: 150
teacher tasks, 10 GRPO steps of 4 tasks x 4 rollouts, the first 28 held-out tasks x 2 runs
(and one greedy run each after SFT and after RL): about 560 rollouts. `quick` proves the pipeline
only.

Each run folder (default benchmarks/results/harness-runs/HARNESS-seed-N) is kept: a rerun continues
where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from openforgerl import demo

PRESETS: dict[str, dict[str, Any]] = {
    "bench": {
        "teacher_tasks": 150,
        "sft_epochs": 24,  # 225 steps of 16
        "sft_warmup": 50,
        "rl_steps": 10,
        "rl_group": 4,
        "rl_batch_tasks": 4,
        "eval_tasks": 28,  # the first 28 held-out tasks: every family, 1 to 6 tasks each
        "eval_n": 2,
    },
    # The demo's own SFT (400 teacher tasks, 400 steps of 16), the bench's RL and evaluations: pi
    # only (inside mini-swe-agent the teacher alone would take about 50 minutes here).
    "sft400": {
        "teacher_tasks": 400,
        "sft_epochs": 16,
        "sft_warmup": 100,
        "rl_steps": 10,
        "rl_group": 4,
        "rl_batch_tasks": 4,
        "eval_tasks": 28,
        "eval_n": 2,
    },
    "quick": demo.QUICK,
}


def one_run(harness: str, seed: int, root: Path, preset: str) -> dict[str, Any]:
    name = f"{harness}-seed-{seed}" + ("" if preset == "bench" else f"-{preset}")
    cfg = demo.DemoConfig(out=root / name, seed=seed, harness=harness, progress=False)
    cfg = dataclasses.replace(cfg, **PRESETS[preset])
    report = demo.run(cfg)
    ev = report["evaluations"]
    before = json.loads((cfg.out / "eval" / "before-faults" / "report.json").read_text())
    return {
        "harness": harness,
        "harness_version": report["harness_version"],
        "seed": seed,
        "teacher_trajectories": report["sft"]["samples"],
        "pass@1": {k: v["pass@1"]["estimate"] if v["pass@1"] else None for k, v in ev.items()},
        "pass@1_ci95": {k: v["pass@1"] for k, v in ev.items()},
        "greedy_pass@1": {
            k: v["greedy pass@1"]["estimate"] if v.get("greedy pass@1") else None for k, v in ev.items()
        },
        "rl_minus_sft_faults": report.get("rl_minus_sft_faults"),
        "rl_minus_sft_clean": report.get("rl_minus_sft_clean"),
        "recovery_rate": report.get("recovery_rate"),
        "sft_loss": {k: report["sft"].get(k) for k in ("loss_before", "loss_after", "val_loss_after")},
        "rl_train_pass_rate": [r.get("pass_rate") for r in report["rl_steps"]],
        "tokens_per_rollout_before_sft": before.get("behaviour", {}).get("prompt_tokens_mean"),
        "seconds": report["seconds"],
        "total_seconds": report["total_seconds"],
        "trainer_tokens_per_s": report["trainer_tokens_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harnesses", nargs="+", default=["mini-swe-agent", "pi"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    ap.add_argument("--runs", type=Path, default=Path("benchmarks/results/harness-runs"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/harness_learning.json"))
    args = ap.parse_args()
    runs = [one_run(h, s, args.runs, args.preset) for h in args.harnesses for s in args.seeds]
    result = {"preset": args.preset, "config": PRESETS[args.preset], "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
