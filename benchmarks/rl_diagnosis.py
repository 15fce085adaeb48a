"""Why RL does not beat SFT (issue #33): does GRPO fail to optimise, or fail to transfer?

From one demo run folder (`openforgerl.demo`, RL done), evaluates the SFT model and the RL model on

- `trained`: the train tasks RL drew in its steps (recomputed from its run.json exactly as the loop
  drew them, `rl.runs.step_tasks`), and
- `fresh`: as many other train tasks, never drawn by RL, sampled from the same split with a fixed seed,

each n sampled runs per task at the demo's temperature, seeded with the run's seed (both models meet
the same random numbers), and gives RL − SFT paired by task with its 95% bootstrap interval
(`eval_stats.paired_difference`, as the demo's report). If the trained tasks improve and the fresh
ones do not, RL optimises but does not transfer; if neither improves, it does not optimise.

It also counts what the RL run's trainer did (optimizer updates, sequences and tokens per update,
groups kept) beside what an `rft` baseline of the same run folder did, when there is one.

    PYTHONPATH=src python benchmarks/rl_diagnosis.py --run runs/demo [--rl-model DIR] [--n 4]
        [--out benchmarks/results/rl_diagnosis.json]

`--rl-model` evaluates another RL model (e.g. a variant's) on the same task sets; its evaluations go
under RUN/diagnosis/NAME where NAME is `--name`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from openforgerl.demo import read_metrics


def trained_task_ids(rl_dir: Path) -> list[str]:
    """The distinct tasks an RL run draws over its steps, in the order it draws them (from its
    run.json: the loop draws each step's tasks from the run's seed and the step alone)."""
    from openforgerl.rl.loop import load_options
    from openforgerl.rl.runs import step_tasks, training_tasks

    opts = load_options(rl_dir)
    if opts.max_gen_batches > 1:
        raise SystemExit("dynamic sampling draws more batches than run.json says: not supported here")
    pool = training_tasks(opts)
    seen: dict[str, None] = {}
    for step in range(1, opts.steps + 1):
        for t in step_tasks(pool, step, opts.batch_tasks, opts.seed):
            seen.setdefault(t.id, None)
    return list(seen)


def recorded_task_ids(rl_dir: Path) -> set[str]:
    """The tasks the run's steps actually ran, from their runner states (steps/N/runner.db)."""
    import sqlite3

    found: set[str] = set()
    for db in sorted((rl_dir / "steps").glob("*/runner.db")):
        with sqlite3.connect(db) as con:
            found |= {row[0] for row in con.execute("SELECT task_id FROM rollouts")}
    return found


def step_curve(rl_dir: Path, sft: dict[str, Any], block: int = 5) -> list[dict[str, Any]]:
    """RL's own training rollouts against the SFT model, task by task: at step s the policy (s - 1
    updates, none on most of these tasks) meets the step's tasks, whose pass rate under the SFT
    model the `sft` evaluation measured. Per block of `block` steps: the rollouts' pass rate, the
    SFT model's on the same tasks, and the paired difference with its interval. A policy that
    learns skills rises above the SFT model here as the steps go on; one that fits its tasks does not."""
    import sqlite3

    from openforgerl.eval_stats import paired_difference

    base = per_task(sft)
    rows: dict[int, dict[str, list[float]]] = {}
    for db in sorted((rl_dir / "steps").glob("*/runner.db")):
        step = int(db.parent.name)
        with sqlite3.connect(db) as con:
            for task, reward in con.execute("SELECT task_id, reward FROM rollouts WHERE status = 'done'"):
                if reward is not None:
                    rows.setdefault(step, {}).setdefault(task, []).append(float(reward >= 1.0 - 1e-9))
    out = []
    steps = sorted(rows)
    for first in range(0, len(steps), block):
        chosen = steps[first : first + block]
        # A task drawn in two steps of a block counts once per step: key by (step, task).
        rl = {f"{s}:{t}": sum(v) / len(v) for s in chosen for t, v in rows[s].items() if t in base}
        before = {k: base[k.split(":", 1)[1]] for k in rl}
        gain = paired_difference(before, rl).as_dict()
        out.append(
            {
                "steps": f"{chosen[0]}-{chosen[-1]}",
                "tasks": len(rl),
                "rl_rollouts_pass": sum(rl.values()) / len(rl),
                "sft_pass@1": sum(before.values()) / len(before),
                "rl_minus_sft": gain,
            }
        )
    return out


