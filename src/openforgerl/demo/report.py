"""The demo's report: its figures (report.json: each evaluation with its intervals, RL's gain over
SFT paired by task, the GRPO steps, the timings) and its reward curve (reward_curve.png)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from openforgerl.demo.config import FAULTS_SUITE, SUITE, DemoConfig
from openforgerl.run.folder import RunFolder


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = RunFolder(run_dir).metrics
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def _interval(summary: dict[str, Any] | None, key: str, k: int | str) -> dict[str, float] | None:
    if not summary:
        return None
    return summary[key].get(str(k)) if key != "mean_reward" else summary["mean_reward"]


def _paired_gain(evals: dict[str, dict[str, Any]], before: str, after: str) -> dict[str, float] | None:
    """pass@1 of `after` minus `before`, paired by task, with its 95% bootstrap interval."""
    from openforgerl.eval_stats import paired_difference

    a, b = (evals.get(k, {}).get("summary") for k in (before, after))
    if not a or not b:
        return None

    def per_task(summary: dict[str, Any]) -> dict[str, float]:
        return {t["task_id"]: t["pass@k"]["1"] for t in summary["per_task"]}

    try:
        return paired_difference(per_task(a), per_task(b)).as_dict()
    except ValueError:  # not the same tasks (an evaluation from another run folder)
        return None


def build_report(
    cfg: DemoConfig, evals: dict[str, dict[str, Any]], seconds: dict[str, float]
) -> dict[str, Any]:
    run = RunFolder(cfg.out)
    rl = read_metrics(run.phase("rl").path)
    sft_summary = json.loads(run.phase("sft").sft_summary.read_text())
    train_tps = [r["tokens_per_s"] for r in rl if r.get("tokens_per_s")]
    sft_tps = [r["tokens_per_s"] for r in read_metrics(run.phase("sft").path) if r.get("tokens_per_s")]
    phases = {}
    for name, ev in evals.items():
        if name.endswith("-greedy"):
            continue
        s = ev.get("summary")
        greedy = evals.get(f"{name}-greedy")
        phases[name] = {
            "pass@1": _interval(s, "pass@k", 1),
            "greedy pass@1": _interval(greedy.get("summary"), "pass@k", 1) if greedy else None,
            f"pass^{cfg.eval_n}": _interval(s, "pass^k", cfg.eval_n),
            "mean_reward": _interval(s, "mean_reward", 0),
            "rollouts": ev["rollouts"],
            "infra_failed": ev.get("infra_failed", 0),  # in no figure beside it (the reward's contract)
            "outcomes": ev["outcomes"],
            # Tool errors met, recovered, gave up, read back (openforgerl.behaviour).
            "behaviour": ev.get("acting", {}).get("all", {}),
            # The suite tags each task with its family (add, copy, ...).
            "by_family": {
                tag: {"tasks": v["tasks"], "pass@1": v["pass@k"]["1"]}
                for tag, v in ev.get("by_tag", {}).items()
            },
        }
    versions = {v for ev in evals.values() for v in ev.get("harness_versions", {}).values()}
    headroom_file = run.phase("rl").headroom
    return {
        "suite": SUITE,
        "harness": cfg.harness,
        "harness_version": ", ".join(sorted(versions)),
        "train_suite": cfg.rl_suite,
        # RL's gain over SFT, paired by task (the evaluations' shared task difficulty drops out): the
        # headline on the clean held-out tasks, sampled and greedy; the same skills asked in other
        # words; and, with `faults`, the held-out tasks with their transient faults.
        "rl_minus_sft": {
            "pass@1": _paired_gain(evals, "sft", "rl"),
            "greedy pass@1": _paired_gain(evals, "sft-greedy", "rl-greedy"),
        },
        "rl_minus_sft_reworded": {"pass@1": _paired_gain(evals, "sft-reworded", "rl-reworded")},
        **(
            {"rl_minus_sft_faults": {"pass@1": _paired_gain(evals, "sft-faults", "rl-faults")}}
            if cfg.faults
            else {}
        ),
        "sft_minus_before": {"pass@1": _paired_gain(evals, "before", "sft")},
        # Of the faulted held-out rollouts that met an error: the share that then read the file.
        **(
            {
                "recovery_rate": {
                    stage: evals[f"{stage}-faults"].get("acting", {}).get("all", {}).get("recovery_rate")
                    for stage in ("before", "sft", "rl")
                    if f"{stage}-faults" in evals
                }
            }
            if cfg.faults
            else {}
        ),
        # The SFT policy measured on train tasks before RL (rl/headroom.json): what RL had to work with.
        "headroom": json.loads(headroom_file.read_text()) if headroom_file.exists() else None,
        "teacher": _teacher_line(cfg),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "evaluations": phases,
        "sft": sft_summary,
        "rl_steps": [{k: r.get(k) for k in STEP_KEYS} for r in rl if r["step"] > 0],
        "trainer_tokens_per_s": {
            "sft_median": _median(sft_tps),
            "rl_median": _median(train_tps),
        },
        "seconds": seconds,
        "total_seconds": round(sum(seconds.values()), 1),
    }


# Per GRPO step in the report: the rollouts' rewards, how many groups had no signal, the policy's
# entropy, and whether the update moved the trained sequences the way their advantages said.
STEP_KEYS = (
    "step",
    "reward_mean",
    "pass_rate",
    "groups_dropped_zero_variance",
    "groups_zero_variance_fraction",
    "entropy",
    "sampled_nll",
    "update/direction_agreement",
    "lr",
    "loss",
    "policy_version",
)


def _teacher_line(cfg: DemoConfig) -> str:
    """What the teacher's demonstrations show of faults: its weakness, said in the report."""
    from openforgerl.tasks import load_tasks
    from openforgerl.tasks.suites.tools_tiny import keep_faults

    if not cfg.faults:
        return "clean: the ORACLE teacher's demonstrations are recorded on tasks without faults"

    chosen = keep_faults(load_tasks(FAULTS_SUITE, split="train")[: cfg.teacher_tasks], cfg.teacher_faulted)
    met = sum(bool(t.faults) for t in chosen)
    if not met:
        return (
            "clean: the ORACLE teacher's demonstrations are recorded without faults, so they never "
            "show a failed tool call or a retry"
        )
    return (
        f"{met} of its {len(chosen)} demonstrations met a transient fault and read the file again; "
        "the others were recorded without faults"
    )


def _median(values: list[float]) -> float | None:
    import statistics

    return round(statistics.median(values), 1) if values else None


def plot_rewards(rows: list[dict[str, Any]], path: Path) -> None:
    """Per RL step: mean reward and pass rate of the training rollouts; the policy's entropy and the
    share of groups with equal rewards (no signal)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the PNG only
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["step"] > 0]  # step 0: the starting policy's measurements
    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.0, 3.6), dpi=120)
    ax.plot(steps, [r.get("reward_mean", 0.0) for r in rows], marker="o", label="mean reward")
    ax.plot(steps, [r.get("pass_rate", 0.0) for r in rows], marker=".", linestyle="--", label="pass rate")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("train rollouts")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{SUITE}: rewards of the training rollouts")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax2.plot(steps, [r.get("entropy") for r in rows], marker="o", label="entropy (nats/token)")
    ax2.plot(steps, [r.get("sampled_nll") for r in rows], marker=".", label="sampled NLL (nats/token)")
    ax2.plot(
        steps,
        [r.get("groups_zero_variance_fraction") for r in rows],
        linestyle="--",
        label="groups with equal rewards",
    )
    ax2.set_xlabel("GRPO step")
    ax2.set_title("entropy and the groups without a signal")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
