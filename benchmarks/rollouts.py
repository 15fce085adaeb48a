"""Rollout throughput and where the time goes (issue: rollouts at scale on one machine).

Measures, in one run, per sandbox backend (`--backends local docker`, side by side):
1. sandbox start-to-ready latency, bare and with the gateway relay (median of N); for local also a
   plain subprocess, bwrap's baseline;
2. rollouts per minute at concurrency 1, 8 and 32: the built-in ReAct harness on `tools-tiny`,
   through an embedded gateway whose engine plays the tools-tiny ORACLE (`rl.oracle_teacher`): no
   model time, so what remains is the runner, sandboxes, harness, gateway;
3. the split of a rollout's wall time: gateway session, sandbox start, harness (the agent process,
   which includes its model calls), verifier, stop/close — and the runner's own overhead (everything
   that is neither the harness nor the verifier) as a share of the rollout's wall time.

    .venv/bin/python benchmarks/rollouts.py [--quick] [--backends local docker kubernetes]
        [--image IMAGE] [--backend-config K8S.yaml] [--out benchmarks/results/rollouts.json]

docker needs a reachable engine ($DOCKER_HOST) with IMAGE (`make docker-base`); the harness runs on
the image's python3 with its modules bound read-only, as `openforge eval --backend docker` does.
kubernetes needs a cluster (`make k8s-up`), IMAGE holding the harness's modules
(scripts/k8s_task_image.py) and the backend's settings (--backend-config: kubeconfig, namespace,
gateway_host where Pods reach this machine, cpu_request_fraction); its start latency is a Pod's, from
create to ready.

Prints JSON (machine-readable) and a Markdown table. Medians, since this machine is noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from openforgerl.gateway.server import GatewayConfig, serve_in_thread
from openforgerl.harnesses.launch import python_binds, react_harness
from openforgerl.modelkit import cached_model
from openforgerl.rl.oracle_teacher import OracleTeacherEngine
from openforgerl.rollouts.results import Status
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import SandboxBackend, SandboxSpec
from openforgerl.sandbox.choice import DEFAULT_IMAGE, BackendChoice
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import Task, load_tasks


async def start_latency(backend: SandboxBackend, n: int, network: bool, gateway: str) -> float:
    times = []
    for i in range(n):
        spec = SandboxSpec(network="gateway", gateway_url=gateway) if network else SandboxSpec()
        sandbox = backend.create(spec, f"bench-{i}")
        t0 = time.perf_counter()
        await sandbox.start()
        times.append(time.perf_counter() - t0)
        await sandbox.stop()
    return statistics.median(times) * 1000


async def throughput(cfg: RunnerConfig, tasks: list[Task], backend: SandboxBackend) -> dict[str, Any]:
    runner = Runner(cfg, backend, react_harness(max_turns=8))
    t0 = time.perf_counter()
    try:
        results = await runner.run(tasks)
    finally:
        await runner.close()
    wall = time.perf_counter() - t0
    done = [r for r in results if r.status == Status.DONE]
    phases: dict[str, float] = {}
    for key in ("start", "harness", "verify", "total"):
        values = [r.seconds.get(key, 0.0) for r in done]
        phases[key] = statistics.median(values) if values else 0.0
    overheads = [
        (r.seconds["total"] - r.seconds.get("harness", 0.0) - r.seconds.get("verify", 0.0))
        / r.seconds["total"]
        for r in done
        if r.seconds.get("total")
    ]
    return {
        "concurrency": cfg.concurrency,
        "rollouts": len(results),
        "succeeded": sum(1 for r in done if r.reward == 1.0),
        "wall_s": round(wall, 2),
        "rollouts_per_min": round(60 * len(results) / wall, 1),
        "median_s": {k: round(v, 3) for k, v in phases.items()},
        "runner_overhead_share_median": round(statistics.median(overheads), 4) if overheads else None,
    }


def measure(
    choice: BackendChoice, levels: list[int], starts: int, quick: bool, gw: Any, tmp: str
) -> dict[str, Any]:
    """Start latency and throughput of one backend ("local": bwrap, beside a plain process)."""
    name = choice.name
    latency: dict[str, float] = {}
    backends: dict[str, SandboxBackend] = {name: choice.make(f"bench-{name}")}
    if name == "local":
        backends["plain"] = LocalBackend(bwrap=False)
    for label, backend in backends.items():
        latency[label] = round(asyncio.run(start_latency(backend, starts, False, gw.url)), 1)
        latency[f"{label}+gateway"] = round(asyncio.run(start_latency(backend, starts, True, gw.url)), 1)
    out: dict[str, Any] = {"sandbox_start_ms_median": latency, "throughput": []}
    tasks = load_tasks("tools-tiny", split="train")
    for level in levels:
        n = max(4, level * (2 if quick else 3))
        run_cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id=f"bench-{name}-c{level}",
            state_path=Path(tmp) / f"runner-{name}-c{level}.db",
            concurrency=level,
            ro_binds=python_binds(name),  # a container: the harness's modules for the image's python3
        )
        backend = choice.make(run_cfg.run_id)
        out["throughput"].append(asyncio.run(throughput(run_cfg, tasks[:n], backend)))
        print(name, json.dumps(out["throughput"][-1]), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller counts: a smoke run of about a minute")
    ap.add_argument("--backends", nargs="+", choices=["local", "docker", "kubernetes"], default=["local"])
    ap.add_argument("--image", default=DEFAULT_IMAGE, help="docker, kubernetes: the image the tasks run in")
    ap.add_argument("--backend-config", default=None, help="kubernetes: the backend's settings (YAML)")
    ap.add_argument("--levels", type=int, nargs="+", help="concurrency levels (default 1 8 32; --quick 1 4)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    levels = args.levels or ([1, 4] if args.quick else [1, 8, 32])
    starts = 5 if args.quick else 20
    model = cached_model("tiny", 0)
    k8s = yaml.safe_load(Path(args.backend_config).read_text()) if args.backend_config else {}
    choices = [BackendChoice(b, args.image, k8s if b == "kubernetes" else {}) for b in args.backends]
    # One gateway for every backend: where Pods reach it, when kubernetes is among them.
    host = next((c.gateway_host for c in choices if c.name == "kubernetes"), "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        engine = OracleTeacherEngine(model, load_tasks("tools-tiny", split="train"))
        cfg = GatewayConfig(model=str(model), host=host, port=0, store=f"{tmp}/gw.db", max_tokens=128)
        with serve_in_thread(cfg, engine) as gw:
            measured = {c.name: measure(c, levels, starts, args.quick, gw, tmp) for c in choices}
            report = {"backends": measured}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        "\n| backend | concurrency | rollouts | ok | rollouts/min | median total s | harness s | start s "
        "| overhead |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, measured in report["backends"].items():
        for t in measured["throughput"]:
            m = t["median_s"]
            print(
                f"| {name} | {t['concurrency']} | {t['rollouts']} | {t['succeeded']} "
                f"| {t['rollouts_per_min']} | {m['total']} | {m['harness']} | {m['start']} "
                f"| {100 * (t['runner_overhead_share_median'] or 0):.1f}% |"
            )
    for name, measured in report["backends"].items():
        print(f"\nsandbox start-to-ready, median ms ({name}):", measured["sandbox_start_ms_median"])


if __name__ == "__main__":
    main()
