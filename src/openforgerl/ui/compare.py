"""Two or more evaluations of the same tasks side by side: each one's scores with their intervals
(as its report.json has them), and the paired difference of each pair with its interval, overall,
per task family (tag) and per task.

The paired differences are `openforgerl.eval_stats.paired_difference` over the reports' per-task
figures, with its defaults (95%, 10,000 resamples, seed 0): the demo's report.json computes RL over
SFT the same way (`demo._paired_gain`), so the viewer shows the very numbers the report has.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openforgerl.eval_stats import paired_difference
from openforgerl.run.folder import REPORT

REPORT_FIELDS = ("tasks", "harness", "n", "k", "temperature", "seed", "rollouts", "outcomes")


def read_report(folder: Path) -> dict[str, Any] | None:
    try:
        report = json.loads((folder / REPORT).read_text())
    except (OSError, ValueError):
        return None
    # An evaluation's report (openforge eval), not a demo's or a study's of several.
    return report if isinstance(report, dict) and "per_task" in (report.get("summary") or {}) else None


def eval_key(folder: Path) -> dict[str, str] | None:
    """What makes two evaluations comparable, for a run folder holding one: the same tasks, the
    same number of runs per task, at the same temperature. None for a folder without one."""
    report = read_report(folder)
    if report is None:
        return None
    tasks = sorted(str(t.get("task_id")) for t in report["summary"]["per_task"])
    digest = hashlib.sha256("\n".join(tasks).encode()).hexdigest()[:12]
    n, temperature = report.get("n"), report.get("temperature")
    how = "greedy, 1 run per task" if temperature == 0 and n == 1 else f"{n} runs per task"
    if temperature not in (None, 0):
        how += f" at temperature {temperature:g}"
    label = f"{report.get('tasks')}: {len(tasks)} tasks, {how}"
    return {"key": f"{label} {digest}", "label": label}


def comparable_groups(evals: Sequence[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """The runs' evaluations grouped by what they evaluated (eval_key), in the runs' order: each
    group of two or more is one comparison (the demo: before, after SFT, after RL on the same tasks)."""
    groups: dict[str, dict[str, Any]] = {}
    for name, key in evals:
        groups.setdefault(key["key"], {"label": key["label"], "runs": []})["runs"].append(name)
    return [g for g in groups.values() if len(g["runs"]) >= 2]


def _pairs(count: int) -> list[tuple[int, int]]:
    """Each evaluation against the one before it, and the last against the first when there are
    three or more (the demo: before -> SFT, SFT -> RL, before -> RL)."""
    pairs = [(i - 1, i) for i in range(1, count)]
    return pairs + [(0, count - 1)] * (count >= 3)


def _per_task(report: dict[str, Any], metric: str) -> dict[str, float]:
    """Each task's figure of `metric` ("mean_reward", "pass@k:1", "pass^k:2") in a report."""
    out = {}
    for t in report["summary"]["per_task"]:
        if metric == "mean_reward":
            out[t["task_id"]] = float(t["mean_reward"])
        else:
            family, k = metric.split(":")
            out[t["task_id"]] = float(t[family][k])
    return out


def _overall(report: dict[str, Any], metric: str) -> dict[str, float] | None:
    summary = report["summary"]
    if metric == "mean_reward":
        return summary.get("mean_reward")
    family, k = metric.split(":")
    return (summary.get(family) or {}).get(k)


def _metric_label(metric: str) -> str:
    if metric == "mean_reward":
        return "mean reward"
    family, k = metric.split(":")
    return f"{family.removesuffix('k')}{k}"  # pass@k:1 -> pass@1, pass^k:2 -> pass^2


