"""`openforge train`: the RL loop on one machine.

For each step: draw a batch of train tasks, run G rollouts of each through the harness in local
sandboxes against an embedded gateway, build merged samples from what the gateway recorded, train
one step, write a checkpoint and load it into the engine in place. The gateway serves the same
engine object all run long, so rollouts of step k+1 come from the weights of step k.

Run folder:
    run.json                 the options (read back by --resume)
    gateway.db               every recorded call of every step (the trace viewer reads it)
    steps/NNNNNN/runner.db   the runner's state of step N: finished rollouts are never redone
    evals/NNNNNN/runner.db   held-out evaluation after step N (when --eval-every is set)
    checkpoints/step-NNNNNN  HF model + tokenizer + optimizer.pt + trainer_state.json
    metrics.jsonl            one JSON object per step (`step` key); tensorboard/ when installed

Resume after a crash (even kill -9): the last checkpoint gives the weights, optimizer and step;
the next step's runner state keeps its finished rollouts, so none is lost or repeated; a step
whose checkpoint exists but whose metrics line was not written yet gets it from the checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.gateway.server import GatewayConfig, RunningGateway, serve_in_thread
from openforgerl.rl.trainer import MetricsLog, Rollout, Trainer, TrainerConfig, iter_checkpoints, passed
from openforgerl.runner import OnFailure, RolloutResult, Runner, RunnerConfig, Status, react_harness
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import Task, load_tasks
from openforgerl.trajectory import build_samples, calls_from_json

RUN_FILE = "run.json"


@dataclass
class TrainOptions:
    model: str  # the starting model directory (HF format)
    out: Path  # the run folder
    tasks: str = "tools-tiny"
    split: str = "train"
    steps: int = 10
    group: int = 4  # rollouts per task (G)
    batch_tasks: int = 4  # tasks per step
    max_tokens: int = 128  # per model call
    max_turns: int = 8
    max_context: int = 4096
    concurrency: int = 8
    temperature: float = 1.0
    on_failure: OnFailure = "zero"
    seed: int = 0
    eval_every: int = 0  # held-out evaluation every N steps (0: never), greedy, one run per task
    eval_split: str = "heldout"
    eval_limit: int | None = None
    keep_checkpoints: int = 2
    progress: bool = True
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainOptions:
        d = dict(d)
        d["out"] = Path(d["out"])
        d["trainer"] = TrainerConfig.from_dict(d["trainer"])
        return cls(**d)


def load_options(run_dir: Path) -> TrainOptions:
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run to resume ({RUN_FILE} is missing)")
    return TrainOptions.from_json(json.loads(path.read_text()))


def step_tasks(tasks: Sequence[Task], step: int, n: int, seed: int) -> list[Task]:
    """The tasks of `step`: drawn from (seed, step) alone, so a resumed run draws the same ones."""
    return random.Random(f"{seed}:{step}").sample(list(tasks), min(n, len(tasks)))


def run_tasks(
    gw: RunningGateway,
    tasks: Sequence[Task],
    n: int,
    state_dir: Path,
    run_id: str,
    opts: TrainOptions,
    *,
    sampling: dict[str, Any] | None = None,
    desc: str = "rollouts",
) -> list[RolloutResult]:
    """Run every task n times against the gateway; `state_dir` keeps the runner's state."""
    cfg = RunnerConfig(
        gateway_url=gw.url,
        admin_token=gw.gateway.admin_token,
        run_id=run_id,
        state_path=state_dir / "runner.db",
        concurrency=opts.concurrency,
        on_failure=opts.on_failure,
        sampling=sampling or {},
    )
    bar = tqdm(total=len(tasks) * n, desc=desc, unit="rollout", disable=not opts.progress, leave=False)

    async def go() -> list[RolloutResult]:
        runner = Runner(cfg, LocalBackend(), react_harness(opts.max_turns, opts.max_tokens))
        try:
            return await runner.run(tasks, n, on_done=lambda _: bar.update(1))
        finally:
            await runner.close()

    try:
        return asyncio.run(go())
    finally:
        bar.close()


def recorded_rollouts(gw: RunningGateway, results: Sequence[RolloutResult]) -> list[Rollout]:
    """The trainer's view of finished rollouts: merged samples of each one's recorded calls."""
    out = []
    headers = {"authorization": f"Bearer {gw.gateway.admin_token}"}
    with httpx.Client(base_url=gw.url, headers=headers, timeout=120) as client:
        for r in results:
            if r.status == Status.DROPPED or not r.gateway_rollout_id:
                continue
            resp = client.get(f"/admin/rollouts/{r.gateway_rollout_id}/calls")
            resp.raise_for_status()
            reward = r.reward if r.status == Status.DONE else None
            samples = build_samples(calls_from_json(resp.json()), float(reward or 0.0))
            out.append(Rollout(r.task_id, reward, samples))
    return out


def evaluate(gw: RunningGateway, opts: TrainOptions, tasks: Sequence[Task], step: int) -> dict[str, float]:
    """pass@1 with greedy decoding on the held-out tasks, with the engine's current weights."""
    results = run_tasks(
        gw,
        tasks,
        1,
        opts.out / "evals" / f"{step:06d}",
        f"{opts.out.name}-eval{step}",
        opts,
        sampling={"temperature": 0.0},
        desc=f"eval after step {step}",
    )
    scored = [r.reward for r in results if r.status == Status.DONE and r.reward is not None]
    return {
        "eval/pass@1": sum(passed(x) for x in scored) / len(scored) if scored else 0.0,
        "eval/reward_mean": sum(scored) / len(scored) if scored else 0.0,
        "eval/tasks": len(scored),
    }


