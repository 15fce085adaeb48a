"""Baselines RL must beat to show that its reward, not more training, made the gain (issue #33).

Two cheaper ways to spend what an RL run spends, each fed to the same SFT trainer:

- Rejection-sampling fine-tuning (RFT; STaR's filter): the student's own rollouts on train tasks,
  as many as RL would make (`n_tasks` x `group`), recorded by an embedded gateway exactly as the RL
  loop records them (same harness, same sampling temperature, merged samples whose loss mask marks
  the model's own tokens), of which only the rollouts that passed (reward 1) are kept: SFT on them
  is RL with a 0/1 filter instead of an advantage. `rejection_sampling_data` makes that data and
  writes it where `openforge sft --data` and `load_sft_data` read it.
- SFT continued for the same compute: the SFT model trained further on the same teacher data, at a
  constant learning rate, for as many trained tokens as the RL run trained on
  (`rl_trained_tokens`, `matched_sft_steps`, `continue_sft`). Compute here counts the tokens each
  optimizer pass went forward and backward on; RL's generation and its old-policy and reference
  logprob passes are not counted, so the match is, if anything, generous to RL.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openforgerl.engines.base import Engine
from openforgerl.rl.config import SFTConfig, TrainOptions
from openforgerl.rl.trainer import MetricsLog, passed
from openforgerl.rollouts.trajectory import Sample
from openforgerl.run.folder import SAMPLES as SAMPLES_FILE
from openforgerl.run.folder import RunFolder

SUMMARY_FILE = "summary.json"


class RejectionSamples(list[Sample]):
    """The kept samples, and what they were kept from: `task_ids` (the tasks drawn), `rollouts`
    (those scored), `passed` (those with reward 1, whose samples were kept)."""

    def __init__(
        self, samples: Sequence[Sample], task_ids: Sequence[str], rollouts: int, passed: int
    ) -> None:
        super().__init__(samples)
        self.task_ids = list(task_ids)
        self.rollouts = rollouts
        self.passed = passed

    def summary(self) -> dict[str, Any]:
        return {
            "tasks": len(self.task_ids),
            "rollouts": self.rollouts,
            "passed": self.passed,
            "pass_rate": self.passed / self.rollouts if self.rollouts else 0.0,
            "samples": len(self),
            "loss_tokens": sum(s.num_loss_tokens for s in self),
            "tokens": sum(len(s.input_ids) for s in self),
        }


def rejection_sampling_data(
    model_dir: str | Path,
    out_dir: Path,
    *,
    tasks: str = "tools-tiny",
    split: str = "train",
    skip_tasks: int = 0,
    n_tasks: int,
    group: int,
    temperature: float = 1.0,
    seed: int = 0,
    max_tokens: int = 128,
    max_turns: int = 8,
    concurrency: int = 8,
    progress: bool = True,
    harness: str = "react",
    engine: Engine | str | None = None,
) -> RejectionSamples:
    """RFT's data: `group` rollouts of each of `n_tasks` train tasks by the student in `model_dir`,
    the samples of those that passed. The tasks are the split less its first `skip_tasks` (as RL's
    `--skip-tasks`), `n_tasks` distinct ones drawn from `seed` (RL's steps draw theirs per step, so
    may meet a task twice). Rollouts are recorded as the RL loop records them (its TrainOptions,
    `run_tasks` and `recorded_rollouts`), unseeded as RL's are; `out_dir` keeps the gateway's
    store, the runner's state (a rerun finishes an interrupted run without redoing a rollout), the
    kept samples (samples.jsonl, for `load_sft_data`) and the counts (summary.json).

    `engine`: the engine behind the gateway, or its spec (None: the built-in engine on `model_dir`;
    a scripted one in tests)."""
    from openforgerl.rl.loop import recorded_rollouts
    from openforgerl.rl.runs import run_tasks, step_tasks, training_tasks
    from openforgerl.rl.sft import write_samples
    from openforgerl.run.stack import serving

    if n_tasks < 1 or group < 1:
        raise ValueError(f"n_tasks and group must be at least 1, not {n_tasks} and {group}")
    opts = TrainOptions(
        model=str(model_dir),
        out=out_dir,
        tasks=tasks,
        split=split,
        skip_tasks=skip_tasks,
        harness=harness,
        group=group,
        batch_tasks=n_tasks,
        max_tokens=max_tokens,
        max_turns=max_turns,
        concurrency=concurrency,
        temperature=temperature,
        seed=seed,
        progress=progress,
    )
    chosen = step_tasks(training_tasks(opts), 0, n_tasks, seed)
    finished = out_dir / SUMMARY_FILE
    done = json.loads(finished.read_text()) if finished.exists() else {}
    if done.get("tasks") == len(chosen):
        # Done before: its samples from the file, without starting an engine (a server takes minutes).
        from openforgerl.rl.sft import load_sft_data

        samples = load_sft_data(out_dir / SAMPLES_FILE, model_dir)
        return RejectionSamples(samples, [t.id for t in chosen], done["rollouts"], done["passed"])
    out_dir.mkdir(parents=True, exist_ok=True)
    run = RunFolder(out_dir)
    with serving(
        model_dir, run.gateway_store, engine=engine, max_tokens=max_tokens, temperature=temperature
    ) as stack:
        results = run_tasks(stack.service, chosen, group, out_dir, run.name, opts, desc="rejection sampling")
    scored = [r for r in recorded_rollouts(results) if r.reward is not None]
    wins = [r for r in scored if passed(r.reward or 0.0)]
    kept = [s for r in wins for s in r.samples if s.num_loss_tokens]
    data = RejectionSamples(kept, [t.id for t in chosen], len(scored), len(wins))
    write_samples(data, out_dir / SAMPLES_FILE)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(data.summary(), indent=2) + "\n")
    return data


def rl_trained_tokens(run_dir: Path) -> int:
    """The tokens an RL run's trainer went forward and backward on, all steps together (the
    `tokens` of each step in its metrics.jsonl, counted once per PPO epoch)."""
    total = 0
    for line in RunFolder(run_dir).metrics.read_text().splitlines():
        row = json.loads(line)
        if int(row.get("step", 0)) > 0:
            total += int(row.get("tokens", 0))
    return total


def matched_sft_steps(samples: Sequence[Sample], tokens: int, batch_size: int) -> int:
    """SFT optimizer steps of `batch_size` sequences of `samples` that train on about `tokens`
    tokens (the samples' mean length; at least one step)."""
    if not samples:
        raise ValueError("no SFT samples to match a budget with")
    mean = sum(len(s.input_ids) for s in samples) / len(samples)
    return max(1, round(tokens / (batch_size * mean)))


def continue_sft(
    model_dir: str | Path,
    samples: Sequence[Sample],
    out: Path,
    *,
    steps: int,
    lr: float,
    batch_size: int = 16,
    seed: int = 0,
    micro_batch_tokens: int = 0,
    device: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """SFT from `model_dir` on `samples` for exactly `steps` optimizer steps at the constant `lr`
    (shuffled passes over the data, reshuffled each pass; a batch never holds a sample twice).
    Logs each step to out/metrics.jsonl and saves the model to `out`; returns the steps, the tokens
    trained on and the loss before and after."""
    from tqdm import tqdm

    from openforgerl.rl.sft import SFTTrainer

    if not samples:
        raise ValueError("no SFT samples with a loss token")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    cfg = SFTConfig(
        lr=lr,
        batch_size=batch_size,
        micro_batch_tokens=micro_batch_tokens,
        seed=seed,
        device=device,
        schedule="constant",
    )
    trainer = SFTTrainer(model_dir, cfg)  # no schedule set: the optimizer's constant lr
    out.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out)
    rng = random.Random(seed)
    size = max(1, min(batch_size, len(samples)))
    per_pass = math.ceil(len(samples) / size)
    first = trainer.loss(samples)
    tokens = 0
    t0 = time.monotonic()
    try:
        order: list[Sample] = []
        for step in tqdm(range(steps), desc="sft (continued)", unit="step", disable=not progress):
            i = step % per_pass
            if i == 0:
                order = list(samples)
                rng.shuffle(order)
            metrics = trainer.train_step(order[i * size : (i + 1) * size])
            tokens += int(metrics["tokens"])
            log.write(trainer.step, {**metrics, "trained_tokens": tokens})
    finally:
        log.close()
    last = trainer.loss(samples)
    trainer.policy.save_model(out)
    return {
        "samples": len(samples),
        "steps": trainer.step,
        "lr": lr,
        "trained_tokens": tokens,
        "loss_before": first,
        "loss_after": last,
        "seconds": round(time.monotonic() - t0, 1),
        "model": str(out),
    }