def _tags(reports: Sequence[dict[str, Any]], tasks: set[str]) -> dict[str, list[str]]:
    """Each task's tags: from the reports (evaluate.py writes task_tags), else from the suite the
    report names, when it is one this machine can load."""
    for report in reports:
        tags = report.get("task_tags")
        if isinstance(tags, dict) and tasks <= set(tags):
            return {t: list(tags[t]) for t in tasks}
    try:
        from openforgerl.tasks import load_tasks

        loaded = {t.id: list(t.tags) for t in load_tasks(str(reports[0].get("tasks")))}
    except Exception:  # not a suite here (a task file elsewhere): no per-tag figures
        return {}
    return {t: loaded.get(t, []) for t in tasks}


def compare_reports(named: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The comparison of evaluations (run name, report.json) of the same tasks, in the given order.
    Raises ValueError when their tasks differ."""
    names = [n for n, _ in named]
    reports = [r for _, r in named]
    task_sets = [set(_per_task(r, "mean_reward")) for r in reports]
    for name, other in zip(names[1:], task_sets[1:], strict=True):
        if other != task_sets[0]:
            only = sorted(other ^ task_sets[0])[:5]
            raise ValueError(
                f"{names[0]!r} and {name!r} did not evaluate the same tasks (e.g. {', '.join(only)}): "
                "a paired comparison needs the same tasks"
            )
    tasks = sorted(task_sets[0])
    common = sorted(set.intersection(*[set(r["summary"].get("pass@k") or {}) for r in reports]), key=int)
    metrics = [f"pass@k:{k}" for k in common] + [f"pass^k:{k}" for k in common[1:]] + ["mean_reward"]
    pairs = _pairs(len(reports))
    per_task = {m: [_per_task(r, m) for r in reports] for m in metrics}

    def paired(metric: str, i: int, j: int, only: Sequence[str] = tasks) -> dict[str, float]:
        a, b = per_task[metric][i], per_task[metric][j]
        return paired_difference({t: a[t] for t in only}, {t: b[t] for t in only}).as_dict()

    overall = [
        {
            "metric": _metric_label(m),
            "values": [_overall(r, m) for r in reports],
            "differences": [paired(m, i, j) for i, j in pairs],
        }
        for m in metrics
    ]
    tags = _tags(reports, set(tasks))
    members: dict[str, list[str]] = {}
    for t in tasks:
        for tag in dict.fromkeys(tags.get(t, [])):
            members.setdefault(tag, []).append(t)
    headline = metrics[0]  # pass@1
    by_tag = [
        {
            "tag": tag,
            "tasks": len(ts),
            "values": [sum(v[t] for t in ts) / len(ts) for v in per_task[headline]],
            "differences": [paired(headline, i, j, ts) for i, j in pairs],
        }
        for tag, ts in sorted(members.items())
        if len(ts) < len(tasks)  # a tag every task carries (the suite's) is the overall row again
    ]
    rows = {r_name: {t["task_id"]: t for t in r["summary"]["per_task"]} for r_name, r in named}
    by_task = [
        {
            "task_id": t,
            "tags": [g for g in tags.get(t, []) if g in {row["tag"] for row in by_tag}],
            "values": [v[t] for v in per_task[headline]],
            "successes": [rows[n][t]["successes"] for n in names],
            "runs": [rows[n][t]["runs"] for n in names],
            "differences": [per_task[headline][j][t] - per_task[headline][i][t] for i, j in pairs],
        }
        for t in tasks
    ]
    return {
        "runs": names,
        "metric": _metric_label(headline),
        "pairs": [{"from": names[i], "to": names[j]} for i, j in pairs],
        "interval": "95% interval (percentile bootstrap over tasks, paired by task)",
        "overall": overall,
        "by_tag": by_tag,
        "by_task": by_task,
        # What the rollouts did (openforgerl.behaviour): tool errors, recoveries, self-verification.
        "behaviour": [(r.get("acting") or {}).get("all") for r in reports],
        "reports": [
            {
                k: r.get(k)
                for k in ("tasks", "harness", "n", "k", "temperature", "seed", "rollouts", "outcomes")
            }
            for r in reports
        ],
    }