def by_signal(rl_dir: Path, sft: dict[str, Any], rl: dict[str, Any]) -> dict[str, Any]:
    """The trained tasks split by whether RL had a gradient on them: a group with mixed rewards in
    some step (trained on) or equal rewards every time it was drawn (dropped). RL − SFT paired on
    each part. The split is made on the RL run's own rollouts, so it leans on chance as well as on
    the task: an all-fail group is likelier where the policy had already got worse."""
    import sqlite3

    from openforgerl.eval_stats import paired_difference

    mixed: dict[str, bool] = {}
    for db in sorted((rl_dir / "steps").glob("*/runner.db")):
        groups: dict[str, set[bool]] = {}
        with sqlite3.connect(db) as con:
            for task, reward in con.execute("SELECT task_id, reward FROM rollouts WHERE status = 'done'"):
                if reward is not None:
                    groups.setdefault(task, set()).add(reward >= 1.0 - 1e-9)
        for task, seen in groups.items():
            mixed[task] = mixed.get(task, False) or len(seen) > 1
    a, b = per_task(sft), per_task(rl)
    out = {}
    for name, keep in (("mixed", True), ("equal", False)):
        tasks = [t for t in a if t in b and mixed.get(t) is keep]
        if tasks:
            out[name] = {
                "tasks": len(tasks),
                "sft_pass@1": sum(a[t] for t in tasks) / len(tasks),
                "rl_pass@1": sum(b[t] for t in tasks) / len(tasks),
                "rl_minus_sft": paired_difference(
                    {t: a[t] for t in tasks}, {t: b[t] for t in tasks}
                ).as_dict(),
            }
    return out


def write_task_file(ids: list[str], suite: str, path: Path) -> None:
    from openforgerl.tasks import load_tasks
    from openforgerl.tasks.loader import dump_tasks

    by_id = {t.id: t for t in load_tasks(suite, split="train")}
    path.parent.mkdir(parents=True, exist_ok=True)
    dump_tasks([by_id[i] for i in ids], path)


def evaluate(cfg: Any, model: Path, tasks_file: Path, out: Path, n: int) -> dict[str, Any]:
    from openforgerl.evaluate import EvalOptions, run_eval

    report_file = out / "report.json"
    if report_file.exists():
        return dict(json.loads(report_file.read_text()))
    return run_eval(
        EvalOptions(
            tasks=str(tasks_file),
            harness=cfg.harness,
            split="train",
            model=str(model),
            out=out,
            k=n,
            n=n,
            temperature=cfg.temperature,
            seed=cfg.seed,
            max_tokens=cfg.max_tokens,
            max_turns=cfg.max_turns,
            concurrency=cfg.concurrency,
            progress=False,
        )
    )


def per_task(report: dict[str, Any]) -> dict[str, float]:
    return {t["task_id"]: t["pass@k"]["1"] for t in report["summary"]["per_task"]}


