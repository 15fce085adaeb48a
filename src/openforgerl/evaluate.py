"""`openforge eval` and `openforge rollout`: run tasks through a harness, score them, report.

On one machine the gateway is embedded (a background thread serving the model directory with the
built-in engine, and the `--upstream` models, e.g. an LLM judge); with `--gateway URL` the rollouts
go to a running gateway instead. Sandboxes reach only the gateway unless `--network host` lets them
use the host's network, which tasks on live web sites (WebVoyager, Online-Mind2Web) need.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from openforgerl import behaviour as acting
from openforgerl.engines.base import Engine
from openforgerl.eval_options import EvalOptions as EvalOptions
from openforgerl.eval_stats import by_tag, summarize
from openforgerl.harnesses.launch import HarnessChoice, LaunchOptions
from openforgerl.rollouts.results import RolloutResult, Status
from openforgerl.rollouts.service import RolloutJob, RolloutService
from openforgerl.rollouts.trajectory import token_stats
from openforgerl.run.folder import RunFolder
from openforgerl.run.stack import serving
from openforgerl.tasks import Task, load_tasks


@contextlib.contextmanager
def _service(opts: EvalOptions, engine: Engine | None, run_id: str) -> Iterator[RolloutService]:
    """The run's rollouts: on a running gateway (`opts.gateway`), or on one embedded for the run;
    in sandboxes of `opts.backend`."""
    if opts.gateway:
        if opts.upstreams:
            raise ValueError(
                "--upstream configures the embedded gateway; a running gateway (--gateway) serves its "
                "own upstreams (openforge gateway --upstream ...)"
            )
        yield RolloutService(opts.gateway, opts.admin_token, opts.backend.make(run_id))
        return
    if not opts.model:
        raise ValueError("give --model DIR (served by an embedded gateway) or --gateway URL")
    with serving(
        opts.model,
        RunFolder(opts.out).gateway_store,
        engine=engine or opts.engine,
        backend=opts.backend,
        run_id=run_id,
        max_tokens=opts.max_tokens,
        temperature=opts.temperature,
        upstreams=list(opts.upstreams),
        engine_threads=opts.engine_threads or max(1, (os.cpu_count() or 2) // 2),
    ) as stack:
        yield stack.service


def _select(opts: EvalOptions) -> list[Task]:
    tasks = load_tasks(opts.tasks, split=opts.split)  # type: ignore[arg-type]
    return tasks[: opts.limit] if opts.limit else tasks


def run_rollouts(
    opts: EvalOptions, engine: Engine | None = None, tasks: list[Task] | None = None
) -> list[RolloutResult]:
    """Run every selected task (`tasks`, when the caller has them already) n times: one result per
    rollout, with what the gateway recorded (rollouts/service.py)."""
    tasks = _select(opts) if tasks is None else tasks
    job = RolloutJob(
        harness_choice(opts),
        run_id=opts.run_id or opts.out.name,
        state_path=RunFolder(opts.out).runner_state,
        concurrency=opts.concurrency,
        on_failure=opts.on_failure,
        timeout_multiplier=opts.timeout_multiplier,
        seed=opts.seed,
        network=opts.network,
    )
    job.check(tasks, opts.backend.name)  # before the gateway loads a model
    opts.out.mkdir(parents=True, exist_ok=True)
    with _service(opts, engine, job.run_id) as service:
        return service.run(tasks, opts.n or opts.k, job, progress=opts.progress)


def harness_choice(opts: EvalOptions) -> HarnessChoice:
    """The run's harnesses (harnesses/launch.py): `opts.harness` for tasks that name none of their own."""
    launch = LaunchOptions(max_turns=opts.max_turns, max_tokens=opts.max_tokens, max_steps=opts.max_steps)
    return HarnessChoice(opts.harness, launch)


def run_eval(opts: EvalOptions, engine: Engine | None = None) -> dict[str, Any]:
    """pass@k, pass^k and mean reward (95% CI) over n >= k runs per task; writes report.json/.md,
    and status.json as it runs (openforgerl.run_status)."""
    with RunFolder(opts.out).recording("eval", tasks=opts.tasks, harness=opts.harness):
        return _run_eval(opts, engine)