def _start_engine(model_dir: Path, version: int) -> TransformersEngine:
    # A resumed run's engine starts on the checkpoint's weights: its calls must carry that version.
    return TransformersEngine(model_dir, policy_version=version)


def train(opts: TrainOptions, *, resume: bool = False) -> dict[str, Any]:
    """Run (or, with `resume`, continue) the loop up to `opts.steps`; returns a summary."""
    run_dir = opts.out
    if not resume and (run_dir / RUN_FILE).exists():
        raise FileExistsError(
            f"{run_dir} already holds a run: resume it with --resume, or pick another --out"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps(opts.to_json(), indent=2))
    train_tasks = load_tasks(opts.tasks, split=opts.split)  # type: ignore[arg-type]
    if not train_tasks:
        raise ValueError(f"no {opts.split} tasks in {opts.tasks}")
    eval_tasks: list[Task] = []
    if opts.eval_every:
        eval_tasks = load_tasks(opts.tasks, split=opts.eval_split)[: opts.eval_limit]  # type: ignore[arg-type]

    checkpoints = list(iter_checkpoints(run_dir / "checkpoints"))
    log = MetricsLog(run_dir)
    if checkpoints:
        last_step, last = checkpoints[-1]
        trainer = Trainer.resume(last, opts.trainer, group_size=opts.group, reference_dir=opts.model)
        state = json.loads((last / "trainer_state.json").read_text())
        if last_step not in log.steps() and "metrics" in state:
            log.write(last_step, state["metrics"])  # the crash came between checkpoint and log
        model_dir = last
    else:
        trainer = Trainer(opts.model, opts.trainer, group_size=opts.group)
        model_dir = Path(opts.model)
    engine = _start_engine(model_dir, trainer.policy_version)
    gw_cfg = GatewayConfig(
        model=str(model_dir),
        port=0,
        store=str(run_dir / "gateway.db"),
        max_tokens=opts.max_tokens,
        max_context=opts.max_context,
        temperature=opts.temperature,
    )
    t_start = time.monotonic()
    try:
        with serve_in_thread(gw_cfg, engine) as gw:
            if opts.eval_every and trainer.step == 0 and 0 not in log.steps():
                log.write(0, {"policy_version": 0, **evaluate(gw, opts, eval_tasks, 0)})
            steps = range(trainer.step + 1, opts.steps + 1)
            for step in tqdm(steps, desc="train", unit="step", disable=not opts.progress):
                metrics = _one_step(gw, engine, trainer, opts, train_tasks, step)
                if opts.eval_every and step % opts.eval_every == 0:
                    t0 = time.monotonic()
                    metrics.update(evaluate(gw, opts, eval_tasks, step))
                    metrics["time/eval"] = time.monotonic() - t0
                log.write(step, metrics)
                _prune(run_dir / "checkpoints", opts.keep_checkpoints)
    finally:
        log.close()
    final = list(iter_checkpoints(run_dir / "checkpoints"))
    return {
        "steps": trainer.step,
        "policy_version": trainer.policy_version,
        "checkpoint": str(final[-1][1]) if final else None,
        "metrics": str(log.path),
        "seconds": round(time.monotonic() - t_start, 1),
    }


def _one_step(
    gw: RunningGateway,
    engine: TransformersEngine,
    trainer: Trainer,
    opts: TrainOptions,
    train_tasks: Sequence[Task],
    step: int,
) -> dict[str, Any]:
    t0 = time.monotonic()
    tasks = step_tasks(train_tasks, step, opts.batch_tasks, opts.seed)
    state_dir = opts.out / "steps" / f"{step:06d}"
    results = run_tasks(gw, tasks, opts.group, state_dir, f"{opts.out.name}-step{step}", opts)
    rollouts = recorded_rollouts(gw, results)
    t_rollout = time.monotonic() - t0
    metrics = trainer.train_step(rollouts)
    metrics["time/rollout"] = t_rollout
    metrics["rollout_tokens"] = sum(len(s.input_ids) for r in rollouts for s in r.samples)
    metrics["outcomes"] = _count(r.outcome or r.status.value for r in results)
    t1 = time.monotonic()
    checkpoint = opts.out / "checkpoints" / f"step-{step:06d}"
    trainer.save(checkpoint, metrics=metrics)
    metrics["time/save"] = time.monotonic() - t1
    if metrics["updated"]:
        t2 = time.monotonic()
        version = asyncio.run(trainer.push_weights(engine, checkpoint))
        if version != trainer.policy_version:
            raise RuntimeError(
                f"the engine is at policy version {version}, the trainer at {trainer.policy_version}"
            )
        metrics["time/push"] = time.monotonic() - t2
    metrics["time/step"] = time.monotonic() - t0
    return metrics


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (at least one always stays: resume needs it)."""
    found = list(iter_checkpoints(root))
    for _, path in found[: max(0, len(found) - max(keep, 1))]:
        shutil.rmtree(path, ignore_errors=True)
