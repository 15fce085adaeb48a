"""Shared-prefix training: one trainer micro-batch run whole per row and with the shared prefix once.

Harness calls open with the same system prompt and tool list (the ReAct harness: ~376 tokens of a
~530-token tools-tiny trajectory; Claude Code or Codex: thousands), and the G rollouts of a GRPO
group share their task too. The trainer runs such a prefix once and continues every row from its KV
cache (`Policy.logprobs`, `_Collated.shared`); the logprobs and gradients are the same (tests/
test_rl.py). This times a forward + backward pass of one micro-batch of tools-tiny oracle
trajectories both ways, alternating, on the kit's model.

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
import time
from pathlib import Path
from typing import Any

import torch

from openforgerl.modelkit import cached_model
from openforgerl.react_agent import SYSTEM_PROMPT, TOOLS
from openforgerl.rl.sft import chat_sample
from openforgerl.rl.trainer import Policy
from openforgerl.tasks import Task, load_tasks
from openforgerl.tasks.suites.tools_tiny import OracleCall, oracle


def oracle_conversation(task: Task) -> list[dict[str, Any]]:
    """The ReAct harness's conversation for `task` played by the tools-tiny oracle."""
    assert isinstance(task.files, dict)
    solution = oracle(task)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.instruction},
    ]
    calls = [*solution.calls, OracleCall("submit", {"answer": solution.final_answer})]
    for i, call in enumerate(calls):
        function = {"name": call.name, "arguments": call.arguments}
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": f"c{i}", "type": "function", "function": function}],
            }
        )
        if call.name == "read_file":
            messages.append(
                {"role": "tool", "tool_call_id": f"c{i}", "content": task.files[call.arguments["path"]]}
            )
        elif call.name == "write_file":
            wrote = f"wrote {len(call.arguments['content'])} characters to {call.arguments['path']}"
            messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": wrote})
    return messages


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

    policy = Policy(cached_model(args.size), lr=1e-3)
    tasks = load_tasks("tools-tiny", split="train")[: max(args.batch)]
    samples = [chat_sample(oracle_conversation(t), TOOLS, policy.tokenizer) for t in tasks]
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
