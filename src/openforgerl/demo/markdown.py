"""report.md: the demo's report as a reader sees it (the tables of report.json's figures)."""

from __future__ import annotations

from typing import Any


def _fmt(iv: dict[str, float] | None) -> str:
    if not iv:
        return "n/a"
    return f"{iv['estimate']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def _num(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, float) else "—"


def _headroom_line(h: dict[str, Any]) -> str:
    figures = ", ".join(
        f"{label} {h[key]:.3f}"
        for key, label in (
            ("pass@1", "pass@1"),
            ("pass@k", f"pass@{h.get('k', '')}"),
            ("mixed_fraction", "tasks with mixed outcomes"),
            ("sampled_nll", "sampled NLL per token"),
        )
        if isinstance(h.get(key), float | int)
    )
    return figures + ". " + " ".join(h.get("verdict", []))


def _loss(sft: dict[str, Any], key: str) -> str:
    before, after = sft.get(f"{key}_before"), sft.get(f"{key}_after")
    return "n/a" if before is None or after is None else f"{before:.3f} -> {after:.3f}"


# The evaluations' names in the report's tables.
NAMES = {
    "before": "before SFT",
    "sft": "after SFT",
    "rl": "after RL (GRPO)",
    "before-faults": "before SFT, faulted tasks",
    "sft-faults": "after SFT, faulted tasks",
    "rl-faults": "after RL (GRPO), faulted tasks",
    "sft-reworded": "after SFT, reworded tasks",
    "rl-reworded": "after RL (GRPO), reworded tasks",
}


def render_markdown(report: dict[str, Any]) -> str:
    lines = [*_evaluations(report), *_gains(report), *_steps(report)]
    return "\n".join(lines)