def _run_eval(opts: EvalOptions, engine: Engine | None) -> dict[str, Any]:
    t0 = time.monotonic()
    tasks = _select(opts)
    results = run_rollouts(opts, engine, tasks)
    scored = [r for r in results if r.status == Status.DONE and r.reward is not None]
    runs: dict[str, list[float]] = collections.defaultdict(list)
    for r in scored:
        runs[r.task_id].append(float(r.reward or 0.0))
    k = opts.k
    complete = {t: v for t, v in runs.items() if len(v) >= k}
    summary = summarize(complete, ks=tuple(range(1, k + 1))) if complete else None
    calls = [c for r in results for c in r.calls or ()]
    stats = token_stats(calls) if calls else None
    choice = harness_choice(opts)
    report: dict[str, Any] = {
        "tasks": opts.tasks,
        "harness": opts.harness,
        "harness_versions": {name: choice.version(name) for name in choice.names(tasks)},
        "network": opts.network,
        "k": k,
        "n": opts.n or k,
        "temperature": opts.temperature,
        "seed": opts.seed,
        "rollouts": len(results),
        "scored": len(scored),
        "on_failure": opts.on_failure,
        # Beside every pass@k: what it leaves out (infrastructure, after its retries) and the
        # agent's failures it counts (the reward's contract, docs/architecture.md).
        **failure_counts(results),
        "infra_errors": infra_errors(results),
        "outcomes": dict(collections.Counter(r.outcome or r.status.value for r in results)),
        "status": dict(collections.Counter(r.status.value for r in results)),
        "tasks_without_k_scored_runs": sorted(set(r.task_id for r in results) - set(complete)),
        "summary": summary.to_dict() if summary else None,
        "by_tag": by_tag(summary, {t.id: t.tags for t in tasks}) if summary else {},
        # Each task's tags (its family...): the viewer pairs two evaluations per tag with them.
        "task_tags": {t.id: list(t.tags) for t in tasks},
        "tokens": {
            "prompt": sum(len(c.prompt_ids) for c in calls),
            "completion": sum(len(c.completion_ids) for c in calls),
            "training": stats.as_dict() if stats else None,
        },
        "behaviour": behaviour(results),
        # Tool errors met, recoveries, give-ups, self-verification (openforgerl.behaviour).
        "acting": acting_summary(results, tasks),
        "seconds": round(time.monotonic() - t0, 1),
        "seconds_per_rollout_median": round(
            statistics.median([r.seconds.get("total", 0.0) for r in results] or [0.0]), 2
        ),
    }
    run = RunFolder(opts.out)
    run.path.mkdir(parents=True, exist_ok=True)
    run.report.write_text(json.dumps(report, indent=2))
    run.report_md.write_text(_markdown(report, summary.to_markdown() if summary else ""))
    return report


def failure_counts(results: list[RolloutResult]) -> dict[str, int]:
    """Rollouts the infrastructure failed past their retries (in no figure), and those stopped by
    the task's wall clock or whose verifier failed on what the agent left (scored as failures)."""
    return {
        "infra_failed": sum(r.status == Status.INFRA_FAILED for r in results),
        "timed_out": sum(r.outcome == "timeout" for r in results),
        "verifier_errors": sum(r.outcome == "verifier_error" for r in results),
    }


def infra_errors(results: list[RolloutResult]) -> dict[str, str]:
    """Why the infrastructure failed each task it failed (its last error): e.g. an image that could be
    neither found nor built, named with its task."""
    return {
        r.task_id: str((r.details.get("infra_errors") or ["?"])[-1])[:800]
        for r in results
        if r.status == Status.INFRA_FAILED
    }


def failures_line(report: dict[str, Any]) -> str:
    """The counts of `failure_counts` in words, for a summary beside its pass@k."""
    return (
        f"infrastructure failures: {report['infra_failed']} (retried, then in no figure); timed out: "
        f"{report['timed_out']} (scored by on_failure {report['on_failure']}); verifier errors on "
        f"the agent's state: {report['verifier_errors']} (scored 0)"
    )


