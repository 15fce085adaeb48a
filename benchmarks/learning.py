"""Learning: the demo pipeline (`openforgerl.demo`) over several seeds, side by side.

For each seed, a fresh model, oracle SFT, GRPO, and held-out evaluations before SFT, after SFT and
after RL. Reports per seed and mean ± 95% CI over seeds (Student t): held-out pass@1 at each stage
(sampled at the demo's temperature, and greedy: one run per task), RL's gain over SFT in both, wall
time per phase, trainer tokens per second. The issue's goal is RL beating SFT by at least 15 points
of held-out pass@1.

    .venv/bin/python benchmarks/learning.py [--seeds 0 1 2] [--quick] [--overlap]
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


def one_seed(seed: int, root: Path, quick: bool, overlap: bool) -> dict[str, Any]:
    cfg = demo.DemoConfig(out=root / f"seed-{seed}", seed=seed, progress=False, overlap=overlap)
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
        "rl_minus_sft_paired": report.get("rl_minus_sft"),
        "seconds": report["seconds"],
        "total_seconds": report["total_seconds"],
        "trainer_tokens_per_s": report["trainer_tokens_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="toy sizes (the pipeline, not learning)")
    ap.add_argument("--overlap", action="store_true", help="RL with rollout/training overlap")
    ap.add_argument("--runs", type=Path, default=Path("benchmarks/results/learning-runs"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/learning.json"))
    args = ap.parse_args()
    seeds = [one_seed(s, args.runs, args.quick, args.overlap) for s in args.seeds]
    stages = ("before", "sft", "rl")
    summary: dict[str, Any] = {}
    for metric, gain in (("pass@1", "gain/rl_minus_sft"), ("greedy_pass@1", "gain_greedy/rl_minus_sft")):
        for stage in stages:  # greedy has no "before" (the demo skips it for the untrained model)
            values = [s[metric][stage] for s in seeds if s[metric][stage] is not None]
            summary[f"{metric}/{stage}"] = mean_ci(values) if values else None
        summary[gain] = mean_ci([(s[metric]["rl"] or 0.0) - (s[metric]["sft"] or 0.0) for s in seeds])
    phases = sorted({p for s in seeds for p in s["seconds"]})
    summary["seconds"] = {p: statistics.median([s["seconds"].get(p, 0.0) for s in seeds]) for p in phases}
    summary["total_seconds_median"] = statistics.median([s["total_seconds"] for s in seeds])
    for kind in ("sft_median", "rl_median"):
        values = [s["trainer_tokens_per_s"][kind] for s in seeds if s["trainer_tokens_per_s"][kind]]
        summary[f"trainer_tokens_per_s/{kind.split('_')[0]}"] = statistics.median(values) if values else None
    result = {"config": {"quick": args.quick, "overlap": args.overlap}, "seeds": seeds, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    json.dump(result, sys.stdout, indent=2)
    print()
    print("| stage | held-out pass@1 (mean ± 95% CI over seeds) | greedy (one run per task) |")
    print("|---|---:|---:|")
    for stage in stages:
        cells = [summary[f"{m}/{stage}"] for m in ("pass@1", "greedy_pass@1")]
        shown = [f"{v['mean']:.3f} ± {v['ci95']:.3f}" if v else "—" for v in cells]
        print(f"| {stage} | {shown[0]} | {shown[1]} |")
    g, h = summary["gain/rl_minus_sft"], summary["gain_greedy/rl_minus_sft"]
    print(
        f"| RL − SFT | {g['mean'] * 100:+.1f} ± {g['ci95'] * 100:.1f} points"
        f" | {h['mean'] * 100:+.1f} ± {h['ci95'] * 100:.1f} points |"
    )
    print()
    print("| seed | RL − SFT, paired by task (95% interval), points | greedy |")
    print("|---:|---|---|")
    for s in seeds:
        paired = s["rl_minus_sft_paired"] or {}
        shown = [
            f"{g['estimate'] * 100:+.1f} ({g['low'] * 100:+.1f} to {g['high'] * 100:+.1f})" if g else "—"
            for g in (paired.get("pass@1"), paired.get("greedy pass@1"))
        ]
        print(f"| {s['seed']} | {shown[0]} | {shown[1]} |")


if __name__ == "__main__":
    main()
