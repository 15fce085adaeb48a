"""Learning: the demo pipeline (`openforgerl.demo`) over several seeds, side by side.

For each seed, a fresh model, oracle SFT, GRPO on train tasks of which about half carry a transient
fault, and held-out evaluations on the faulted tasks (before SFT, after SFT, after RL) and on the
clean ones (after SFT, after RL). Reports per seed and mean ± 95% CI over seeds (Student t): held-out
pass@1 per stage and condition (sampled at the demo's temperature, and greedy: one run per task),
RL − SFT paired by task within each seed with its 95% interval, the recovery rate after a fault, wall
time per phase, trainer tokens per second. Issue #21's goal: RL − SFT on faulted held-out tasks
>= +15 points with every seed's interval above 0, on clean ones >= -3 points, recovery <= 10% after
SFT and >= 70% after RL.

    .venv/bin/python benchmarks/learning.py [--seeds 0 1 2] [--quick] [--overlap]
                                            [--teacher-faulted N] [--rl-lr LR]
                                            [--out benchmarks/results/learning.json]

Each seed's run folder (default benchmarks/results/learning-runs/seed-N) is kept: a rerun
continues unfinished seeds instead of starting over. Prints JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from openforgerl import demo

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and the half-width of its 95% Student-t interval (0 with one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": m, "ci95": 0.0, "n": len(values)}
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return {"mean": m, "ci95": half, "n": len(values)}


def one_seed(
    seed: int, root: Path, quick: bool, overlap: bool, teacher_faulted: int | None, rl_lr: float | None
) -> dict[str, Any]:
    cfg = demo.DemoConfig(out=root / f"seed-{seed}", seed=seed, progress=False, overlap=overlap)
    if teacher_faulted is not None:
        cfg = dataclasses.replace(cfg, teacher_faulted=teacher_faulted)
    if rl_lr is not None:
        cfg = dataclasses.replace(cfg, rl_lr=rl_lr)
    if quick:
        cfg = dataclasses.replace(cfg, **demo.QUICK)  # type: ignore[arg-type]
    report = demo.run(cfg)
    ev = report["evaluations"]
    return {
        "seed": seed,
        "pass@1": {k: v["pass@1"]["estimate"] if v["pass@1"] else None for k, v in ev.items()},
        "greedy_pass@1": {
            k: v["greedy pass@1"]["estimate"] if v.get("greedy pass@1") else None for k, v in ev.items()
        },
        # RL - SFT paired by task within this seed, with its bootstrap interval over tasks.
        "rl_minus_sft_faults": report.get("rl_minus_sft_faults"),
        "rl_minus_sft_clean": report.get("rl_minus_sft_clean"),
        "recovery_rate": report.get("recovery_rate"),
        "teacher": report.get("teacher"),
        "seconds": report["seconds"],
        "total_seconds": report["total_seconds"],
        "trainer_tokens_per_s": report["trainer_tokens_per_s"],
    }


STAGES = ("before-faults", "sft-faults", "rl-faults", "sft", "rl")


def _ci(v: dict[str, float] | None, scale: float = 1.0, unit: str = "") -> str:
    return (
        f"{v['mean'] * scale:+.1f} ± {v['ci95'] * scale:.1f}{unit}"
        if v and unit
        else (f"{v['mean']:.3f} ± {v['ci95']:.3f}" if v else "—")
    )


def _paired(g: dict[str, float] | None) -> str:
    return f"{g['estimate'] * 100:+.1f} ({g['low'] * 100:+.1f} to {g['high'] * 100:+.1f})" if g else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="toy sizes (the pipeline, not learning)")
    ap.add_argument("--overlap", action="store_true", help="RL with rollout/training overlap")
    ap.add_argument("--teacher-faulted", type=int, default=None, help="the demo's teacher_faulted")
    ap.add_argument("--rl-lr", type=float, default=None, help="the demo's rl_lr")
    ap.add_argument("--runs", type=Path, default=Path("benchmarks/results/learning-runs"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/learning.json"))
    args = ap.parse_args()
    seeds = [
        one_seed(s, args.runs, args.quick, args.overlap, args.teacher_faulted, args.rl_lr) for s in args.seeds
    ]
    summary: dict[str, Any] = {}
    for metric in ("pass@1", "greedy_pass@1"):
        for stage in STAGES:  # greedy has no "before" (the demo skips it for the untrained model)
            values = [s[metric].get(stage) for s in seeds if s[metric].get(stage) is not None]
            summary[f"{metric}/{stage}"] = mean_ci(values) if values else None
    for condition in ("faults", "clean"):
        for metric in ("pass@1", "greedy pass@1"):
            gains = [s[f"rl_minus_sft_{condition}"][metric] for s in seeds if s[f"rl_minus_sft_{condition}"]]
            values = [g["estimate"] for g in gains if g]
            summary[f"rl_minus_sft_{condition}/{metric}"] = mean_ci(values) if values else None
    for stage in ("before", "sft", "rl"):
        values = [s["recovery_rate"][stage] for s in seeds if s["recovery_rate"].get(stage) is not None]
        summary[f"recovery_rate/{stage}"] = mean_ci(values) if values else None
    phases = sorted({p for s in seeds for p in s["seconds"]})
    summary["seconds"] = {p: statistics.median([s["seconds"].get(p, 0.0) for s in seeds]) for p in phases}
    summary["total_seconds_median"] = statistics.median([s["total_seconds"] for s in seeds])
    for kind in ("sft_median", "rl_median"):
        values = [s["trainer_tokens_per_s"][kind] for s in seeds if s["trainer_tokens_per_s"][kind]]
        summary[f"trainer_tokens_per_s/{kind.split('_')[0]}"] = statistics.median(values) if values else None
    config = {
        "quick": args.quick,
        "overlap": args.overlap,
        "teacher_faulted": args.teacher_faulted,
        "rl_lr": args.rl_lr,
    }
    result = {"config": config, "seeds": seeds, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    json.dump(result, sys.stdout, indent=2)
    print()
    print(
        "| stage | held-out pass@1 (mean ± 95% CI over seeds) | greedy (one run per task) "
        "| recovered after a fault |"
    )
    print("|---|---:|---:|---:|")
    for stage in STAGES:
        cells = [summary[f"{m}/{stage}"] for m in ("pass@1", "greedy_pass@1")]
        rec = (
            summary.get(f"recovery_rate/{stage.removesuffix('-faults')}")
            if stage.endswith("-faults")
            else None
        )
        print(f"| {stage} | {_ci(cells[0])} | {_ci(cells[1])} | {_ci(rec)} |")
    for condition in ("faults", "clean"):
        g, h = (summary[f"rl_minus_sft_{condition}/{m}"] for m in ("pass@1", "greedy pass@1"))
        print(f"| RL − SFT, {condition} | {_ci(g, 100, ' points')} | {_ci(h, 100, ' points')} | |")
    print()
    print(
        "| seed | RL − SFT faulted, paired (95% interval), points | greedy | RL − SFT clean | greedy "
        "| recovery SFT → RL |"
    )
    print("|---:|---|---|---|---|---|")
    for s in seeds:
        f, c, r = s["rl_minus_sft_faults"] or {}, s["rl_minus_sft_clean"] or {}, s["recovery_rate"]
        cells = [_paired(x.get(m)) for x in (f, c) for m in ("pass@1", "greedy pass@1")]
        rec = " → ".join("—" if r.get(k) is None else f"{r[k]:.0%}" for k in ("sft", "rl"))
        print(f"| {s['seed']} | {' | '.join(cells)} | {rec} |")


if __name__ == "__main__":
    main()
