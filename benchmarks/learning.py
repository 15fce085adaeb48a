"""Learning: the demo pipeline (`openforgerl.demo`) over several seeds, with the baselines RL must beat.

For each seed: a fresh model, oracle SFT, the SFT policy's headroom on train tasks, GRPO, and
held-out evaluations (before SFT, after SFT, after RL; sampled n runs per task at the demo's
temperature, and greedy), on tools-tiny's held-out tasks and on tools-tiny-reworded (the same skills
asked in other words, never trained or tuned on). Beside RL, two baselines spend what RL spent
(`openforgerl.rl.baselines`), each evaluated on the same held-out tasks with the same seed:

- `sft-more`: SFT continued from the SFT model on the teacher's data, for as many trained tokens as
  RL's trainer went through, at a constant `--baseline-lr`;
- `rft`: rejection-sampling fine-tuning: the SFT model's own rollouts on train tasks, as many as RL
  made (steps x tasks x G, first generation batch), the passed ones kept, SFT on them for the same
  tokens at the same rate.

Every difference is paired by task within a seed, with its 95% bootstrap interval over tasks; the
summary gives mean ± 95% CI over seeds (Student t). Issue #33's goal: RL − SFT held-out pass@1 >= +10
points with every seed's interval above 0, greedy not lower.

    .venv/bin/python benchmarks/learning.py [--seeds 0 1 2] [--recipe quick|smollm2] [--faults]
                                            [--no-baselines] [--set KEY=VALUE ...] [--start-from RUN]
                                            [--out benchmarks/results/learning.json]

`--start-from RUN` copies RUN's model, teacher data, SFT model and their evaluations into the (new)
seed folder, so only RL and its evaluations run: RL recipes compared from one SFT model.

`--set` overrides a DemoConfig field (`--set rl_lr=1e-4 --set temperature=1.0`). Each seed's run
folder (default benchmarks/results/learning-runs/seed-N) is kept: a rerun continues unfinished
seeds and phases instead of starting over. Prints JSON and Markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from openforgerl import demo
from openforgerl.settings import read, settings_of

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
BASELINES = ("sft-more", "rft")


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and the half-width of its 95% Student-t interval (0 with one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": m, "ci95": 0.0, "n": len(values)}
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return {"mean": m, "ci95": half, "n": len(values)}


def config(seed: int, root: Path, recipe: str | None, faults: bool, sets: list[str]) -> demo.DemoConfig:
    """The demo's settings for one seed: the defaults, `recipe`'s (demo.RECIPES), then each --set."""
    fields = {s.key: s for s in settings_of(demo.DemoConfig)}
    given: dict[str, Any] = {"out": root / f"seed-{seed}", "seed": seed, "progress": False, "faults": faults}
    for item in sets:
        key, _, value = item.partition("=")
        if key not in fields or key in {"out", "seed"}:
            raise SystemExit(f"--set {item}: not a DemoConfig setting ({', '.join(sorted(fields))})")
        try:
            given[key] = read(fields[key].kind, value, key)
        except ValueError as exc:
            raise SystemExit(f"--set {item}: {exc}") from exc
    return demo.demo_config(recipe, given)


def _pass1(report: dict[str, Any], greedy: bool = False) -> float | None:
    summary = report.get("summary")
    return summary["pass@k"]["1"]["estimate"] if summary else None


def _rft_data(cfg: demo.DemoConfig, sft_dir: Path, out: Path) -> Any:
    """The SFT model's own rollouts on train tasks, as many as RL made, the passed ones kept."""
    from openforgerl.rl.baselines import rejection_sampling_data

    return rejection_sampling_data(
        sft_dir,
        out / "baselines" / "rft-data",
        tasks=cfg.rl_suite,  # RL's tasks, in RL's wordings: the same rollout budget on the same draw
        n_tasks=cfg.rl_steps * cfg.rl_batch_tasks,
        group=cfg.rl_group,
        temperature=cfg.temperature,
        seed=cfg.seed,
        max_tokens=cfg.max_tokens,
        max_turns=cfg.max_turns,
        concurrency=cfg.concurrency,
        progress=False,
        harness=cfg.harness,
        engine=cfg.engine,
    )


