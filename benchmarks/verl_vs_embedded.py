"""The embedded trainer and veRL's own trainer side by side: the same GRPO steps from the same start.

Both train the same starting model (default: the kit's tiny model) on tools-tiny with the same
sizes and seed: `--batch-tasks` tasks x `--group` rollouts a step, the ReAct harness with
`--max-turns` turns of `--max-tokens` tokens, temperature `--temperature` (rollouts and the
trainers' logprobs alike), lr `--lr`, groups with equal rewards
kept (veRL trains on them too), the tools-tiny verifier for the reward. Then each one's held-out
pass@1 (greedy, the first `--eval-limit` held-out tasks) after the last step:

    embedded   openforge train --tasks tools-tiny ... --eval-every STEPS
    veRL       openforge train --backend verl cpu_grpo ... trainer.test_freq=STEPS
               (veRL's V1 trainer, FSDP2 on gloo, the project's engine as its rollout replica)

Prints one JSON object (and writes it to --json): per trainer the training reward of every step,
the wall time of every step, the held-out pass@1 and the whole run's wall time. What is not the
same: the order in which the two draw their tasks (veRL's dataloader in file order, the embedded
trainer its own seeded draw), and the held-out evaluation's loop (veRL's validation through the
openforge agent loop at veRL's `val_kwargs`, temperature 0; the embedded trainer's greedy eval).

    .venv/bin/python benchmarks/verl_vs_embedded.py --steps 10 --json benchmarks/results/verl_vs_embedded.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from openforgerl.integrations.verl.data import dataset_rows, write_rows
from openforgerl.modelkit import cached_model


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_embedded(args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    run = out / "embedded"
    command = [
        sys.executable, "-m", "openforgerl.cli", "train",
        "--tasks", "tools-tiny", "--model", str(model), "--out", str(run),
        "--steps", str(args.steps), "--group", str(args.group), "--batch-tasks", str(args.batch_tasks),
        "--lr", str(args.lr), "--max-tokens", str(args.max_tokens), "--max-turns", str(args.max_turns),
        "--temperature", str(args.temperature), "--seed", str(args.seed),
        "--eval-every", str(args.steps), "--eval-limit", str(args.eval_limit),
        "--device", "cpu", "--keep-zero-variance",
    ]  # fmt: skip
    t0 = time.monotonic()
    with (out / "embedded.log").open("w") as log:
        rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    steps = [m for m in _jsonl(run / "metrics.jsonl") if isinstance(m.get("step"), int) and m["step"] >= 1]
    evals = [m["eval/pass@1"] for m in steps if "eval/pass@1" in m]
    return {
        "returncode": rc,
        "train_reward": [m.get("reward_mean") for m in steps],
        "train_pass_rate": [m.get("pass_rate") for m in steps],
        "step_seconds": [round(float(m.get("time/step", 0.0)), 2) for m in steps],
        "heldout_pass@1": evals[-1] if evals else None,
        "wall_seconds": round(wall, 1),
    }


def run_verl(args: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    data = out / "verl-data"
    write_rows(dataset_rows("tools-tiny", "train"), data / "train.jsonl")
    write_rows(dataset_rows("tools-tiny", "heldout", limit=args.eval_limit), data / "val.jsonl")
    metrics = out / "verl-metrics.jsonl"
    metrics.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "openforgerl.cli", "train", "--backend", "verl", "cpu_grpo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data / 'train.jsonl'}", f"data.val_files={data / 'val.jsonl'}",
        f"data.train_batch_size={args.batch_tasks}", f"actor_rollout_ref.rollout.n={args.group}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_tasks}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.rollout.temperature={args.temperature}",
        f"openforge.max_tokens={args.max_tokens}", f"openforge.max_turns={args.max_turns}",
        f"openforge.seed={args.seed}",
        f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.steps}",
        "trainer.logger=[console,file]", f"trainer.default_local_dir={out / 'verl-checkpoints'}",
    ]  # fmt: skip
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics)}
    t0 = time.monotonic()
    with (out / "verl.log").open("w") as log:
        rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out)
    wall = time.monotonic() - t0
    steps: dict[int, dict[str, Any]] = {}
    for record in _jsonl(metrics):
        steps.setdefault(int(record["step"]), {}).update(record["data"])
    trained = [steps[s] for s in sorted(steps) if "critic/score/mean" in steps[s]]
    val = [
        v for s in sorted(steps) for k, v in steps[s].items() if k.startswith("val-core/") and "reward" in k
    ]
    return {
        "returncode": rc,
        "train_reward": [m["critic/score/mean"] for m in trained],
        "step_seconds": [round(float(m.get("timing_s/step", 0.0)), 2) for m in trained],
        "heldout_pass@1": val[-1] if val else None,
        "rollout_probs_diff_max": [m.get("training/rollout_probs_diff_max") for m in trained],
        "wall_seconds": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="starting model dir (default: the kit's tiny model)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--batch-tasks", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval-limit", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="runs/verl-vs-embedded")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--only", choices=["embedded", "verl"], help="run one side only")
    args = p.parse_args()
    model = Path(args.model) if args.model else cached_model("tiny", 0)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "model": str(model),
        "tasks": "tools-tiny",
        "steps": args.steps,
        "group": args.group,
        "batch_tasks": args.batch_tasks,
        "lr": args.lr,
        "max_tokens": args.max_tokens,
        "max_turns": args.max_turns,
        "temperature": args.temperature,
        "eval_limit": args.eval_limit,
        "seed": args.seed,
        "cores": os.cpu_count(),
    }
    if args.only != "verl":
        result["embedded"] = run_embedded(args, model, out)
    if args.only != "embedded":
        result["verl"] = run_verl(args, model, out)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
