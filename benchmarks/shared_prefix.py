"""Shared-prefix training: one trainer micro-batch run whole per row and with the shared prefix once.

Harness calls open with the same system prompt and tool list (the ReAct harness: ~376 tokens of a
~530-token tools-tiny trajectory; Claude Code or Codex: thousands), and the G rollouts of a GRPO
group share their task too. The trainer runs such a prefix once and continues every row from its KV
cache (`Policy.logprobs`, `_Collated.shared`); the logprobs and gradients are the same (tests/
test_rl.py). This times a forward + backward pass of one micro-batch of tools-tiny oracle
trajectories (recorded by the gateway as the demo's teacher phase does) both ways, alternating,
on the kit's model.

    .venv/bin/python benchmarks/shared_prefix.py [--size tiny] [--batch 8 16 32] [--repeats 5]
                                                 [--out benchmarks/results/shared_prefix.json]

Prints JSON (machine-readable) and a Markdown table: per batch size, the median seconds of a pass
each way, loss tokens per second, and the speed-up (whole / shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from openforgerl.modelkit import cached_model
from openforgerl.rl.sft import oracle_samples
from openforgerl.rl.trainer import Policy


def one_pass(policy: Policy, batch: Any) -> float:
    t0 = time.perf_counter()
    policy.model.zero_grad(set_to_none=True)
    lp = policy.logprobs(batch)
    (-(lp * batch.mask).sum()).backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/shared_prefix.json"))
    args = ap.parse_args()

    model = cached_model(args.size)
    policy = Policy(model, lr=1e-3)
    with tempfile.TemporaryDirectory() as scratch:  # the teacher's rollouts, as the demo records them
        samples = oracle_samples(model, Path(scratch), limit=max(args.batch), progress=False)
    if len(samples) < max(args.batch):
        sys.exit(f"the oracle teacher solved {len(samples)} of {max(args.batch)} tasks: see its rollouts")
    rows = []
    for size in args.batch:
        batch = policy.collate(samples[:size])
        modes = {"whole": dataclasses.replace(batch, shared=0), "shared": batch}
        one_pass(policy, batch)  # warm-up
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.repeats):
            for mode in list(modes)[:: 1 if r % 2 == 0 else -1]:  # alternate the order: a noisy machine
                times[mode].append(one_pass(policy, modes[mode]))
        loss_tokens = int(batch.mask.sum())
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append(
            {
                "batch": size,
                "tokens": batch.real_tokens,
                "shared_prefix": batch.shared,
                "loss_tokens": loss_tokens,
                "median_s": {m: round(v, 4) for m, v in med.items()},
                "loss_tokens_per_s": {m: round(loss_tokens / v, 1) for m, v in med.items()},
                "speedup": round(med["whole"] / med["shared"], 2),
                "times_s": {m: [round(x, 4) for x in v] for m, v in times.items()},
            }
        )
    result = {
        "model": args.size,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print("\n| batch | tokens | shared prefix | whole s | shared s | speed-up |\n|---|---|---|---|---|---|")
    for r in rows:
        m = r["median_s"]
        cells = [r["batch"], r["tokens"], r["shared_prefix"], m["whole"], m["shared"], f"{r['speedup']}x"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
