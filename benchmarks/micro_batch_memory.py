"""Peak memory and time of one trainer update on SmolLM2-135M-Instruct by micro-batch token budget.

    python benchmarks/micro_batch_memory.py --rows 6 --length 1400 --budget 8192 [--checkpointing]

Each row holds LENGTH tokens, the loss on all but the first 450 (a harness prompt); one forward and
backward per micro-batch (`Policy.micro_batches`, budget 0: the model's default), then one AdamW
step. Prints JSON: the micro-batches, the process's peak RSS (sampled every 50 ms) and the seconds.
Run each setting in its own process: freed memory is not always handed back to the OS.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import psutil

from openforgerl.modelkit.pretrained import cached_pretrained
from openforgerl.rl.config import Tuning
from openforgerl.rl.policy import Policy
from openforgerl.rollouts.trajectory import Sample

PROMPT = 450


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--length", type=int, default=1400)
    ap.add_argument("--budget", type=int, default=0, help="padded tokens per pass (0: the model's default)")
    ap.add_argument("--checkpointing", action="store_true")
    args = ap.parse_args()
    proc, peak = psutil.Process(), [0]

    def watch() -> None:
        while True:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    policy = Policy(
        cached_pretrained("smollm2-135m-instruct"),
        lr=1e-6,
        tuning=Tuning(gradient_checkpointing=args.checkpointing),
    )
    base = proc.memory_info().rss
    prompt = min(PROMPT, args.length - 1)
    samples = [
        Sample(
            rollout_id=str(i),
            reward=1.0,
            branch_id=0,
            branch_reason="",
            input_ids=[(7 * i + j) % 40000 + 10 for j in range(args.length)],  # no shared prefix
            loss_mask=[0] * prompt + [1] * (args.length - prompt),
            logprobs=[0.0] * args.length,
            policy_versions=[0] * args.length,
        )
        for i in range(args.rows)
    ]
    chunks = policy.micro_batches(samples, args.budget)
    t0, peak[0] = time.perf_counter(), 0
    for chunk in chunks:
        batch = policy.collate([samples[i] for i in chunk])
        lp, _ = policy.logprobs_and_entropy(batch)
        (-(lp * batch.mask).sum() / batch.mask.sum()).backward()
    policy.clip_and_step(1.0)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                **vars(args),
                "micro_batches": len(chunks),
                "base_gb": round(base / 1e9, 2),
                "peak_gb": round(peak[0] / 1e9, 2),
                "seconds": round(seconds, 1),
                "tokens_per_s": round(args.rows * args.length / seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
