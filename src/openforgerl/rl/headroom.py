"""Headroom: what the starting policy leaves for RL to learn, measured before training.

GRPO learns from groups whose rewards differ: a task the policy always solves, or never does, gives
every rollout the same advantage (zero) and the group is dropped. Before spending steps on RL, run
k rollouts of a sample of train tasks with the policy as training would (same harness, engine and
temperature) and measure:

    pass@1, pass@k        unbiased estimators (eval_stats) over the sampled tasks; pass@k - pass@1
                          is what RL can at best turn into pass@1 on them
    mixed_fraction        the share of tasks whose k rewards differ: the groups with a signal
    all_fail_fraction     the share of tasks with no success in k runs
    all_pass_fraction     the share of tasks with a success in every run
    sampled_nll           the mean -logprob of the sampled tokens (the behaviour logprobs the
                          engine recorded, of logits / temperature): a one-sample estimate of the
                          per-token entropy of the sampling distribution. Near 0 the policy samples
                          the same thing every time, and its groups cannot differ.
    task_pass_rates       each task's success rate (for a curriculum)

and say plainly (`verdict`) when RL has nothing to work with. `openforge train --check` measures it
alone; `--headroom-tasks N` measures it before the first step of a run (headroom.json in the run
folder, `headroom/*` metrics at step 0). Rollouts keep their runner state in headroom/ of the run
folder, so a resumed or repeated measurement redoes none.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openforgerl.run.folder import HEADROOM as HEADROOM_FILE
from openforgerl.run.folder import HEADROOM_STATE as STATE_DIR  # the measurement's runner state

if TYPE_CHECKING:
    from openforgerl.engines.base import Engine
    from openforgerl.rl.config import TrainOptions
    from openforgerl.rollouts.results import RolloutResult
    from openforgerl.rollouts.service import RolloutService
    from openforgerl.tasks import Task

CHECK_TASKS = 16  # tasks `train --check` samples when --headroom-tasks is not given
SUCCESS = 1.0 - 1e-9  # a run succeeds at reward >= this (binary rewards; as the trainer's `passed`)

# Below this mean NLL per sampled token (nats) sampling is close to greedy: the sampled token had
# probability ~0.95 on average, most positions have one near-certain token, and the G rollouts of a
# group mostly repeat each other, so their rewards rarely differ.
DETERMINISTIC_NLL = 0.05
# Below this gap between pass@k and pass@1 there is little RL can turn into pass@1: five points
# on the sampled tasks is within the noise of a 16-task sample.
SMALL_GAP = 0.05


@dataclass
class Headroom:
    """The starting policy's measurement on `tasks` sampled train tasks, `k` runs each."""

    k: int
    tasks: int  # tasks with k scored runs (the statistics are over these)
    rollouts: int  # every rollout run, scored or not
    unscored: int  # rollouts without a reward (infrastructure failures, dropped)
    pass_at_1: float
    pass_at_k: float
    mixed_fraction: float
    all_fail_fraction: float
    all_pass_fraction: float
    sampled_nll: float  # mean -logprob per sampled token
    sampled_tokens: int
    task_pass_rates: dict[str, float]
    seconds: float
    temperature: float
    verdict: list[str] = field(default_factory=list)

    @property
    def has_signal(self) -> bool:
        """Whether any sampled task gave a group with differing rewards."""
        return self.mixed_fraction > 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Headroom:
        return cls(**d)

    def metrics(self) -> dict[str, float]:
        """The scalar figures as `headroom/*` metrics."""
        keys = ("pass_at_1", "pass_at_k", "mixed_fraction", "all_fail_fraction", "all_pass_fraction")
        out: dict[str, float] = {f"headroom/{key}": getattr(self, key) for key in keys}
        out.update({"headroom/sampled_nll": self.sampled_nll, "headroom/k": self.k})
        out.update({"headroom/tasks": self.tasks, "headroom/seconds": self.seconds})
        return out

    def table(self) -> str:
        """A short plain-text table of the figures."""
        rows = [
            ("tasks x runs", f"{self.tasks} x {self.k} ({self.unscored} unscored)"),
            ("pass@1", f"{self.pass_at_1:.3f}"),
            (f"pass@{self.k}", f"{self.pass_at_k:.3f}"),
            ("mixed outcomes", f"{self.mixed_fraction:.0%} of tasks"),
            ("all fail", f"{self.all_fail_fraction:.0%} of tasks"),
            ("all pass", f"{self.all_pass_fraction:.0%} of tasks"),
            ("sampled NLL/token", f"{self.sampled_nll:.3f} (temperature {self.temperature:g})"),
            ("time", f"{self.seconds:.1f} s"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def draw_tasks(tasks: Sequence[Task], n: int, seed: int) -> list[Task]:
    """The `n` tasks measured: drawn from `seed` alone (a different stream from the steps' draws)."""
    return random.Random(f"{seed}:headroom").sample(list(tasks), min(n, len(tasks)))


def headroom_of(
    results: Sequence[RolloutResult], k: int, *, seconds: float = 0.0, temperature: float = 1.0
) -> Headroom:
    """The statistics of k runs per task (`results`, with their recorded samples)."""
    from openforgerl.eval_stats import summarize
    from openforgerl.rollouts.results import Status

    scored: dict[str, list[float]] = {}
    for r in results:
        if r.status == Status.DONE and r.reward is not None:
            scored.setdefault(r.task_id, []).append(float(r.reward))
    runs = {task: rewards for task, rewards in scored.items() if len(rewards) >= k}
    nll, tokens = 0.0, 0
    for r in results:
        if r.task_id in runs:
            for s in r.samples:
                for m, lp in zip(s.loss_mask, s.logprobs, strict=True):
                    if m:
                        nll -= lp
                        tokens += 1
    unscored = sum(1 for r in results if r.status != Status.DONE or r.reward is None)
    figures: dict[str, float] = dict.fromkeys(
        ("pass_at_1", "pass_at_k", "mixed_fraction", "all_fail_fraction", "all_pass_fraction"), 0.0
    )
    rates: dict[str, float] = {}
    if runs:
        summary = summarize(runs, ks=(1, k), success_threshold=SUCCESS, n_bootstrap=1)
        n = len(runs)
        figures = {
            "pass_at_1": summary.pass_at[1].estimate,
            "pass_at_k": summary.pass_at[k].estimate,
            # A group has a GRPO signal when its rewards differ (with binary rewards: a success
            # and a failure); all-fail and all-pass count successes.
            "mixed_fraction": sum(len(set(r)) > 1 for r in runs.values()) / n,
            "all_fail_fraction": sum(t.successes == 0 for t in summary.tasks) / n,
            "all_pass_fraction": sum(t.successes == t.runs for t in summary.tasks) / n,
        }
        rates = {t.task_id: t.successes / t.runs for t in summary.tasks}
    out = Headroom(
        k=k,
        tasks=len(runs),
        rollouts=len(results),
        unscored=unscored,
        sampled_nll=nll / tokens if tokens else 0.0,
        sampled_tokens=tokens,
        task_pass_rates=rates,
        seconds=round(seconds, 1),
        temperature=temperature,
        pass_at_1=figures["pass_at_1"],
        pass_at_k=figures["pass_at_k"],
        mixed_fraction=figures["mixed_fraction"],
        all_fail_fraction=figures["all_fail_fraction"],
        all_pass_fraction=figures["all_pass_fraction"],
    )
    out.verdict = verdict(out)
    return out


def verdict(h: Headroom) -> list[str]:
    """What the measurement means for RL, in plain words (most important first)."""
    if not h.tasks:
        return [f"no sampled task got {h.k} scored runs: nothing was measured (see the runner's errors)"]
    lines = []
    if not h.has_signal:
        lines.append(
            f"RL has nothing to work with: no task had mixed outcomes in {h.k} runs "
            "(every group would be dropped)"
        )
    if h.pass_at_k == 0:
        lines.append("pass@1 is 0 on every sampled task: RL without a signal; SFT first")
    elif h.all_pass_fraction == 1:
        lines.append(f"every sampled task passed all {h.k} runs: nothing left to learn here; harder tasks")
    if h.sampled_tokens and h.sampled_nll < DETERMINISTIC_NLL:
        lines.append(
            f"the policy is nearly deterministic (sampled NLL {h.sampled_nll:.3f} per token): "
            "raise the temperature"
        )
    gap = h.pass_at_k - h.pass_at_1
    if 0 < h.pass_at_k and h.all_pass_fraction < 1 and gap < SMALL_GAP:
        lines.append(
            f"pass@1 {h.pass_at_1:.3f} is close to pass@{h.k} {h.pass_at_k:.3f}: little to turn into pass@1"
        )
    if h.has_signal and gap >= SMALL_GAP:
        lines.append(
            f"room for RL: pass@{h.k} - pass@1 = {gap:.3f}; "
            f"a share {h.mixed_fraction:.2f} of tasks give a signal"
        )
    return lines


def measure_headroom(
    service: RolloutService,
    opts: TrainOptions,
    tasks: Sequence[Task],
    *,
    n_tasks: int,
    k: int,
    out_dir: Path,
) -> Headroom:
    """Run `k` rollouts of `n_tasks` of `tasks` (drawn from opts.seed) as the loop runs a step's
    (its harness, and the gateway's temperature: opts.temperature), with runner state in
    out_dir/headroom/ (finished rollouts are never redone), and measure them."""
    from openforgerl.rl.runs import run_tasks

    if n_tasks < 1 or k < 1:
        raise ValueError(f"headroom needs at least 1 task and 1 run each, not {n_tasks} x {k}")
    t0 = time.monotonic()
    results = run_tasks(
        service,
        draw_tasks(tasks, n_tasks, opts.seed),
        k,
        out_dir / STATE_DIR,
        f"{opts.out.name}-headroom",
        opts,
        desc="headroom",
    )
    return headroom_of(results, k, seconds=time.monotonic() - t0, temperature=opts.temperature)


def write(h: Headroom, run_dir: Path) -> Path:
    path = run_dir / HEADROOM_FILE
    path.write_text(json.dumps(h.to_json(), indent=2))
    return path


def read(run_dir: Path) -> Headroom | None:
    path = run_dir / HEADROOM_FILE
    return Headroom.from_json(json.loads(path.read_text())) if path.is_file() else None


def before_training(service: RolloutService, opts: TrainOptions, tasks: Sequence[Task]) -> dict[str, float]:
    """The loop's measurement before its first step: headroom.json of the run folder when there
    is one (a resumed run, or a `train --check` of the same folder), else measured, written and
    its verdict printed; returns the `headroom/*` metrics."""
    h = read(opts.out)
    if h is None:
        h = measure_headroom(
            service, opts, tasks, n_tasks=opts.headroom_tasks, k=opts.headroom_k, out_dir=opts.out
        )
        write(h, opts.out)
        for line in h.verdict:
            print(f"headroom: {line}", file=sys.stderr, flush=True)
    return h.metrics()


def check(opts: TrainOptions, *, engine: Engine | None = None) -> Headroom:
    """`openforge train --check`: measure opts.model's headroom on opts.tasks through the engine,
    gateway and harness training would use, write headroom.json in opts.out, and train nothing.
    `engine` replaces the one opts.engine names (tests)."""
    from openforgerl.rl.runs import harness_choice, serving_run, training_tasks
    from openforgerl.rollouts.runner import check_images

    harness = harness_choice(opts)
    tasks = training_tasks(opts)
    harness.check(tasks)
    check_images(tasks, opts.backend.name)
    opts.out.mkdir(parents=True, exist_ok=True)
    # The run's store: a later `train --out` here reuses the rollouts. A server engine is loaded
    # with the starting model first, as the loop does.
    with serving_run(opts, opts.model, engine=engine) as stack:
        n = opts.headroom_tasks or CHECK_TASKS
        h = measure_headroom(stack.service, opts, tasks, n_tasks=n, k=opts.headroom_k, out_dir=opts.out)
    write(h, opts.out)
    return h