def baselines(
    cfg: demo.DemoConfig,
    lr: float,
    seconds: dict[str, float],
    names: tuple[str, ...] = BASELINES,
) -> dict[str, Any]:
    """The baselines `names` (sft-more, rft) from the seed's SFT model, evaluated like the demo's
    models; for the others, only what an earlier run of them left in the run folder."""
    from openforgerl.rl.baselines import continue_sft, matched_sft_steps, rl_trained_tokens
    from openforgerl.rl.sft import load_sft_data

    out, sft_dir = cfg.out, cfg.out / "sft"
    tokens = rl_trained_tokens(out / "rl")
    teacher = list(load_sft_data(out / "teacher" / "samples.jsonl", sft_dir))
    data: dict[str, list[Any]] = {"sft-more": teacher}
    rft_summary = out / "baselines" / "rft-data" / "summary.json"
    ran = [n for n in BASELINES if (out / "baselines" / n / "baseline_summary.json").exists()]
    if not names and not ran:
        return {"rl_trained_tokens": tokens, "not run": list(BASELINES)}
    # Each phase's wall time is kept beside its output, so a rerun that skips the phase reports it.
    timings_file = out / "baselines" / "timings.json"
    timed: dict[str, float] = json.loads(timings_file.read_text()) if timings_file.exists() else {}

    def took(phase: str, t0: float) -> None:
        timed[phase] = round(time.monotonic() - t0, 1)
        timings_file.parent.mkdir(parents=True, exist_ok=True)
        timings_file.write_text(json.dumps(timed, indent=2))

    result: dict[str, Any] = {"rl_trained_tokens": tokens}
    if "rft" in names or rft_summary.exists():
        fresh, t0 = not rft_summary.exists(), time.monotonic()
        rft = _rft_data(cfg, sft_dir, out)
        if fresh:
            took("rft-rollouts", t0)
        data["rft"] = list(rft)
        result["rft_data"] = rft.summary()
    for name in BASELINES:
        model = out / "baselines" / name
        summary_file = model / "baseline_summary.json"
        if name not in names and not summary_file.exists():
            continue
        if not summary_file.exists():
            if not data.get(name):  # RFT kept nothing: the SFT model is its own result
                result[name] = {"skipped": "no passed rollout to train on"}
                continue
            t0 = time.monotonic()
            steps = matched_sft_steps(data[name], tokens, cfg.sft_batch)
            summary = continue_sft(
                sft_dir,
                data[name],
                model,
                steps=steps,
                lr=lr,
                batch_size=cfg.sft_batch,
                seed=cfg.seed,
                progress=False,
            )
            summary_file.write_text(json.dumps(summary, indent=2))
            took(f"baseline-{name}", t0)
        summary = json.loads(summary_file.read_text())
        evals = {}
        # Also on the reworded set where the demo evaluates it: RL trained on varied wording may
        # beat there a baseline that beats it on tools-tiny's sentences.
        runs = [(name, False, demo.SUITE), (f"{name}-greedy", True, demo.SUITE)]
        ours = ["sft", "sft-greedy", "rl", "rl-greedy"]
        if cfg.reworded_eval:
            runs.append((f"{name}-reworded", False, demo.REWORDED_SUITE))
            ours.append("rl-reworded")
        for key, greedy, suite in runs:
            report_file = out / "eval" / key / "report.json"
            if not report_file.exists():
                t0 = time.monotonic()
                demo.evaluate_model(cfg, model, key, greedy, suite)
                took(f"eval-{key}", t0)
            evals[key] = json.loads(report_file.read_text())
        all_evals = {**evals, **{k: _read_eval(out, k) for k in ours}}
        result[name] = {
            "steps": summary["steps"],
            "trained_tokens": summary["trained_tokens"],
            "pass@1": _pass1(evals[name]),
            "greedy pass@1": _pass1(evals[f"{name}-greedy"]),
            "minus_sft": {
                "pass@1": demo._paired_gain(all_evals, "sft", name),
                "greedy pass@1": demo._paired_gain(all_evals, "sft-greedy", f"{name}-greedy"),
            },
            "rl_minus_it": {
                "pass@1": demo._paired_gain(all_evals, name, "rl"),
                "greedy pass@1": demo._paired_gain(all_evals, f"{name}-greedy", "rl-greedy"),
            },
        }
        if cfg.reworded_eval:
            result[name]["reworded pass@1"] = _pass1(evals[f"{name}-reworded"])
            result[name]["rl_minus_it"]["reworded pass@1"] = demo._paired_gain(
                all_evals, f"{name}-reworded", "rl-reworded"
            )
    seconds.update(timed)
    return result


