"""pass@k, pass^k and mean reward from n >= k runs per task, with confidence intervals.

Estimators (unbiased, from n runs of which c succeed; Chen et al. 2021 for pass@k):
    pass@k = 1 - C(n - c, k) / C(n, k)   the chance that at least one of k runs succeeds
    pass^k = C(c, k) / C(n, k)           the chance that all k runs succeed (reliability)
A run succeeds when its reward is at least `success_threshold` (1.0 by default: binary rewards).

Overall figures are means over tasks (every task weighs the same, however many runs it has).
Their confidence intervals are percentile bootstrap intervals over tasks: tasks are resampled with
replacement and each figure recomputed. Tasks, not runs, are resampled because tasks are the sample
from the population of interest and runs of one task are correlated; the bootstrap rather than a
t-interval because these figures are bounded in [0, 1] and skewed near the ends, where a t-interval
spills outside them. It is seeded, so a report is reproducible. With few tasks the interval is
optimistic (a single task gives a zero-width interval): it measures task sampling only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import comb
from typing import Any

import numpy as np

BOOTSTRAP_CHUNK = 1000  # resamples drawn at once: bounds memory at chunk x tasks counts


def _check_counts(n: int, c: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if n < k:
        raise ValueError(f"k={k} needs at least {k} runs per task, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"successes must be between 0 and n={n}, got {c}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n runs with c successes."""
    _check_counts(n, c, k)
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k from n runs with c successes."""
    _check_counts(n, c, k)
    return comb(c, k) / comb(n, k)


@dataclass(frozen=True, slots=True)
class Interval:
    estimate: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high}


@dataclass(frozen=True, slots=True)
class TaskRow:
    task_id: str
    runs: int
    successes: int
    mean_reward: float
    pass_at: dict[int, float]
    pass_hat: dict[int, float]


@dataclass(frozen=True, slots=True)
class EvalSummary:
    tasks: list[TaskRow]
    ks: tuple[int, ...]
    mean_reward: Interval
    pass_at: dict[int, Interval]
    pass_hat: dict[int, Interval]
    success_threshold: float
    confidence: float
    n_bootstrap: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able report (string keys, plain floats)."""
        return {
            "tasks": len(self.tasks),
            "runs": sum(t.runs for t in self.tasks),
            "success_threshold": self.success_threshold,
            "confidence": self.confidence,
            "interval": {"method": "percentile bootstrap over tasks", "resamples": self.n_bootstrap},
            "seed": self.seed,
            "mean_reward": self.mean_reward.as_dict(),
            "pass@k": {str(k): v.as_dict() for k, v in self.pass_at.items()},
            "pass^k": {str(k): v.as_dict() for k, v in self.pass_hat.items()},
            "per_task": [
                {
                    "task_id": t.task_id,
                    "runs": t.runs,
                    "successes": t.successes,
                    "mean_reward": t.mean_reward,
                    "pass@k": {str(k): v for k, v in t.pass_at.items()},
                    "pass^k": {str(k): v for k, v in t.pass_hat.items()},
                }
                for t in self.tasks
            ],
        }

    def to_markdown(self) -> str:
        """An overall table (estimates with intervals) and a per-task table."""
        pct = f"{self.confidence:.0%}"
        overall = [
            ("mean reward", self.mean_reward),
            *((f"pass@{k}", v) for k, v in self.pass_at.items()),
            *((f"pass^{k}", v) for k, v in self.pass_hat.items()),
        ]
        lines = [
            f"{len(self.tasks)} tasks, {sum(t.runs for t in self.tasks)} runs; success: reward >= "
            f"{self.success_threshold:g}; {pct} intervals: percentile bootstrap over tasks "
            f"({self.n_bootstrap} resamples, seed {self.seed}).",
            "",
            f"| metric | estimate | {pct} CI |",
            "|---|---:|---:|",
            *(f"| {name} | {v.estimate:.3f} | [{v.low:.3f}, {v.high:.3f}] |" for name, v in overall),
            "",
            "| task | runs | successes | mean reward | "
            + " | ".join([*(f"pass@{k}" for k in self.ks), *(f"pass^{k}" for k in self.ks)])
            + " |",
            "|---|" + "---:|" * (3 + 2 * len(self.ks)),
        ]
        for t in self.tasks:
            values = [*(t.pass_at[k] for k in self.ks), *(t.pass_hat[k] for k in self.ks)]
            lines.append(
                f"| {t.task_id} | {t.runs} | {t.successes} | {t.mean_reward:.3f} | "
                + " | ".join(f"{v:.3f}" for v in values)
                + " |"
            )
        return "\n".join(lines) + "\n"


def group_runs(records: Iterable[tuple[str, float]]) -> dict[str, list[float]]:
    """(task id, reward) pairs, e.g. one per finished rollout, grouped by task."""
    runs: dict[str, list[float]] = defaultdict(list)
    for task_id, reward in records:
        runs[task_id].append(float(reward))
    return dict(runs)