def _evaluations(report: dict[str, Any]) -> list[str]:
    """What was run, and the table of every evaluation."""
    cfg = report["config"]
    n = cfg["eval_n"]
    harness = report.get("harness", "react")
    inside = "the built-in ReAct harness" if harness == "react" else f"the {harness} agent CLI"
    lines = [
        f"# OpenForgeRL demo: {report['suite']} inside {harness}",
        "",
        f"{_student(cfg)}, SFT on {report['sft']['samples']} trajectories of the "
        f"rule-based ORACLE teacher, then {len(report['rl_steps'])} GRPO steps "
        f"({cfg['rl_batch_tasks']} tasks x {cfg['rl_group']} rollouts per step), all through "
        f"{inside} ({report.get('harness_version', '')}) in local sandboxes and the recording gateway.",
        "",
        f"GRPO trains on {report.get('train_suite', '')}. The held-out tasks are never trained on; "
        "*reworded* are tools-tiny-reworded's: the same skills asked in other words, never trained or "
        "tuned on. "
        + (
            "tools-tiny-faults' tasks carry one transient fault about half the time (the first read of "
            "one input file fails; the next succeeds); *recovered* is the share of the rollouts that met "
            f"an error and then read that file. The teacher: {report.get('teacher', '')}."
            if cfg.get("faults")
            else ""
        ),
        "",
        f"Held-out tasks, {n} sampled runs each at temperature {cfg['temperature']:g} (the RL rollouts' "
        f"temperature), seeded with {cfg['seed']} for every model: each model meets the same random "
        "numbers, so a rerun repeats its figures and the differences are the models'. 95% bootstrap "
        "intervals over tasks; infra failures: rollouts the infrastructure failed past their retries, "
        "in no figure.",
        "",
        f"| model | pass@1 | pass^{n} | mean reward | rollouts | greedy pass@1 (1 run per task) | "
        "met an error | recovered | infra failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, ev in report["evaluations"].items():
        acted = ev.get("behaviour") or {}
        recovered = acted.get("recovery_rate")
        lines.append(
            f"| {NAMES.get(key, key)} | {_fmt(ev['pass@1'])} | {_fmt(ev[f'pass^{n}'])} | "
            f"{_fmt(ev['mean_reward'])} | {ev['rollouts']} | {_fmt(ev.get('greedy pass@1'))} | "
            f"{acted.get('rollouts_with_errors', '—')} | {'—' if recovered is None else f'{recovered:.0%}'} "
            f"| {ev.get('infra_failed', 0)} |"
        )
    return lines


def _gains(report: dict[str, Any]) -> list[str]:
    """RL's gains over SFT, the SFT policy's headroom, and pass@1 per task family."""
    lines: list[str] = []
    evs = report["evaluations"]
    for key, condition in (
        ("rl_minus_sft", "the held-out tasks"),
        ("rl_minus_sft_reworded", "the reworded held-out tasks"),
        ("rl_minus_sft_faults", "the faulted held-out tasks"),
    ):
        for metric, gain in (report.get(key) or {}).items():
            if gain:
                lines += [
                    "",
                    f"RL over SFT, {metric} on {condition}: {gain['estimate'] * 100:+.1f} points "
                    f"(paired by task, 95% interval {gain['low'] * 100:+.1f} to {gain['high'] * 100:+.1f}).",
                ]
    headroom = report.get("headroom")
    if headroom:
        lines += ["", f"The SFT policy before RL (train tasks, rl/headroom.json): {_headroom_line(headroom)}"]
    families = sorted({f for ev in evs.values() for f in ev.get("by_family", {})})
    # The header counts the first evaluation's tasks (the held-out split); another task set (the
    # reworded one) has other counts, given in its cells.
    first: dict[str, Any] = next((ev["by_family"] for ev in evs.values() if ev.get("by_family")), {})
    if families:
        lines += [
            "",
            "Held-out pass@1 per task family (its number of tasks in brackets):",
            "",
            "| model | " + " | ".join(f"{f} ({first.get(f, {}).get('tasks', 0)})" for f in families) + " |",
            "|---|" + "---:|" * len(families),
        ]
        for key, ev in evs.items():
            shown = [_family_cell(ev.get("by_family", {}).get(f), first.get(f)) for f in families]
            lines.append(f"| {NAMES.get(key, key)} | " + " | ".join(shown) + " |")
    return lines


def _family_cell(family: dict[str, Any] | None, header: dict[str, Any] | None) -> str:
    if not family or family.get("pass@1") is None:
        return "—"
    cell = f"{family['pass@1']:.2f}"
    return cell if header and family["tasks"] == header["tasks"] else f"{cell} ({family['tasks']})"


def _steps(report: dict[str, Any]) -> list[str]:
    """The reward curve, the GRPO steps, SFT's losses, the throughput and the timings."""
    lines = [
        "",
        "![reward curve](reward_curve.png)",
        "",
        "| GRPO step | mean reward | pass rate | groups dropped (equal rewards) | entropy | "
        "update in the advantages' direction | loss |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rl_steps"]:
        lines.append(
            f"| {r['step']} | {r.get('reward_mean') or 0:.3f} | {r.get('pass_rate') or 0:.3f} | "
            f"{r.get('groups_dropped_zero_variance') or 0} | {_num(r.get('entropy'))} | "
            f"{_num(r.get('update/direction_agreement'), '.0%')} | {_num(r.get('loss'))} |"
        )
    tps = report["trainer_tokens_per_s"]
    lines += [
        "",
        f"SFT loss per teacher token {_loss(report['sft'], 'loss')}, held-out teacher trajectories "
        f"(never trained on) {_loss(report['sft'], 'val_loss')}; "
        f"trainer throughput (median tokens/s): SFT {tps['sft_median']}, RL {tps['rl_median']}.",
        "",
        "| phase | seconds |",
        "|---|---:|",
        *(f"| {k} | {v:.0f} |" for k, v in report["seconds"].items()),
        f"| total | {report['total_seconds']:.0f} |",
        "",
    ]
    return lines


def _student(cfg: dict[str, Any]) -> str:
    if cfg.get("pretrained"):
        return f"The pretrained {cfg['pretrained']}"
    return f"A {cfg['size']} model made locally"
