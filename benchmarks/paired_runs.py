"""Two demo run folders' evaluations, paired by task: e.g. two RL recipes from one SFT model.

    PYTHONPATH=src python benchmarks/paired_runs.py RUN_A RUN_B [--evals rl rl-greedy] [--out FILE]

For each evaluation name (eval/NAME/report.json in both folders), B − A held-out pass@1 paired by
task with its 95% bootstrap interval (`eval_stats.paired_difference`, as the demo's report). The
demo seeds every evaluation with its seed, so two models of the same seed met the same random
numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def paired(a: Path, b: Path, name: str) -> dict[str, Any]:
    from openforgerl.eval_stats import paired_difference

    reports = [json.loads((run / "eval" / name / "report.json").read_text()) for run in (a, b)]
    per_task = [{t["task_id"]: t["pass@k"]["1"] for t in r["summary"]["per_task"]} for r in reports]
    gain = paired_difference(per_task[0], per_task[1]).as_dict()
    return {
        "a": reports[0]["summary"]["pass@k"]["1"]["estimate"],
        "b": reports[1]["summary"]["pass@k"]["1"]["estimate"],
        "b_minus_a": gain,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--evals", nargs="+", default=["rl", "rl-greedy"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {"a": str(args.a), "b": str(args.b)}
    for name in args.evals:
        result[name] = row = paired(args.a, args.b, name)
        g = row["b_minus_a"]
        print(
            f"{name}: {row['a']:.3f} -> {row['b']:.3f}, B - A {g['estimate'] * 100:+.1f} "
            f"({g['low'] * 100:+.1f} to {g['high'] * 100:+.1f})"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