def paired(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    from openforgerl.eval_stats import paired_difference

    a, b = per_task(before), per_task(after)
    common = sorted(set(a) & set(b))
    return paired_difference({t: a[t] for t in common}, {t: b[t] for t in common}).as_dict()


def trainer_work(rl_dir: Path, rft_dir: Path | None) -> dict[str, Any]:
    """What RL's trainer did, and the rft baseline's beside it (from their metrics.jsonl)."""
    rows = [r for r in read_metrics(rl_dir) if r["step"] > 0]
    updates = sum(int(r.get("optimizer_steps", 0)) for r in rows if r.get("updated"))
    rl = {
        "steps": len(rows),
        "steps_with_update": sum(bool(r.get("updated")) for r in rows),
        "optimizer_updates": updates,
        "rollouts_drawn": sum(int(r.get("rollouts", 0)) for r in rows),
        "groups_drawn": sum(int(r.get("groups", 0)) for r in rows),
        "groups_kept": sum(int(r.get("groups_kept", 0)) for r in rows),
        "sequences_trained": sum(int(r.get("samples", 0)) for r in rows),
        "tokens": sum(int(r.get("tokens", 0)) for r in rows),
        "loss_tokens": sum(int(r.get("loss_tokens", 0)) for r in rows),
        "lr_mean": _mean([r for r in rows if r.get("updated")], "lr"),  # each step's: its updates' mean
        "logp_change_pos_per_token": _mean(rows, "update/logp_change_pos_per_token"),
        "logp_change_neg_per_token": _mean(rows, "update/logp_change_neg_per_token"),
        "direction_agreement": _mean(rows, "update/direction_agreement"),
    }
    out: dict[str, Any] = {"rl": rl}
    if rft_dir is not None and (rft_dir / "metrics.jsonl").exists():
        rft_rows = [r for r in read_metrics(rft_dir) if r["step"] > 0]
        summary = json.loads((rft_dir / "baseline_summary.json").read_text())
        out["rft"] = {
            "optimizer_updates": len(rft_rows),
            "sequences_trained": sum(int(r.get("samples", r.get("sequences", 0))) for r in rft_rows),
            "tokens": summary.get("trained_tokens"),
            "lr": summary.get("lr"),
        }
    return out


def _points(g: dict[str, float]) -> str:
    return f"{g['estimate'] * 100:+.1f} ({g['low'] * 100:+.1f} to {g['high'] * 100:+.1f})"


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return sum(vals) / len(vals) if vals else None


def main() -> None:
    from openforgerl.demo import DemoConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a demo run folder with sft/ and rl/")
    ap.add_argument("--rl-model", type=Path, default=None, help="default: the run's RL checkpoint")
    ap.add_argument("--name", default="rl", help="the RL model's name in the diagnosis folder")
    ap.add_argument("--n", type=int, default=4, help="sampled runs per task")
    ap.add_argument("--rl-n", type=int, default=None, help="the RL model's runs per task (default: --n)")
    ap.add_argument("--fresh", type=int, default=None, help="fresh train tasks (default: as many as trained)")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed (the demo's --seed)")
    ap.add_argument("--out", type=Path, default=None, help="the result JSON")
    ap.add_argument(
        "--curve-of",
        type=Path,
        nargs="*",
        default=[],
        metavar="RL_DIR",
        help="other RL run folders from the same SFT model and seed (they draw the same tasks): "
        "their step curves against the SFT model too",
    )
    ap.add_argument("--sft-only", action="store_true", help="evaluate the SFT model alone (RL may still run)")
    args = ap.parse_args()
    run = args.run.resolve()
    cfg = DemoConfig(out=run, seed=args.seed)
    rl_dir = run / "rl"
    summary_file = rl_dir / "rl_summary.json"
    rl_model = args.rl_model or (
        Path(json.loads(summary_file.read_text())["checkpoint"]) if summary_file.exists() else None
    )
    diag = run / "diagnosis"
    trained = trained_task_ids(rl_dir)
    recorded = recorded_task_ids(rl_dir)
    if not recorded <= set(trained):  # the draw recomputed must be what the steps ran
        raise SystemExit(f"the steps ran tasks the recomputed draw lacks: {sorted(recorded - set(trained))}")
    from openforgerl.tasks import load_tasks

    pool = [t.id for t in load_tasks(cfg.rl_suite, split="train") if t.id not in set(trained)]
    fresh = random.Random(f"fresh:{args.seed}").sample(pool, args.fresh or len(trained))
    teacher = {t.id for t in load_tasks(cfg.teacher_suite, split="train")[: cfg.teacher_tasks]}
    result: dict[str, Any] = {
        "run": str(run),
        "rl_model": str(rl_model),
        "n": {"sft": args.n, args.name: args.rl_n or args.n},
        "sets": {},
    }
    for name, ids in (("trained", trained), ("fresh", fresh)):
        tasks_file = diag / f"{name}.jsonl"
        if not tasks_file.exists():
            write_task_file(ids, cfg.rl_suite, tasks_file)
        sft = evaluate(cfg, run / "sft", tasks_file, diag / f"sft-{name}", args.n)
        if args.sft_only:
            print(
                f"{name}: {len(ids)} tasks, SFT {sft['summary']['pass@k']['1']['estimate']:.3f}", flush=True
            )
            continue
        if rl_model is None:
            raise SystemExit(f"{rl_dir}: RL has not finished (no rl_summary.json); --sft-only or --rl-model")
        rl = evaluate(cfg, rl_model, tasks_file, diag / f"{args.name}-{name}", args.rl_n or args.n)
        gain = paired(sft, rl)
        result["sets"][name] = {
            "tasks": len(ids),
            "in_teacher_sft_data": sum(i in teacher for i in ids),
            "sft_pass@1": sft["summary"]["pass@k"]["1"]["estimate"],
            "rl_pass@1": rl["summary"]["pass@k"]["1"]["estimate"],
            "rl_minus_sft": gain,
        }
        if name == "trained":
            result["sets"][name]["by_signal"] = split = by_signal(rl_dir, sft, rl)
            for part, row in split.items():
                print(
                    f"  {part} groups: {row['tasks']} tasks, SFT {row['sft_pass@1']:.3f} -> RL "
                    f"{row['rl_pass@1']:.3f}, paired {_points(row['rl_minus_sft'])}"
                )
        print(
            f"{name}: {len(ids)} tasks, SFT {result['sets'][name]['sft_pass@1']:.3f} -> RL "
            f"{result['sets'][name]['rl_pass@1']:.3f}, paired {_points(gain)}",
            flush=True,
        )
    if args.sft_only:
        return
    sft_trained = json.loads((diag / "sft-trained" / "report.json").read_text())
    result["step_curve"] = {}
    for rl_run in [rl_dir, *args.curve_of]:
        result["step_curve"][str(rl_run)] = curve = step_curve(rl_run, sft_trained)
        for row in curve:
            g = row["rl_minus_sft"]
            print(
                f"{rl_run} steps {row['steps']}: rollouts {row['rl_rollouts_pass']:.3f} vs SFT "
                f"{row['sft_pass@1']:.3f}: {_points(g)}"
            )
    rft = run / "baselines" / "rft"
    result["trainer_work"] = trainer_work(rl_dir, rft if rft.is_dir() else None)
    print(json.dumps(result["trainer_work"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