def acting_summary(results: list[RolloutResult], tasks: list[Task]) -> dict[str, Any]:
    """The rollouts' behaviour metrics (the runner read them from each recorded conversation),
    over all rollouts and per task tag (family, `faulted`)."""
    rows = [(r.task_id, r.details["behaviour"]) for r in results if r.details.get("behaviour")]
    tags = {t.id: t.tags for t in tasks}
    by: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for task_id, row in rows:
        for tag in tags.get(task_id, []):
            by[tag].append(row)
    return {
        "all": acting.aggregate(row for _, row in rows),
        "by_tag": {tag: acting.aggregate(v) for tag, v in sorted(by.items())},
    }


def behaviour(results: list[RolloutResult]) -> dict[str, float]:
    """How the policy acted inside its harness, per rollout (medians and means over those recorded):
    model calls of the main conversation (turns), side requests, branches, tokens."""
    per: list[dict[str, float]] = []
    for r in results:
        if r.calls is None:
            continue
        calls = r.calls
        main = [c for c in calls if not c.side_request]
        per.append(
            {
                "turns": len(main),
                "side_requests": len(calls) - len(main),
                "branches": len({c.branch_id for c in main}),
                "prompt_tokens": sum(len(c.prompt_ids) for c in calls),
                "completion_tokens": sum(len(c.completion_ids) for c in calls),
            }
        )
    if not per:
        return {}
    out: dict[str, float] = {"rollouts": len(per)}
    for key in per[0]:
        values = [p[key] for p in per]
        out[f"{key}_median"] = float(statistics.median(values))
        out[f"{key}_mean"] = round(statistics.fmean(values), 2)
    return out


def run_study(opts: EvalOptions, harnesses: list[str], engine: Engine | None = None) -> dict[str, Any]:
    """The harness study: one checkpoint evaluated under each of `harnesses` on the same tasks (and
    seeds), each into `out/NAME/`, then one side-by-side report (`out/study.json`, `out/study.md`)."""
    if len(set(harnesses)) != len(harnesses):
        raise ValueError(f"a harness is named twice in {','.join(harnesses)}")
    tasks = _select(opts)
    for name in harnesses:  # every CLI is checked before the first evaluation starts
        harness_choice(dataclasses.replace(opts, harness=name)).check(tasks)
    reports = {}
    with RunFolder(opts.out).recording("study", tasks=opts.tasks) as record:
        for name in harnesses:
            one = dataclasses.replace(
                opts, harness=name, out=opts.out / name, run_id=f"{opts.run_id or opts.out.name}-{name}"
            )
            with record.phase(name, name):
                reports[name] = run_eval(one, engine)
    study = {"tasks": opts.tasks, "k": opts.k, "n": opts.n or opts.k, "seed": opts.seed, "harnesses": reports}
    run = RunFolder(opts.out)
    run.path.mkdir(parents=True, exist_ok=True)
    run.study.write_text(json.dumps(study, indent=2))
    run.study_md.write_text(study_markdown(study))
    return study


def _interval(v: dict[str, float] | None) -> str:
    return f"{v['estimate']:.3f} [{v['low']:.3f}, {v['high']:.3f}]" if v else "-"