# What a run folder holds up to the SFT model's evaluations: a copy starts its RL phase from there.
SFT_PHASES = ("model", "teacher", "sft", "eval/before", "eval/sft", "eval/sft-greedy", "eval/sft-reworded")


def start_from(run: Path, out: Path) -> None:
    """Copy `run`'s phases up to the SFT model's evaluations (and their timings) into the new `out`;
    the demo then skips them and runs RL and its evaluations alone."""
    import shutil

    if not (run / "sft" / "sft_summary.json").exists():
        raise SystemExit(f"--start-from {run}: no SFT model there (sft/sft_summary.json)")
    out.mkdir(parents=True)
    for part in SFT_PHASES:
        if (run / part).is_dir():
            shutil.copytree(run / part, out / part)
    timings = json.loads((run / "timings.json").read_text()) if (run / "timings.json").exists() else {}
    kept = {k: v for k, v in timings.items() if not k.startswith(("rl", "eval-rl", "report"))}
    (out / "timings.json").write_text(json.dumps(kept, indent=2))


def _read_eval(out: Path, key: str) -> dict[str, Any]:
    path = out / "eval" / key / "report.json"
    return json.loads(path.read_text()) if path.exists() else {}


def one_seed(cfg: demo.DemoConfig, with_baselines: tuple[str, ...], baseline_lr: float) -> dict[str, Any]:
    report = demo.run(cfg)
    ev = report["evaluations"]
    seconds = dict(report["seconds"])
    row: dict[str, Any] = {
        "seed": cfg.seed,
        "pass@1": {k: v["pass@1"]["estimate"] if v["pass@1"] else None for k, v in ev.items()},
        "greedy_pass@1": {
            k: v["greedy pass@1"]["estimate"] if v.get("greedy pass@1") else None for k, v in ev.items()
        },
        # Paired by task within this seed, each with its bootstrap interval over tasks.
        "rl_minus_sft": report["rl_minus_sft"],
        "rl_minus_sft_reworded": report["rl_minus_sft_reworded"],
        "rl_minus_sft_faults": report.get("rl_minus_sft_faults"),
        "sft_minus_before": report["sft_minus_before"],
        "headroom": report.get("headroom"),
        "behaviour": {k: v.get("behaviour") for k, v in ev.items()},
        "rl_steps": report["rl_steps"],
        "config": {k: getattr(cfg, k) for k in sorted(MEASUREMENT_ONLY)},
    }
    if with_baselines or (cfg.out / "baselines").is_dir():  # without them, what an earlier run measured
        row["baselines"] = baselines(cfg, baseline_lr, seconds, names=with_baselines)
    row["seconds"] = seconds
    row["total_seconds"] = round(sum(seconds.values()), 1)
    row["trainer_tokens_per_s"] = report["trainer_tokens_per_s"]
    return row


def _est(g: dict[str, Any] | None) -> float | None:
    return g["estimate"] if g else None


