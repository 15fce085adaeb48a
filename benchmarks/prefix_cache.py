"""The built-in engine's prefix cache on the demo's rollouts, on and off side by side in one run.

The workload is an RL step's: tools-tiny train tasks, G rollouts each at temperature 0.7, through
the ReAct harness in local sandboxes and an embedded recording gateway, concurrency 8, the demo's
limits (128 tokens per call, 6 turns). Each round runs the same tasks once per setting, the order
alternating from round to round. Per setting: rollouts per minute, the prompt tokens the model ran
(prefill) and those the cache supplied; medians over rounds, and the on/off ratio of rollouts per
minute per round (this machine is noisy: read the ratios).

    .venv/bin/python benchmarks/prefix_cache.py --model runs/demo/sft [--rounds 3] [--out FILE]

Give a trained student (the demo's SFT model): an untrained model's rollouts end after a turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.evaluate import EvalOptions, run_rollouts
from openforgerl.rollouts.results import Status
from openforgerl.tasks import load_tasks

SETTINGS = {"on": 512.0, "off": 0.0}  # prefix_cache_mb


def one_run(
    model: str, tasks: list[Any], group: int, cache_mb: float, out: Path, concurrency: int = 8
) -> dict[str, Any]:
    """One RL step's rollouts (`group` of each task) on a fresh engine; throughput and engine counts."""
    engine = TransformersEngine(model, prefix_cache_mb=cache_mb)
    opts = EvalOptions(
        tasks="tools-tiny",
        model=model,
        out=out,
        n=group,
        temperature=0.7,
        max_tokens=128,
        max_turns=6,
        concurrency=concurrency,
        progress=False,
    )
    t0 = time.perf_counter()
    results = run_rollouts(opts, engine, tasks)
    wall = time.perf_counter() - t0
    return {
        "rollouts": len(results),
        "passed": sum(1 for r in results if r.status == Status.DONE and r.reward == 1.0),
        "wall_s": round(wall, 2),
        "rollouts_per_min": round(60 * len(results) / wall, 1),
        "prefill_tokens": engine.stats["prefill_tokens"],
        "cached_tokens": engine.prefix_cache.stats["hit_tokens"],
        "decoded_tokens": engine.stats["tokens"],
        "forward_passes": engine.stats["steps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a trained student, e.g. runs/demo/sft")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=6, help="train tasks per run (an RL step's batch)")
    ap.add_argument("--group", type=int, default=8, help="rollouts per task (G)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    tasks = load_tasks("tools-tiny", split="train")[: args.tasks]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = list(SETTINGS) if i % 2 == 0 else list(SETTINGS)[::-1]
            row = {}
            for name in order:
                row[name] = one_run(args.model, tasks, args.group, SETTINGS[name], Path(tmp) / f"{i}-{name}")
                print(json.dumps({"round": i, "cache": name, **row[name]}), file=sys.stderr, flush=True)
            rounds.append(row)
    summary = {
        name: {
            key: statistics.median(r[name][key] for r in rounds)
            for key in ("rollouts_per_min", "prefill_tokens", "cached_tokens", "decoded_tokens", "wall_s")
        }
        for name in SETTINGS
    }
    ratios = [r["on"]["rollouts_per_min"] / r["off"]["rollouts_per_min"] for r in rounds]
    report = {
        "model": args.model,
        "tasks": args.tasks,
        "group": args.group,
        "rounds": rounds,
        "median": summary,
        "speedup_per_round": [round(x, 3) for x in ratios],
        "speedup_median": round(statistics.median(ratios), 3),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print("\n| prefix cache | rollouts/min | prompt tokens run | prompt tokens from the cache | wall s |")
    print("|---|---:|---:|---:|---:|")
    for name, m in summary.items():
        print(
            f"| {name} | {m['rollouts_per_min']} | {m['prefill_tokens']:.0f} | {m['cached_tokens']:.0f} "
            f"| {m['wall_s']} |"
        )
    print(
        f"\nspeed-up (on/off rollouts per minute), median of {args.rounds} rounds: {report['speedup_median']}"
    )


if __name__ == "__main__":
    main()
