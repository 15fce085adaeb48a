"""An RL step's rollouts at several runner concurrencies, side by side in one run.

The workload is the demo's RL step: 6 tools-tiny train tasks x 8 rollouts at temperature 0.7 by a
trained student (the demo's SFT model), through the ReAct harness in local sandboxes and an
embedded recording gateway on the built-in engine, 128 tokens per call, 6 turns. The built-in engine
batches the calls that wait at the same time: with more rollouts in flight, each forward pass
decodes more rows. Each round runs every concurrency once, the order alternating from round to
round. Per concurrency: rollouts per minute, the engine's forward passes and decoded rows per pass;
medians over rounds, and per round the ratio of rollouts per minute to the first concurrency's
(this machine is noisy: read the ratios).

    .venv/bin/python benchmarks/step_concurrency.py --model runs/demo/sft [--concurrency 8 16 24]
                                                   [--rounds 3] [--out FILE]

Give a trained student: an untrained model's rollouts end after a turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import prefix_cache  # the same workload, run by the benchmark beside this one
from openforgerl.engines.base import PREFIX_CACHE_MB
from openforgerl.tasks import load_tasks


def one_run(model: str, tasks: list[Any], group: int, concurrency: int, out: Path) -> dict[str, Any]:
    r = prefix_cache.one_run(model, tasks, group, PREFIX_CACHE_MB, out, concurrency=concurrency)
    passes = r["forward_passes"]
    keep = ("rollouts", "passed", "wall_s", "rollouts_per_min", "forward_passes")
    return {k: r[k] for k in keep} | {
        "rows_per_pass": round(r["decoded_tokens"] / passes, 2) if passes else 0.0
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a trained student, e.g. runs/demo/sft")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 24])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=6, help="train tasks per run (an RL step's batch)")
    ap.add_argument("--group", type=int, default=8, help="rollouts per task (G)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    tasks = load_tasks("tools-tiny", split="train")[: args.tasks]
    levels = list(args.concurrency)
    rounds: list[dict[int, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            row = {}
            for c in levels if i % 2 == 0 else levels[::-1]:
                row[c] = one_run(args.model, tasks, args.group, c, Path(tmp) / f"{i}-{c}")
                print(json.dumps({"round": i, "concurrency": c, **row[c]}), file=sys.stderr, flush=True)
            rounds.append(row)
    base = levels[0]
    median = {
        c: {
            key: statistics.median(r[c][key] for r in rounds)
            for key in ("rollouts_per_min", "forward_passes", "rows_per_pass", "wall_s")
        }
        for c in levels
    }
    ratios = {
        c: [round(r[c]["rollouts_per_min"] / r[base]["rollouts_per_min"], 3) for r in rounds] for c in levels
    }
    report = {
        "model": args.model,
        "tasks": args.tasks,
        "group": args.group,
        "rounds": [{str(c): v for c, v in r.items()} for r in rounds],
        "median": {str(c): v for c, v in median.items()},
        f"ratio_to_{base}_per_round": {str(c): v for c, v in ratios.items()},
        f"ratio_to_{base}_median": {str(c): statistics.median(v) for c, v in ratios.items()},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n| concurrency | rollouts/min | forward passes | rows per pass | ratio to {base} (per round) |")
    print("|---:|---:|---:|---:|---|")
    for c, m in median.items():
        print(
            f"| {c} | {m['rollouts_per_min']} | {m['forward_passes']:.0f} | {m['rows_per_pass']} "
            f"| {', '.join(f'{x:.2f}' for x in ratios[c])} |"
        )


if __name__ == "__main__":
    main()