def summarize(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}

    def add(key: str, values: list[float | None]) -> None:
        kept = [v for v in values if v is not None]
        summary[key] = mean_ci(kept) if kept else None

    for metric in ("pass@1", "greedy_pass@1"):
        for stage in sorted({k for s in seeds for k in s[metric]}):
            add(f"{metric}/{stage}", [s[metric].get(stage) for s in seeds])
    for key in ("rl_minus_sft", "rl_minus_sft_reworded", "rl_minus_sft_faults", "sft_minus_before"):
        for metric in ("pass@1", "greedy pass@1"):
            add(f"{key}/{metric}", [_est((s.get(key) or {}).get(metric)) for s in seeds])
    for name in BASELINES:
        for metric in ("pass@1", "greedy pass@1"):
            got = [s.get("baselines", {}).get(name, {}) for s in seeds]
            add(f"{name}/{metric}", [g.get(metric) for g in got])
            add(f"rl_minus_{name}/{metric}", [_est(g.get("rl_minus_it", {}).get(metric)) for g in got])
    phases = sorted({p for s in seeds for p in s["seconds"]})
    # Over the seeds that ran the phase (an earlier result may lack one, e.g. its baselines).
    summary["seconds_median"] = {
        p: statistics.median([s["seconds"][p] for s in seeds if p in s["seconds"]]) for p in phases
    }
    summary["total_seconds_median"] = statistics.median([s["total_seconds"] for s in seeds])
    return summary


def _paired(g: dict[str, float] | None) -> str:
    return f"{g['estimate'] * 100:+.1f} ({g['low'] * 100:+.1f} to {g['high'] * 100:+.1f})" if g else "—"


def _ci(v: dict[str, float] | None, points: bool = False) -> str:
    if not v:
        return "—"
    return (
        f"{v['mean'] * 100:+.1f} ± {v['ci95'] * 100:.1f}" if points else f"{v['mean']:.3f} ± {v['ci95']:.3f}"
    )


def markdown(seeds: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| model | held-out pass@1 (mean ± 95% CI over seeds) | greedy pass@1 |",
        "|---|---:|---:|",
    ]
    for stage in ("before", "sft", *BASELINES, "rl", "sft-reworded", "rl-reworded"):
        # The demo's models are keyed "pass@1/sft", the baselines "sft-more/pass@1".
        cells = [
            summary.get(f"{m}/{stage}") or summary.get(f"{stage}/{m.replace('_', ' ')}")
            for m in ("pass@1", "greedy_pass@1")
        ]
        if any(cells):
            lines.append(f"| {stage} | {_ci(cells[0])} | {_ci(cells[1])} |")
    lines += ["", "| difference, points | pass@1 | greedy pass@1 |", "|---|---:|---:|"]
    for key in ("rl_minus_sft", "rl_minus_sft_reworded", *(f"rl_minus_{b}" for b in BASELINES)):
        cells = [summary.get(f"{key}/{m}") for m in ("pass@1", "greedy pass@1")]
        if any(cells):
            lines.append(f"| {key.replace('_', ' ')} | {_ci(cells[0], True)} | {_ci(cells[1], True)} |")
    lines += [
        "",
        "| seed | RL − SFT pass@1, paired (95% interval) | greedy | reworded | RL − sft-more | RL − rft "
        "| headroom: pass@1 / pass@k / mixed |",
        "|---:|---|---|---|---|---|---|",
    ]
    for s in seeds:
        b = s.get("baselines", {})
        h = s.get("headroom") or {}
        head = f"{h['pass_at_1']:.2f} / {h['pass_at_k']:.2f} / {h['mixed_fraction']:.2f}" if h else "—"
        lines.append(
            f"| {s['seed']} | {_paired(s['rl_minus_sft']['pass@1'])} | "
            f"{_paired(s['rl_minus_sft']['greedy pass@1'])} | "
            f"{_paired(s['rl_minus_sft_reworded']['pass@1'])} | "
            f"{_paired(b.get('sft-more', {}).get('rl_minus_it', {}).get('pass@1'))} | "
            f"{_paired(b.get('rft', {}).get('rl_minus_it', {}).get('pass@1'))} | {head} |"
        )
    return "\n".join(lines)


# Settings that change what is measured or how fast, not the recipe: seeds measured with other
# values of these may be pooled (each seed's row keeps its own, under "config").
MEASUREMENT_ONLY = {"engine", "concurrency", "timeout_multiplier", "reworded_eval", "greedy_eval"}


