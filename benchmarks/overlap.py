"""Overlap of rollouts and training: the same short RL run, synchronous and with --overlap, side by side.

Each round trains the kit's tiny model on `tools-tiny` for a few steps twice, from the same start
with the same options, once synchronously (rollouts of step t+1 start after step t's weights are in
the engine) and once with overlap (they run while step t trains, max_lag 1); the order alternates
from round to round so that a machine getting busier does not favour one mode. From each run's
metrics.jsonl it reads per step time/step (the loop's wall time for the step), time/wait (the
trainer waiting for rollouts), time/rollout and time/train, and the run's wall time over its steps.

    .venv/bin/python benchmarks/overlap.py [--quick] [--steps 4] [--rounds 2]
                                           [--out benchmarks/results/overlap.json]

Prints JSON (machine-readable) and a Markdown table. Medians over rounds; the speed-up is the
synchronous wall time per step over the overlapped one. `ideal_speedup` is what a perfect overlap
would give on the synchronous run's own step times, (rollout + train) / max(rollout, train), with
train counting save and push: the more training weighs against rollouts, the more overlap wins.
Step 1 has nothing to overlap with; `steady` figures leave it out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from openforgerl.modelkit import cached_model
from openforgerl.rl.loop import TrainOptions, train
from openforgerl.rl.trainer import TrainerConfig


def one_run(model: Path, out: Path, overlap: bool, args: argparse.Namespace) -> dict[str, Any]:
    opts = TrainOptions(
        model=str(model),
        out=out,
        tasks="tools-tiny",
        steps=args.steps,
        group=args.group,
        batch_tasks=args.batch_tasks,
        max_tokens=args.max_tokens,
        max_turns=args.max_turns,
        concurrency=args.concurrency,
        progress=False,
        overlap=overlap,
        max_lag=1,
        # A random model earns no reward: train on all-zero groups too, so every step really updates
        # (with mini-batches, so the update costs what a real step's would).
        trainer=TrainerConfig(lr=1e-4, drop_zero_variance=False, mini_batches=args.mini_batches),
    )
    summary = train(opts)
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = [
        {
            "step": m["step"],
            "step_s": round(m["time/step"], 3),
            "wait_s": round(m["time/wait"], 3),
            "rollout_s": round(m["time/rollout"], 3),
            "train_s": round(m["time/train"], 3),
            "save_push_s": round(m.get("time/save", 0.0) + m.get("time/push", 0.0), 3),
            "lag_mean": round(m["lag/mean"], 3),
            "lag_max": m["lag/max"],
        }
        for m in steps
    ]
    wall = steps[-1]["time/wall"]
    later = per_step[1:] or per_step
    return {
        "mode": "overlap" if overlap else "sync",
        "policy_version": summary["policy_version"],
        "wall_s": round(wall, 2),
        "wall_per_step_s": round(wall / len(steps), 3),
        "steady_step_s": round(statistics.median(s["step_s"] for s in later), 3),
        "wait_share": round(sum(s["wait_s"] for s in per_step) / wall, 3),
        "steps": per_step,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("sync", "overlap"):
        mine = [r for r in runs if r["mode"] == mode]
        steps = [s for r in mine for s in r["steps"][1:]] or [s for r in mine for s in r["steps"]]
        out[mode] = {
            "wall_per_step_s": round(statistics.median(r["wall_per_step_s"] for r in mine), 3),
            "steady_step_s": round(statistics.median(r["steady_step_s"] for r in mine), 3),
            "wait_share": round(statistics.median(r["wait_share"] for r in mine), 3),
            "rollout_s": round(statistics.median(s["rollout_s"] for s in steps), 3),
            "train_s": round(statistics.median(s["train_s"] for s in steps), 3),
            "save_push_s": round(statistics.median(s["save_push_s"] for s in steps), 3),
        }
    sync, ov = out["sync"], out["overlap"]
    out["speedup_wall_per_step"] = round(sync["wall_per_step_s"] / ov["wall_per_step_s"], 3)
    out["speedup_steady"] = round(sync["steady_step_s"] / ov["steady_step_s"], 3)
    # Overlapped, a step's rollouts run beside the previous step's train + save + push.
    trainer_side = sync["train_s"] + sync["save_push_s"]
    out["ideal_speedup"] = round((sync["rollout_s"] + trainer_side) / max(sync["rollout_s"], trainer_side), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 steps, 1 round: a smoke run of about a minute")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both modes")
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--batch-tasks", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"], help="the kit's model")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 3, 1
    os.environ.setdefault("TQDM_DISABLE", "1")
    model = cached_model(args.size, 0)
    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = (False, True) if rnd % 2 == 0 else (True, False)
            for overlap in order:
                run = one_run(model, Path(tmp) / f"r{rnd}-{'overlap' if overlap else 'sync'}", overlap, args)
                run["round"] = rnd
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "steps"}), file=sys.stderr, flush=True)
    summary = summarize(runs)
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.monotonic() - t0, 1),
        "summary": summary,
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    s = summary
    print("\n| mode | wall/step s | steady step s | trainer waiting | rollout s | train s |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("sync", "overlap"):
        m = s[mode]
        print(
            f"| {mode} | {m['wall_per_step_s']} | {m['steady_step_s']} | {100 * m['wait_share']:.0f}% "
            f"| {m['rollout_s']} | {m['train_s']} |"
        )
    print(
        f"\nspeed-up (sync / overlap): wall per step {s['speedup_wall_per_step']}x, "
        f"steady steps {s['speedup_steady']}x; ideal on these step times {s['ideal_speedup']}x"
    )


if __name__ == "__main__":
    main()