def bootstrap_means(
    values: np.ndarray, confidence: float, n_bootstrap: int, seed: int
) -> list[tuple[float, float]]:
    """Percentile bootstrap interval of the mean of each column of `values` (tasks x metrics),
    resampling rows (tasks) with replacement."""
    rng = np.random.default_rng(seed)
    n_tasks = values.shape[0]
    means = []
    for start in range(0, n_bootstrap, BOOTSTRAP_CHUNK):
        size = min(BOOTSTRAP_CHUNK, n_bootstrap - start)
        # How often each task is drawn in each resample: the same as drawing indices, as one matmul.
        counts = rng.multinomial(n_tasks, np.full(n_tasks, 1.0 / n_tasks), size=size)
        means.append(counts @ values / n_tasks)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(np.concatenate(means), [alpha, 1.0 - alpha], axis=0)
    return [(float(lo), float(hi)) for lo, hi in zip(low, high, strict=True)]


def summarize(
    runs: Mapping[str, Sequence[float]],
    ks: Sequence[int] = (1,),
    *,
    success_threshold: float = 1.0,
    confidence: float = 0.95,
    n_bootstrap: int = 10_000,
    seed: int = 0,
) -> EvalSummary:
    """Per-task and overall pass@k, pass^k and mean reward from each task's run rewards."""
    if not runs:
        raise ValueError("no tasks to summarize")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be at least 1, got {n_bootstrap}")
    ks = tuple(sorted(set(ks)))
    rows = []
    for task_id, rewards in runs.items():
        n = len(rewards)
        if n < max(ks):
            raise ValueError(f"task {task_id!r}: {n} runs, but k={max(ks)} needs at least {max(ks)}")
        c = sum(1 for r in rewards if r >= success_threshold)
        rows.append(
            TaskRow(
                task_id=task_id,
                runs=n,
                successes=c,
                mean_reward=float(np.mean(rewards)),
                pass_at={k: pass_at_k(n, c, k) for k in ks},
                pass_hat={k: pass_hat_k(n, c, k) for k in ks},
            )
        )
    table = np.array(
        [[t.mean_reward, *(t.pass_at[k] for k in ks), *(t.pass_hat[k] for k in ks)] for t in rows]
    )
    estimates = table.mean(axis=0)
    bounds = bootstrap_means(table, confidence, n_bootstrap, seed)
    intervals = [Interval(float(e), lo, hi) for e, (lo, hi) in zip(estimates, bounds, strict=True)]
    return EvalSummary(
        tasks=rows,
        ks=ks,
        mean_reward=intervals[0],
        pass_at=dict(zip(ks, intervals[1 : 1 + len(ks)], strict=True)),
        pass_hat=dict(zip(ks, intervals[1 + len(ks) :], strict=True)),
        success_threshold=success_threshold,
        confidence=confidence,
        n_bootstrap=n_bootstrap,
        seed=seed,
    )


def paired_difference(
    before: Mapping[str, float],
    after: Mapping[str, float],
    *,
    confidence: float = 0.95,
    n_bootstrap: int = 10_000,
    seed: int = 0,
) -> Interval:
    """The mean over tasks of `after - before` (per-task figures of two evaluations on the same
    tasks, e.g. pass@1 after SFT and after RL) with a percentile bootstrap interval over tasks.

    Pairing removes what the tasks share (an easy task is easy for both models), so the interval
    is of the change itself: far narrower than comparing two intervals of separate means."""
    if set(before) != set(after):
        raise ValueError("a paired difference needs the same tasks in both evaluations")
    if not before:
        raise ValueError("no tasks to compare")
    diffs = np.array([[after[t] - before[t]] for t in sorted(before)])
    ((low, high),) = bootstrap_means(diffs, confidence, n_bootstrap, seed)
    return Interval(float(diffs.mean()), low, high)


def by_tag(summary: EvalSummary, tags: Mapping[str, Sequence[str]]) -> dict[str, dict[str, Any]]:
    """Per tag (e.g. a suite's task family): its tasks, runs, mean reward and pass@k (the mean of
    its tasks' values, as overall). Tags that every task carries say nothing beyond the overall
    figures and are left out."""
    members: dict[str, list[TaskRow]] = defaultdict(list)
    for t in summary.tasks:
        for tag in dict.fromkeys(tags.get(t.task_id, ())):
            members[tag].append(t)
    out = {}
    for tag, rows in sorted(members.items()):
        if len(rows) == len(summary.tasks):
            continue
        out[tag] = {
            "tasks": len(rows),
            "runs": sum(t.runs for t in rows),
            "mean_reward": float(np.mean([t.mean_reward for t in rows])),
            "pass@k": {str(k): float(np.mean([t.pass_at[k] for t in rows])) for k in summary.ks},
        }
    return out