def earlier_seeds(files: list[Path], settings: dict[str, Any], here: set[int]) -> list[dict[str, Any]]:
    """The seeds of earlier results (`--with`) not run here, each row marked with its file and the
    measurement settings it ran with; an earlier recipe unlike this run's is refused, naming what differs."""
    rows = []
    for path in files:
        earlier = json.loads(path.read_text())
        theirs = earlier["config"]
        differ = {
            k: (theirs.get(k), v)
            for k, v in settings.items()
            if k not in MEASUREMENT_ONLY and k in theirs and theirs[k] != v
        }
        if differ:
            said = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in sorted(differ.items()))
            raise SystemExit(f"--with {path}: another recipe ({said})")
        for row in earlier["seeds"]:
            if row["seed"] not in here:
                # A setting the earlier run did not record did not exist yet: it ran as its default.
                measured = {k: theirs.get(k, getattr(demo.DemoConfig(), k)) for k in sorted(MEASUREMENT_ONLY)}
                rows.append({**row, "from": str(path), "config": row.get("config", measured)})
                here.add(row["seed"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--quick", action="store_true", help="toy sizes (the pipeline, not learning): --recipe quick"
    )
    ap.add_argument(
        "--recipe", choices=sorted(demo.RECIPES), default=None, help="a named set of DemoConfig settings"
    )
    ap.add_argument("--faults", action="store_true", help="the demo's faulted condition too")
    ap.add_argument("--no-baselines", action="store_true", help="RL alone, without sft-more and rft")
    ap.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help=f"the baselines to run, comma-separated (default: {','.join(BASELINES)})",
    )
    ap.add_argument("--baseline-lr", type=float, default=1e-4, help="the baselines' constant SFT rate")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a DemoConfig field")
    ap.add_argument(
        "--start-from",
        type=Path,
        default=None,
        metavar="RUN",
        help="a run folder whose model, teacher, SFT model and their evaluations the seed's folder "
        "starts from (copied when that folder is new; one seed): RL recipes from one SFT model",
    )
    ap.add_argument(
        "--with",
        dest="earlier",
        type=Path,
        action="append",
        default=[],
        metavar="RESULT",
        help="an earlier result of this benchmark (another session or machine) whose seeds join this "
        "run's in the summary; its recipe must be this run's (a seed run here wins)",
    )
    ap.add_argument("--runs", type=Path, default=Path("benchmarks/results/learning-runs"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/learning.json"))
    args = ap.parse_args()
    if args.start_from and len(args.seeds) != 1:
        raise SystemExit("--start-from gives one SFT model: run one seed (its own)")
    recipe = "quick" if args.quick else args.recipe
    names = () if args.no_baselines else tuple(filter(None, args.baselines.split(",")))
    if set(names) - set(BASELINES):
        raise SystemExit(f"--baselines {args.baselines}: choose among {', '.join(BASELINES)}")
    seeds = []
    for seed in args.seeds:
        cfg = config(seed, args.runs, recipe, args.faults, args.set)
        if args.start_from and not cfg.out.exists():
            start_from(args.start_from, cfg.out)
        seeds.append(one_seed(cfg, names, args.baseline_lr))
        print(f"seed {seed}: RL - SFT pass@1 {_paired(seeds[-1]['rl_minus_sft']['pass@1'])}", flush=True)
    cfg = config(args.seeds[0], args.runs, recipe, args.faults, args.set)
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in {"out", "seed", "progress"}}
    settings = json.loads(json.dumps(settings, default=str))
    seeds += earlier_seeds(args.earlier, settings, {s["seed"] for s in seeds})
    seeds.sort(key=lambda s: s["seed"])
    summary = summarize(seeds)
    result = {
        "config": {
            **settings,
            "recipe": recipe,
            "baselines": list(names),
            "baseline_lr": args.baseline_lr,
        },
        "seeds": seeds,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    json.dump(summary, sys.stdout, indent=2)
    print()
    print(markdown(seeds, summary))


if __name__ == "__main__":
    main()
