"""A real pretrained model inside real harnesses: what SmolLM2-135M-Instruct does, out of the box,
when it generates every turn inside the built-in ReAct harness, mini-swe-agent and pi.

    .venv/bin/python benchmarks/real_model_harnesses.py [--out runs/real-model-harnesses]
        [--harnesses react,mini-swe-agent,pi] [--tasks tools-tiny] [--limit 5] [--n 2]
        [--max-tokens 96] [--max-turns 4] [--concurrency 2] [--label NAME]
        [--json benchmarks/results/real_model_harnesses.json]

It runs the harness study that `openforge eval --harness react,mini-swe-agent,pi` runs (the same
function, into --out; skipped when --out already holds a study.json, so the study can also come from
the CLI), then reads what the runner and the gateway recorded there: per harness the rollouts, their
outcomes and rewards, model calls (turns) per rollout, the tool calls the gateway parsed, parse
errors, branches and why each started, side requests, prompt tokens, how each call ended, wall
time; and, measured once on the harnesses' own first prompts with the built-in engine at batch 1,
prefill seconds and decode tokens/s. Prints the JSON and adds it to --json under `runs` (--label).

Concurrency 2 on 2 cores: at 4, mini-swe-agent's rollouts (3 calls of 1.0-1.3k-token prompts, each
CLI process importing litellm) outlast tools-tiny's 120 s task timeout (7 of 10 in the recorded run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from openforgerl.evaluate import EvalOptions, run_study
from openforgerl.modelkit.pretrained import cached_pretrained
from openforgerl.rollouts.results import RunState
from openforgerl.rollouts.trajectory import calls_from_rows
from openforgerl.store.sqlite import CallRow, Store

MODEL = "smollm2-135m-instruct"


def read_calls(folder: Path, rollout_ids: list[str]) -> dict[str, list[CallRow]]:
    async def read() -> dict[str, list[CallRow]]:
        store = Store(folder / "gateway.db")
        try:
            return {rid: await store.calls(rid) for rid in rollout_ids}
        finally:
            await store.close()

    return asyncio.run(read())


def harness_summary(folder: Path, report: dict[str, Any]) -> dict[str, Any]:
    state = RunState(folder / "runner.db")
    try:
        results = sorted(state.load().values(), key=lambda r: r.key)
    finally:
        state.close()
    calls = read_calls(folder, [r.gateway_rollout_id for r in results])
    every = [c for rows in calls.values() for c in rows]
    main = {rid: [c for c in calls_from_rows(rows) if not c.side_request] for rid, rows in calls.items()}
    prompts = [c.prompt_tokens for c in every] or [0]
    completions = [len(c.completion_ids) for c in every] or [0]
    with_tool_calls = [c for c in every if c.response.get("tool_calls")]
    latencies = [c.latency_ms for c in every] or [0.0]
    latency_s = sum(latencies) / 1000
    tool_calls = [t for c in with_tool_calls for t in c.response["tool_calls"]]
    summary = report["summary"] or {}
    pass1 = summary.get("pass@k", {}).get("1")
    harness_ends: collections.Counter[str] = collections.Counter()
    for r in results:
        harness_ends[_how_it_ended(r.outcome, r.details.get("harness", {}))] += 1
    return {
        "version": next(iter(report["harness_versions"].values()), ""),
        "rollouts": len(results),
        "status": dict(collections.Counter(r.status.value for r in results)),
        "outcomes": dict(collections.Counter(r.outcome for r in results)),
        "harness_ends": dict(harness_ends),
        "rewards": [r.reward for r in results],
        "pass_rate": pass1,
        "mean_reward": summary.get("mean_reward"),
        "turns_mean": round(statistics.fmean(len(m) for m in main.values()), 2) if main else 0,
        "calls": len(every),
        "calls_failed": sum(c.status != "ok" for c in every),
        "side_requests": len(every) - sum(len(m) for m in main.values()),
        "tool_calls": len(tool_calls),
        "calls_with_a_tool_call": len(with_tool_calls),
        "tool_names": dict(
            collections.Counter(
                t["function"]["name"] for c in with_tool_calls for t in c.response["tool_calls"]
            )
        ),
        "parse_errors": sum(len(c.parse_errors) for c in every),
        "parse_error_examples": [e for c in every for e in c.parse_errors][:5],
        "branches": sum(len({c.branch_id for c in m}) for m in main.values()),
        "calls_extending_their_branch": sum(
            1 for c in every if c.parent_call_id is not None and not c.branch_reason
        ),
        "branch_reasons": dict(collections.Counter(c.branch_reason or "extended" for c in every)),
        "finish_reasons": dict(collections.Counter(c.finish_reason for c in every)),
        "ended_by_endoftext": sum(bool(c.completion_ids) and c.completion_ids[-1] == 0 for c in every),
        "prompt_tokens_median": statistics.median(prompts),
        "prompt_tokens_max": max(prompts),
        "completion_tokens_mean": round(statistics.fmean(completions), 1),
        "training_tokens": report["tokens"]["training"],
        "call_latency_s_median": round(statistics.median(c.latency_ms for c in every) / 1000, 2)
        if every
        else 0,
        "completion_tokens_per_call_second": round(sum(completions) / latency_s, 2) if latency_s else None,
        "seconds_per_rollout_median": report["seconds_per_rollout_median"],
        "wall_s": report["seconds"],
    }


def _how_it_ended(outcome: str, harness: dict[str, Any]) -> str:
    """react prints why it stopped (JSON, its last line); mini-swe-agent prints `Exit:` and its exit
    status; otherwise the outcome and exit code."""
    tail = str(harness.get("tail", "")).strip()
    lines = tail.splitlines()
    try:
        return str(json.loads(lines[-1])["stopped"])
    except (IndexError, ValueError, KeyError, TypeError):
        pass
    if "\nExit:\n" in tail:
        return tail.rsplit("\nExit:\n", 1)[1].split("\n", 1)[0].strip()
    return f"{outcome} (exit {harness.get('exit_code')})"


def engine_speed(model: Path, prompts: dict[str, list[int]], threads: int) -> dict[str, Any]:
    """The built-in engine at batch 1 on each harness's first prompt: a cold prefill (one token),
    then 64 tokens more from the same prompt (its prefix cached): decode tokens/s."""
    from openforgerl.engines.base import SamplingParams
    from openforgerl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(model, threads=threads)

    async def go() -> dict[str, Any]:
        await engine.start()
        out: dict[str, Any] = {}
        try:
            for name, prompt in prompts.items():
                t0 = time.monotonic()
                await engine.generate(prompt, SamplingParams(max_tokens=1, seed=0))
                prefill = time.monotonic() - t0
                t0 = time.monotonic()
                done = await engine.generate(prompt, SamplingParams(max_tokens=65, seed=1))
                decode = time.monotonic() - t0
                n = len(done.completion_ids)
                out[name] = {
                    "prompt_tokens": len(prompt),
                    "prefill_s": round(prefill, 2),
                    "decode_tokens": n,
                    "decode_tokens_per_s": round(n / decode, 1),
                }
        finally:
            await engine.close()
        return out

    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/real-model-harnesses"))
    ap.add_argument("--harnesses", default="react,mini-swe-agent,pi")
    ap.add_argument("--tasks", default="tools-tiny")
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--engine-threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/real_model_harnesses.json"))
    ap.add_argument(
        "--label", default="", help="the run's key under `runs` in --json (default: the settings)"
    )
    args = ap.parse_args()

    model = cached_pretrained(MODEL)
    names = args.harnesses.split(",")
    settings = {
        "tasks": args.tasks,
        "split": args.split,
        "limit": args.limit,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "max_turns": args.max_turns,
        "temperature": args.temperature,
        "seed": args.seed,
        "concurrency": args.concurrency,
    }
    if not (args.out / "study.json").exists():
        opts = EvalOptions(
            tasks=args.tasks,
            split=args.split,
            limit=args.limit,
            k=1,
            n=args.n,
            model=str(model),
            out=args.out,
            max_tokens=args.max_tokens,
            max_turns=args.max_turns,
            temperature=args.temperature,
            seed=args.seed,
            concurrency=args.concurrency,
            engine_threads=args.engine_threads,
        )
        run_study(opts, names)
    study = json.loads((args.out / "study.json").read_text())
    harnesses = {name: harness_summary(args.out / name, study["harnesses"][name]) for name in names}

    first_prompts = {}
    for name in names:
        state = RunState(args.out / name / "runner.db")
        try:
            rid = min(state.load().values(), key=lambda r: r.key).gateway_rollout_id
        finally:
            state.close()
        rows = read_calls(args.out / name, [rid])[rid]
        first_prompts[name] = list(calls_from_rows(rows)[0].prompt_ids)
    threads = args.engine_threads or max(1, (os.cpu_count() or 2) // 2)
    result = {
        "what": "SmolLM2-135M-Instruct (untrained for these harnesses) generating every turn inside real "
        "harnesses through the gateway, built-in transformers engine, bwrap sandboxes",
        "model": MODEL,
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, engine threads {threads}",
        "settings": settings,
        "model_dir": "SMOLLM2: cached_pretrained('smollm2-135m-instruct'), `openforge model init --from "
        "smollm2-135m-instruct DIR` writes the same",
        "command": (
            f"openforge eval --model SMOLLM2 --harness {args.harnesses} --tasks {args.tasks} "
            f"--split {args.split} --limit {args.limit} --n {args.n} --max-tokens {args.max_tokens} "
            f"--max-turns {args.max_turns} --temperature {args.temperature} --seed {args.seed} "
            f"--concurrency {args.concurrency} --out {args.out}"
        ),
        "reproduce": (
            f"python benchmarks/real_model_harnesses.py --out {args.out} --limit {args.limit} "
            f"--n {args.n} --max-tokens {args.max_tokens} --max-turns {args.max_turns} "
            f"--concurrency {args.concurrency}"
        ),
        "harnesses": harnesses,
        "engine_batch_1": engine_speed(model, first_prompts, threads),
    }
    print(json.dumps(result, indent=2))
    # One file, a run per label: a run at another size or concurrency is added beside the others.
    label = args.label or f"{args.tasks}-limit{args.limit}-n{args.n}-c{args.concurrency}"
    saved = json.loads(args.json.read_text()) if args.json.exists() else {"runs": {}}
    saved["runs"][label] = result
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