def study_markdown(study: dict[str, Any]) -> str:
    k = study["k"]
    lines = [
        f"# Harness study: {study['tasks']}, n = {study['n']} runs per task, seed {study['seed']}",
        "",
        f"| harness | version | pass@1 (95% CI) | pass^{k} | mean reward | infra failures | turns"
        " | side requests | branches | tokens per rollout | training tokens merged / per call"
        " | s per rollout | outcomes |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in study["harnesses"].items():
        summary, b = r["summary"] or {}, r["behaviour"] or {}
        training = r["tokens"]["training"] or {}
        tokens = b.get("prompt_tokens_mean", 0) + b.get("completion_tokens_mean", 0)
        merged = (
            f"{training['tokens_merged']} / {training['tokens_per_call']} ({training['ratio']:.2f})"
            if training
            else "-"
        )
        outcomes = ", ".join(f"{o}: {c}" for o, c in sorted(r["outcomes"].items()))
        scores = [
            _interval(summary.get("pass@k", {}).get("1")),
            _interval(summary.get("pass^k", {}).get(str(k))),
            _interval(summary.get("mean_reward")),
        ]
        acts = [str(b.get(f"{key}_mean", "-")) for key in ("turns", "side_requests", "branches")]
        cells = [name, r["harness_versions"].get(name, ""), *scores, str(r["infra_failed"]), *acts]
        cells += [f"{tokens:.0f}", merged]
        cells += [str(r["seconds_per_rollout_median"]), outcomes]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "infra failures: rollouts the infrastructure failed past their retries, in no figure;",
        "turns, side requests and branches are means per rollout; tokens: prompt + completion per rollout;",
        "training tokens: merged samples vs one sample per call (the ratio is what merging saves).",
    ]
    return "\n".join(lines) + "\n"


def run_and_write_trajectories(opts: EvalOptions, engine: Engine | None = None) -> dict[str, Any]:
    """`openforge rollout`: run the tasks and write the training samples they produced (JSONL)."""
    results = run_rollouts(opts, engine)
    path = RunFolder(opts.out).samples
    n_samples = 0
    with path.open("w") as f:
        for r in results:
            if r.status != Status.DONE:
                continue
            for s in r.samples:
                row = {"task_id": r.task_id, "sample": r.sample, **dataclasses.asdict(s)}
                f.write(json.dumps(row) + "\n")
                n_samples += 1
    return {"rollouts": len(results), "samples": n_samples, "path": str(path)}


def _markdown(report: dict[str, Any], summary_md: str) -> str:
    lines = [
        f"# Evaluation: {report['tasks']} with the {report['harness']} harness",
        "",
        f"- rollouts: {report['rollouts']} ({report['scored']} scored), k = {report['k']}, n = {report['n']}",
        f"- outcomes: {', '.join(f'{k}: {v}' for k, v in sorted(report['outcomes'].items()))}",
        f"- harness: {', '.join(report['harness_versions'].values())}",
        f"- tokens: {report['tokens']['prompt']} prompt, {report['tokens']['completion']} completion",
        f"- time: {report['seconds']} s in all, "
        f"{report['seconds_per_rollout_median']} s per rollout (median)",
    ]
    if report["tasks_without_k_scored_runs"]:
        missing = ", ".join(report["tasks_without_k_scored_runs"])
        lines.append(f"- tasks without {report['k']} scored runs: {missing}")
    act = report.get("acting", {}).get("all")
    if act:
        lines += [
            "",
            "| behaviour | rollouts | tool calls (mean) | tool errors (mean) | met an error | "
            "recovered | gave up | read back its write |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [("all", act), *report["acting"]["by_tag"].items()]
        lines += [
            f"| {name} | {a['rollouts']} | {a['tool_calls_mean']:.2f} | {a['tool_errors_mean']:.2f} | "
            f"{a['rollouts_with_errors']} | {_rate(a['recovery_rate'])} | {_rate(a['gave_up_rate'])} | "
            f"{_rate(a['self_verification_rate'])} |"
            for name, a in rows
        ]
    if report["by_tag"]:
        lines += ["", "| tag | tasks | runs | mean reward | pass@1 |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {tag} | {v['tasks']} | {v['runs']} | {v['mean_reward']:.3f} | {v['pass@k']['1']:.3f} |"
            for tag, v in report["by_tag"].items()
        ]
    # The infrastructure's count right above the figures it is left out of.
    failed = "".join(f"- infra {task}: {why}\n" for task, why in report.get("infra_errors", {}).items())
    return (
        "\n".join(lines)
        + f"\n\n{failures_line(report)}.\n"
        + (f"\n{failed}" if failed else "")
        + "\n"
        + summary_md
    )


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"
