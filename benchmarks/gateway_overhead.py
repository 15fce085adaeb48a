"""How much latency a call gains by going through a proxy instead of straight to the engine.

One run measures three paths side by side, at the same load, against a ZERO-LATENCY FAKE engine
(benchmarks/fake_engine.py), each server in its own process:

    direct   client -> fake engine (/v1/chat/completions): the baseline
    gateway  client -> OpenForgeRL gateway (`openforge gateway --engine vllm:URL`) -> fake engine
    litellm  client -> LiteLLM proxy (openai/ model on the fake's /v1, no DB, no logging,
             one worker) -> fake engine

The load generator (benchmarks/loadgen.py, asyncio + aiohttp on uvloop) is a process of its own.
Loads: 1, 64 and 512 concurrent streaming clients; shapes: small (about 2 KB, one turn) and
harness (12 tools, a 30-turn conversation per client that grows to about 100 KB; on the gateway
each client owns a rollout, so its token memory is exercised). Every point runs in rounds with
the paths interleaved (the order rotates each round); added latency is a path's percentile minus
the direct path's in the same round, and the median over rounds is reported.

Also measured: the gateway's memory per open rollout (RSS growth of a fresh gateway after opening
N rollouts with a 30-turn history each), its per-call cost at turn 30 vs turn 1 (over HTTP, and
server-side in-process: parsing + token memory), and the CPU each process spent per call.

    make bench                                   # the full run (about 15 minutes on 2 cores)
    make bench BENCH_ARGS=--quick                # a smoke run (about 2 minutes)
    .venv/bin/python benchmarks/gateway_overhead.py --help
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402

PATHS = ("direct", "gateway", "litellm")
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 2
ADMIN_TOKEN = "bench-admin-token"
# The goals (issue #25): the gateway's added p50 at one client <= 1/5 of LiteLLM's, its added p99 at
# 64 clients or more <= 1/3; its time to first token within 2x one decode step of the engine behind.
GOAL_P50_AT_ONE = 1 / 5
GOAL_P99_LOADED = 1 / 3
GOAL_TTFT_STEPS = 2.0
TTFT_DELAY_MS = 20.0  # the paced fake engine's decode step for the time-to-first-token phase


# -- the plan -----------------------------------------------------------------------------------
@dataclass
class Point:
    """One load point. Shapes: small; harness (whole conversations, turn 1 to the last, one rollout
    each); harness_mid (`per_client` consecutive turns from the middle of conversations whose
    history the gateway got in one untimed call: the steady state of many long rollouts, at a
    cost the slowest path can pay at 512 clients)."""

    shape: str
    load: int  # concurrent clients
    rounds: int
    duration_s: float  # time cap of one phase (one path, one round)
    per_client: int = 1_000_000  # small: calls per client; harness_mid: turns per client
    conversations: int = 0  # harness: conversations per phase (0 = one per client)

    def expected_calls(self, turns: int) -> int | None:
        """Calls a phase makes when its count bound, not its time cap, ends it (None: time-bound)."""
        if self.shape == "harness":
            return (self.conversations or self.load) * turns
        if self.per_client < 1_000_000:
            return self.load * self.per_client
        return None


@dataclass
class Plan:
    points: list[Point]
    turns: int = workload.HARNESS_TURNS
    memory_rollouts: int = 200
    memory_concurrency: int = 64
    memory_duration_s: float = 300.0


def full_plan() -> Plan:
    # Every phase is bounded by count (all paths send the same calls) and capped in time.
    return Plan(
        points=[
            Point("small", 1, rounds=3, duration_s=60.0, per_client=150),
            Point("small", 64, rounds=3, duration_s=60.0, per_client=5),
            Point("small", 512, rounds=2, duration_s=150.0, per_client=2),
            Point("harness", 1, rounds=3, duration_s=60.0, conversations=2),
            Point("harness", 64, rounds=2, duration_s=200.0),
            Point("harness_mid", 512, rounds=1, duration_s=200.0, per_client=2),
        ],
        memory_rollouts=200,
    )


def quick_plan() -> Plan:
    return Plan(
        points=[
            Point("small", 1, rounds=2, duration_s=30.0, per_client=50),
            Point("small", 64, rounds=1, duration_s=30.0, per_client=2),
            Point("small", 512, rounds=1, duration_s=60.0, per_client=1),
            Point("harness", 1, rounds=1, duration_s=30.0, conversations=1),
            Point("harness", 64, rounds=1, duration_s=60.0),
            Point("harness_mid", 512, rounds=1, duration_s=60.0, per_client=1),
        ],
        turns=10,
        memory_rollouts=40,
        memory_duration_s=60.0,
    )


# -- processes ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    """The environment of every child: offline, no proxies, nothing but loopback to talk to."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        NO_PROXY="*",
        # LiteLLM: never fetch anything from the internet (cost map, blog, headers, presets).
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_LOCAL_BLOG_POSTS="True",
        LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS="True",
        LITELLM_LOCAL_AUTOROUTER_PRESETS="True",
        LITELLM_LOCAL_POLICY_TEMPLATES="True",
        LITELLM_MODEL_COST_MAP_URL="http://127.0.0.1:9/none",
        LITELLM_BLOG_POSTS_URL="http://127.0.0.1:9/none",
        LITELLM_ANTHROPIC_BETA_HEADERS_URL="http://127.0.0.1:9/none",
        LITELLM_AUTOROUTER_PRESETS_URL="http://127.0.0.1:9/none",
        LITELLM_LOG="ERROR",
        LITELLM_TELEMETRY="False",
        DISABLE_ADMIN_UI="True",
    )
    return env


@dataclass
class Server:
    name: str
    cmd: list[str]
    health_url: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    ps: psutil.Process | None = None

    def start(self, timeout: float = 120.0) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env=child_env(),
            cwd=str(self.log.parent),
            start_new_session=True,
        )
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited at start; log: {self.log}\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.health_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become healthy in {timeout:.0f} s; log: {self.log}")
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        assert self.ps is not None
        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_s(self) -> float:
        total = 0.0
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss(self) -> int:
        total = 0
        for p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total

    def foreign_connections(self) -> list[str]:
        """Remote addresses this server is connected to that are not loopback (must be none)."""
        out = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                for c in p.net_connections(kind="inet"):
                    if c.raddr and not (
                        c.raddr.ip.startswith("127.") or c.raddr.ip in ("::1", "::ffff:127.0.0.1")
                    ):
                        out.append(f"{c.raddr.ip}:{c.raddr.port}")
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class LoadGen:
    """The load-generator process; one JSON line per phase in, one per phase out."""

    def __init__(self, python: str, log: Path) -> None:
        self.proc = subprocess.Popen(
            [python, str(HERE / "loadgen.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("wb"),
            env=child_env(),
            cwd=str(HERE),
            start_new_session=True,
        )
        self.ps = psutil.Process(self.proc.pid)
        self.log = log
        line = self._readline()
        if not orjson.loads(line).get("ready"):
            raise RuntimeError(f"the load generator did not start: {line!r}")

    def _readline(self) -> bytes:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator died; log: {self.log}\n{self.log.read_text()[-3000:]}")
        return line

    def _send(self, obj: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps(obj) + b"\n")
        self.proc.stdin.flush()
        reply: dict[str, Any] = orjson.loads(self._readline())
        if "fatal" in reply:
            raise RuntimeError(f"load generator: {reply['fatal']}")
        return reply

    def run(self, spec: dict[str, Any], at_start: Callable[[], None] | None = None) -> dict[str, Any]:
        """One phase; `at_start` runs after the untimed preparation, right before the clock starts."""
        prepared = self._send(spec)
        if at_start is not None:
            at_start()
        result = self._send({"cmd": "go"})
        result["setup_calls"], result["setup_errors"] = prepared["setup_calls"], prepared["setup_errors"]
        return result

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class Stack:
    work: Path
    model_dir: str
    completion_ids: list[int]
    bench_python: str
    litellm_bin: str
    durability: str
    servers: dict[str, Server] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    crashes: list[dict[str, Any]] = field(default_factory=list)

    def start_fake(
        self, name: str = "fake", token_delay_ms: float = 0.0, completion_ids: list[int] | None = None
    ) -> None:
        port = free_port()
        self.servers[name] = s = Server(
            name,
            [
                sys.executable,
                str(HERE / "fake_engine.py"),
                "--port",
                str(port),
                "--completion-ids",
                json.dumps(self.completion_ids if completion_ids is None else completion_ids),
                "--token-delay-ms",
                str(token_delay_ms),
            ],
            f"http://127.0.0.1:{port}/health",
            self.work / f"{name}.log",
        )
        s.start()
        self.urls[name] = f"http://127.0.0.1:{port}"

    def gateway_server(self, name: str, store: str, engine: str = "fake") -> tuple[Server, str]:
        port = free_port()
        openforge = Path(sys.executable).with_name("openforge")
        cmd = [
            str(openforge) if openforge.exists() else sys.executable,
            *([] if openforge.exists() else ["-m", "openforgerl.cli"]),
            "gateway",
            "--model",
            self.model_dir,
            "--engine",
            f"vllm:{self.urls[engine]}",
            "--port",
            str(port),
            "--store",
            str(self.work / store),
            "--admin-token",
            ADMIN_TOKEN,
            "--max-context",
            "262144",
            "--max-tokens",
            "256",
            "--durability",
            self.durability,
        ]
        url = f"http://127.0.0.1:{port}"
        return Server(name, cmd, url + "/health", self.work / f"{name}.log"), url

    def start_gateway(self) -> None:
        n = sum(1 for c in self.crashes if c["server"] == "gateway")
        server, url = self.gateway_server("gateway", f"gateway-{n}.db" if n else "gateway.db")
        self.servers["gateway"] = server
        server.start()
        self.urls["gateway"] = url

    def ensure_alive(self, name: str, where: str) -> None:
        """Restart a proxy that died (LiteLLM segfaulted once under 512 streams): noted in the report."""
        server = self.servers[name]
        if server.proc is None or server.proc.poll() is None:
            return
        code = server.proc.returncode
        log(f"  !! {name} died (exit {code}) before {where}; restarting it (log {server.log})")
        self.crashes.append({"server": name, "exit_code": code, "before": where, "log": str(server.log)})
        server.log.rename(server.log.with_suffix(f".crash{len(self.crashes)}.log"))
        if name == "litellm":
            self.start_litellm()
        elif name == "gateway":
            self.start_gateway()
        else:
            raise RuntimeError(f"the {name} died (exit {code}) before {where}")

    def start_litellm(self) -> None:
        port = free_port()
        config = self.work / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            f"  - model_name: {workload.LITELLM_MODEL}\n"
            "    litellm_params:\n"
            f"      model: openai/{workload.FAKE_MODEL}\n"
            f"      api_base: {self.urls['fake']}/v1\n"
            "      api_key: fake-key\n"
            "litellm_settings:\n"
            "  drop_params: true\n"
            "  set_verbose: false\n"
            "  turn_off_message_logging: true\n"
            "  callbacks: []\n"
            "  success_callback: []\n"
            "  failure_callback: []\n"
            "general_settings:\n"
            f"  master_key: {LITELLM_KEY}\n"
            "  disable_spend_logs: true\n"
            "  disable_error_logs: true\n"
        )
        cmd = [
            self.litellm_bin,
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
            "--keepalive_timeout",
            "300",
        ]
        url = f"http://127.0.0.1:{port}"
        self.servers["litellm"] = s = Server(
            "litellm", cmd, url + "/health/liveliness", self.work / "litellm.log"
        )
        s.start(timeout=180)
        self.urls["litellm"] = url

    def stop(self) -> None:
        for s in reversed(list(self.servers.values())):
            s.stop()


def phase_spec(stack: Stack, path: str, point: Point, turns: int, **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "path": path,
        "shape": point.shape,
        "concurrency": point.load,
        "duration_s": point.duration_s,
        "per_client": point.per_client,
        "conversations": point.conversations or point.load,
        "turns": turns,
    }
    if path == "direct":
        spec.update(url=stack.urls["fake"] + "/v1/chat/completions", api_key="fake-key")
    elif path == "litellm":
        spec.update(url=stack.urls["litellm"] + "/v1/chat/completions", api_key=LITELLM_KEY)
    else:
        spec.update(admin_url=stack.urls["gateway"], admin_token=ADMIN_TOKEN)
    spec.update(extra)
    return spec


# -- statistics ---------------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def med(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def rnd(x: float, nd: int = 2) -> float | None:
    return None if x != x else round(x, nd)


def summarize_phase(result: dict[str, Any], cpu: dict[str, float]) -> dict[str, Any]:
    samples = result["samples"]
    ok = [s for s in samples if s[3]]
    lat = [s[1] for s in ok]
    ttfb = [s[2] for s in ok]
    active = max(result["active_s"], 1e-9)
    n_ok = len(ok)
    return {
        "calls": len(samples),
        "ok": n_ok,
        "errors": len(samples) - n_ok,
        "error_kinds": result["errors"],
        "p50_ms": pct(lat, 0.5),
        "p90_ms": pct(lat, 0.9),
        "p99_ms": pct(lat, 0.99),
        "mean_ms": statistics.fmean(lat) if lat else float("nan"),
        "ttfb_p50_ms": pct(ttfb, 0.5),
        "ttfb_p99_ms": pct(ttfb, 0.99),
        "calls_per_s": n_ok / active,
        "active_s": active,
        "client_cpu_util": result["client_cpu_s"] / active,
        "cpu_ms_per_call": {k: (v * 1000 / n_ok if n_ok else float("nan")) for k, v in cpu.items()},
        "per_turn_p50_ms": _per_turn(ok),
    }


def _per_turn(ok: list[list[Any]]) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for s in ok:
        if s[0]:
            by.setdefault(int(s[0]), []).append(s[1])
    return {t: pct(v, 0.5) for t, v in sorted(by.items())}


# -- the run ------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gateway_stats(stack: Stack) -> dict[str, Any]:
    try:
        r = httpx.get(
            stack.urls["gateway"] + "/admin/stats",
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        )
        return dict(r.json())
    except (httpx.HTTPError, ValueError):
        return {}


def run_point(
    stack: Stack, gen: LoadGen, point: Point, plan: Plan, pyspy: Path | None = None
) -> dict[str, Any]:
    """All rounds of one point. With `pyspy`, the gateway's timed phases are profiled."""
    rounds: list[dict[str, dict[str, Any]]] = []
    raws: list[Path] = []
    for r in range(point.rounds):
        order = PATHS[r % 3 :] + PATHS[: r % 3]
        this: dict[str, dict[str, Any]] = {}
        for path in order:
            stack.ensure_alive("fake", f"{point.shape} c={point.load} round {r + 1} {path}")
            if path != "direct":
                stack.ensure_alive(path, f"{point.shape} c={point.load} round {r + 1} {path}")
            spec = phase_spec(stack, path, point, plan.turns)
            procs = {"client": gen.cpu_s, "fake": stack.servers["fake"].cpu_s}
            if path != "direct":
                procs["proxy"] = stack.servers[path].cpu_s
            before: dict[str, float] = {}
            profiler: Profiler | None = None
            if pyspy is not None and path == "gateway":
                raws.append(stack.work / f"profile-gateway-{point.shape}-{point.load}-r{r + 1}.txt")
                profiler = Profiler(pyspy, raws[-1])

            stats0: dict[str, Any] = {}

            def at_start(
                procs: dict[str, Any] = procs,
                before: dict[str, float] = before,
                profiler: Profiler | None = profiler,
                stats0: dict[str, Any] = stats0,
                path: str = path,
            ) -> None:
                if path == "gateway":
                    stats0.update(gateway_stats(stack))
                before.update({k: f() for k, f in procs.items()})
                gateway = stack.servers["gateway"].proc
                if profiler is not None and gateway is not None:
                    profiler.start(gateway.pid)

            try:
                result = gen.run(spec, at_start)
            finally:
                if profiler is not None:
                    profiler.stop()
            cpu = {k: f() - before[k] for k, f in procs.items()}
            this[path] = s = summarize_phase(result, cpu)
            if path == "gateway":
                # Token memory at work: calls that extended their branch vs started a new one.
                stats1 = gateway_stats(stack)
                s["token_memory"] = {
                    k: stats1.get(k, 0) - stats0.get(k, 0) for k in ("extended", "new_branch")
                }
            expected = point.expected_calls(plan.turns)
            s["complete"] = expected is None or s["calls"] == expected
            s["setup_calls"], s["setup_errors"] = result["setup_calls"], result["setup_errors"]
            if s["setup_errors"]:
                log(f"  WARNING: {s['setup_errors']} of the untimed setup calls failed")
            log(
                f"  {point.shape:11s} c={point.load:<3d} round {r + 1}/{point.rounds} {path:8s}"
                f" ok={s['ok']:<6d} err={s['errors']:<4d} p50={s['p50_ms']:8.2f} ms"
                f" p99={s['p99_ms']:8.2f} ms {s['calls_per_s']:7.1f}/s client cpu {s['client_cpu_util']:.0%}"
            )
        rounds.append(this)
    out = aggregate_point(point, rounds)
    if raws:
        out["gateway_profile"] = profile_summary(raws)
    return out


def aggregate_point(point: Point, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "shape": "small" if point.shape == "small" else "harness",
        "mode": {"small": "one turn", "harness": "whole conversations", "harness_mid": "mid-conversation"}[
            point.shape
        ],
        "load": point.load,
        "rounds": len(rounds),
        "bound": "time" if point.expected_calls(0) is None else "count",
        "paths": {},
    }
    for path in PATHS:
        per = [r[path] for r in rounds]
        added_p50 = [r[path]["p50_ms"] - r["direct"]["p50_ms"] for r in rounds]
        added_p99 = [r[path]["p99_ms"] - r["direct"]["p99_ms"] for r in rounds]
        added_ttfb = [r[path]["ttfb_p50_ms"] - r["direct"]["ttfb_p50_ms"] for r in rounds]
        turns: dict[int, list[float]] = {}
        for p in per:
            for t, v in p["per_turn_p50_ms"].items():
                turns.setdefault(int(t), []).append(v)
        cpu_keys = per[0]["cpu_ms_per_call"].keys()
        out["paths"][path] = {
            "p50_ms": med([p["p50_ms"] for p in per]),
            "p99_ms": med([p["p99_ms"] for p in per]),
            "ttfb_p50_ms": med([p["ttfb_p50_ms"] for p in per]),
            "added_p50_ms": med(added_p50),
            "added_p99_ms": med(added_p99),
            "added_ttfb_p50_ms": med(added_ttfb),
            "added_p50_ms_rounds": added_p50,
            "added_p99_ms_rounds": added_p99,
            "calls_per_s": med([p["calls_per_s"] for p in per]),
            "calls": sum(p["calls"] for p in per),
            "errors": sum(p["errors"] for p in per),
            "error_kinds": _merge([p["error_kinds"] for p in per]),
            "incomplete_rounds": sum(1 for p in per if not p["complete"]),
            "token_memory": _merge([p["token_memory"] for p in per]) if path == "gateway" else None,
            "client_cpu_util": med([p["client_cpu_util"] for p in per]),
            "cpu_ms_per_call": {k: med([p["cpu_ms_per_call"][k] for p in per]) for k in cpu_keys},
            "per_turn_p50_ms": {t: med(v) for t, v in sorted(turns.items())},
            "rounds": per,
        }
    for path in ("gateway", "litellm"):
        out["paths"][path]["rounds"] = [
            {k: v for k, v in r.items() if k != "per_turn_p50_ms"} for r in out["paths"][path]["rounds"]
        ]
    out["paths"]["direct"]["rounds"] = [
        {k: v for k, v in r.items() if k != "per_turn_p50_ms"} for r in out["paths"]["direct"]["rounds"]
    ]
    g, lt = out["paths"]["gateway"], out["paths"]["litellm"]
    out["ratio_gateway_vs_litellm"] = {
        "added_p50": _ratio(g["added_p50_ms"], lt["added_p50_ms"]),
        "added_p99": _ratio(g["added_p99_ms"], lt["added_p99_ms"]),
        # Less sensitive to other work on the machine than latency; at saturation it sets the latency.
        "proxy_cpu_per_call": _ratio(g["cpu_ms_per_call"]["proxy"], lt["cpu_ms_per_call"]["proxy"]),
    }
    ratios = out["ratio_gateway_vs_litellm"]
    goals = {"added_p50": GOAL_P50_AT_ONE} if point.load == 1 else {"added_p99": GOAL_P99_LOADED}
    out["goal_met"] = all(ratios[k] is not None and ratios[k] <= goal for k, goal in goals.items())
    return out


# -- time to first token: each dialect's stream in front of an engine that decodes at a known pace --
# What marks the first generated text in each stream (not its opening events, which go out at once).
# The paced engine answers text (a tool call goes out whole once its closing tag is sampled, so a
# call-only answer has no first token before its last); the fake's own chat stream, the direct path,
# always streams its tool call, whose first event follows the first decode step.
TTFT_TEXT = "Let me look at the failing test first, then read the module it imports and fix the bug."
FIRST_TEXT = {
    "direct": rb'"tool_calls"',
    "openai": rb'"content":"[^"]',
    "anthropic": rb'"text_delta"',
    "gemini": rb'"text":"',
    "responses": rb"response.output_text.delta",
}


def _ttft_request(dialect: str, base: str, key: str) -> tuple[str, dict[str, str], bytes]:
    user = [{"role": "user", "content": "Say something."}]
    if dialect == "direct":
        body: dict[str, Any] = {"model": workload.FAKE_MODEL, "messages": user, "stream": True}
        return base + "/v1/chat/completions", {"authorization": "Bearer fake"}, orjson.dumps(body)
    if dialect == "openai":
        body = {"model": "m", "messages": user, "stream": True}
        return base + "/v1/chat/completions", {"authorization": f"Bearer {key}"}, orjson.dumps(body)
    if dialect == "anthropic":
        body = {"model": "m", "max_tokens": 256, "messages": user, "stream": True}
        return base + "/v1/messages", {"x-api-key": key}, orjson.dumps(body)
    if dialect == "gemini":
        body = {"contents": [{"role": "user", "parts": [{"text": "Say something."}]}]}
        url = base + "/v1beta/models/m:streamGenerateContent?alt=sse"
        return url, {"x-goog-api-key": key}, orjson.dumps(body)
    body = {"model": "m", "input": "Say something.", "stream": True}
    return base + "/v1/responses", {"authorization": f"Bearer {key}"}, orjson.dumps(body)


def time_to_first_token(stack: Stack, requests: int, completion_ids: list[int]) -> dict[str, Any]:
    """Each dialect's time to first token through the gateway, against the same fake engine paced at
    TTFT_DELAY_MS per token, beside the engine's own (direct) TTFT: sequential streamed requests,
    the dialects interleaved, medians. The goal: within GOAL_TTFT_STEPS decode steps."""
    import re

    stack.start_fake("fake-paced", TTFT_DELAY_MS, completion_ids)
    server, url = stack.gateway_server("gateway-paced", "gateway-paced.db", engine="fake-paced")
    stack.servers["gateway-paced"] = server
    server.start()
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    samples: dict[str, list[float]] = {d: [] for d in FIRST_TEXT}
    with httpx.Client(timeout=60) as client:
        keys = {}
        for dialect in FIRST_TEXT:
            r = client.post(url + "/admin/rollouts", json={"run_id": "ttft"}, headers=admin)
            r.raise_for_status()
            keys[dialect] = (r.json()["base_url"], r.json()["api_key"])
        for i in range(requests + 2):  # two rounds of warm-up
            for dialect, marker in FIRST_TEXT.items():
                base, key = (stack.urls["fake-paced"], "") if dialect == "direct" else keys[dialect]
                target, headers, body = _ttft_request(dialect, base, key)
                headers["content-type"] = "application/json"
                start = time.perf_counter()
                first, buf = None, b""
                with client.stream("POST", target, content=body, headers=headers) as r:
                    for chunk in r.iter_raw():
                        buf += chunk
                        if first is None and re.search(marker, buf):
                            first = (time.perf_counter() - start) * 1000
                if r.status_code != 200 or first is None:
                    raise RuntimeError(f"{dialect}: no generated text in its stream: {buf[:300]!r}")
                if i >= 2:
                    samples[dialect].append(first)
    stack.servers.pop("gateway-paced").stop()
    stack.servers.pop("fake-paced").stop()
    out: dict[str, Any] = {"decode_step_ms": TTFT_DELAY_MS, "requests": requests, "dialects": {}}
    for dialect, values in samples.items():
        p50 = statistics.median(values)
        out["dialects"][dialect] = {
            "ttft_p50_ms": p50,
            "ttft_max_ms": max(values),
            "in_decode_steps": p50 / TTFT_DELAY_MS,
        }
    out["goal_met"] = all(
        d["in_decode_steps"] <= GOAL_TTFT_STEPS for k, d in out["dialects"].items() if k != "direct"
    )
    return out


def _merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _ratio(a: float, b: float) -> float | None:
    if a != a or b != b or b <= 0:
        return None
    return max(a, 0.0) / b


def turn_cost(points: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    """Added latency of turn `turns` vs turn 1 (and the last 5 turns vs turns 2-6), per harness load."""
    out: dict[str, Any] = {}
    for p in points:
        if p["mode"] != "whole conversations":
            continue
        direct = p["paths"]["direct"]["per_turn_p50_ms"]
        row: dict[str, Any] = {}
        for path in ("gateway", "litellm"):
            mine = p["paths"][path]["per_turn_p50_ms"]
            added = {t: mine[t] - direct[t] for t in mine if t in direct}
            if not added:
                continue
            first, last = added.get(1, float("nan")), added.get(turns, float("nan"))
            early = [added[t] for t in range(2, 7) if t in added]
            late = [added[t] for t in range(turns - 4, turns + 1) if t in added]
            row[path] = {
                "added_turn1_ms": rnd(first),
                f"added_turn{turns}_ms": rnd(last),
                "ratio_last_vs_turn1": rnd(last / first) if first > 0 else None,
                "added_turns2_6_ms": rnd(med(early)),
                f"added_turns{turns - 4}_{turns}_ms": rnd(med(late)),
                "ratio_late_vs_early": rnd(med(late) / med(early)) if early and med(early) > 0 else None,
                "added_by_turn_ms": {t: rnd(v) for t, v in added.items()},
            }
        out[f"c{p['load']}"] = row
    return out


def server_side_turn_cost(model_dir: str, turns: int, repeat: int = 15) -> dict[str, Any]:
    """In-process: parse the request and plan the prompt (token memory) at each turn, as the gateway does.

    Also the counterfactual without token memory: render and tokenize the whole conversation.
    """
    from transformers import AutoTokenizer

    from openforgerl.conversation import Message, ToolCall
    from openforgerl.gateway.dialects import openai_chat
    from openforgerl.rendering import ChatRenderer, TokenMemory

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    completion = [*renderer.encode(workload.FAKE_COMPLETION_TEXT), renderer.turn_end_id]
    generated = Message(
        role="assistant", tool_calls=[ToolCall(workload.FAKE_TOOL, dict(workload.FAKE_ARGUMENTS))]
    )
    payloads = workload.bodies(workload.GATEWAY_MODEL, turns=turns)["harness"]
    memory = TokenMemory(renderer)
    per_turn: dict[int, dict[str, float]] = {}
    for turn, body in enumerate(payloads, 1):
        samples: dict[str, list[float]] = {"parse": [], "plan": [], "full_retokenize": []}
        for _ in range(repeat if turn in (1, 2, turns) else 1):
            t0 = time.perf_counter()
            conv, _ = openai_chat.parse_request(body)
            t1 = time.perf_counter()
            plan = memory.plan(conv.messages, conv.tools)  # plan() leaves the memory as it is
            t2 = time.perf_counter()
            renderer.encode(renderer.render(conv.messages, conv.tools))
            t3 = time.perf_counter()
            samples["parse"].append((t1 - t0) * 1000)
            samples["plan"].append((t2 - t1) * 1000)
            samples["full_retokenize"].append((t3 - t2) * 1000)
        t0 = time.perf_counter()
        memory.commit(plan, turn, completion, generated, True)
        commit_ms = (time.perf_counter() - t0) * 1000
        per_turn[turn] = {k: med(v) for k, v in samples.items()}
        per_turn[turn].update(
            commit=commit_ms, prompt_tokens=len(plan.prompt_ids), reused_tokens=plan.prefix_len
        )
    first, last = per_turn[1], per_turn[turns]
    gw1 = first["parse"] + first["plan"] + first["commit"]
    gwn = last["parse"] + last["plan"] + last["commit"]
    return {
        "what": "ms per call in one process: pydantic parse + token-memory plan (render, hash, encode "
        "the delta) + commit; full_retokenize = render + encode the whole prompt (no token memory)",
        "turn1": {k: rnd(v, 3) for k, v in first.items()},
        "turn2": {k: rnd(v, 3) for k, v in per_turn[2].items()} if 2 in per_turn else None,
        f"turn{turns}": {k: rnd(v, 3) for k, v in last.items()},
        f"ratio_turn{turns}_vs_turn1": rnd(gwn / gw1, 2),
        f"turn{turns}_full_retokenize_vs_token_memory": rnd(
            (last["parse"] + last["full_retokenize"]) / gwn, 2
        ),
    }


def memory_per_rollout(stack: Stack, gen: LoadGen, plan: Plan) -> dict[str, Any]:
    """RSS growth of a fresh gateway after opening N rollouts with a full-length history each."""
    server, url = stack.gateway_server("gateway-memory", "memory.db")
    server.start()
    try:
        stack.urls["gateway"] = url
        warm = Point("harness", 4, rounds=1, duration_s=30.0, conversations=4)
        gen.run(phase_spec(stack, "gateway", warm, plan.turns))
        time.sleep(0.5)
        before = server.rss()
        point = Point(
            "harness",
            plan.memory_concurrency,
            rounds=1,
            duration_s=plan.memory_duration_s,
            conversations=plan.memory_rollouts,
        )
        cpu0: list[float] = []
        result = gen.run(phase_spec(stack, "gateway", point, plan.turns), lambda: cpu0.append(server.cpu_s()))
        cpu = server.cpu_s() - cpu0[0]
        time.sleep(0.5)
        after = server.rss()
        stats = httpx.get(url + "/admin/stats", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        ok = [s for s in result["samples"] if s[3]]
        full = sum(1 for s in ok if s[0] == plan.turns)
        opened = max(full, 1)
        return {
            "rollouts_requested": plan.memory_rollouts,
            "rollouts_with_full_history": full,
            "turns": plan.turns,
            "calls": len(result["samples"]),
            "errors": len(result["samples"]) - len(ok),
            "open_sessions": stats.get("open_sessions"),
            "rss_before_mb": rnd(before / 2**20, 1),
            "rss_after_mb": rnd(after / 2**20, 1),
            "kb_per_rollout": rnd((after - before) / opened / 1024, 1),
            "calls_per_s": rnd(len(ok) / max(result["active_s"], 1e-9), 1),
            "gateway_cpu_ms_per_call": rnd(cpu * 1000 / max(len(ok), 1), 3),
            "complete": full == plan.memory_rollouts,
        }
    finally:
        server.stop()


class Profiler:
    """py-spy record (raw collapsed stacks, all threads) of one process, started and stopped by hand."""

    def __init__(self, pyspy: Path, out: Path) -> None:
        self.pyspy, self.out = pyspy, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, pid: int) -> None:
        cmd = [str(self.pyspy), "record", "--pid", str(pid), "--format", "raw", "--rate", "100"]
        self.proc = subprocess.Popen(
            [*cmd, "--nonblocking", "--output", str(self.out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def profile_summary(raws: list[Path], top: int = 25) -> dict[str, Any]:
    """Inclusive and self shares of the frames in py-spy raw profiles (the gateway's own code first)."""
    lines = [ln for raw in raws if raw.exists() for ln in raw.read_text().splitlines()]
    if not lines:
        return {"error": f"no profile written to {[str(r) for r in raws]}"}
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for fr in set(frames):
            incl[fr] = incl.get(fr, 0) + n

    def share(d: dict[str, int], keep: Callable[[str], bool]) -> list[tuple[str, float]]:
        rows = sorted(((k, v) for k, v in d.items() if keep(k)), key=lambda kv: -kv[1])[:top]
        return [(k, round(100 * v / max(total, 1), 1)) for k, v in rows]

    return {
        "samples": total,
        "files": [str(r) for r in raws],
        "self_pct": share(own, lambda k: True),
        "inclusive_pct_openforgerl": share(incl, lambda k: "openforgerl" in k),
        "inclusive_pct_libraries": share(
            incl,
            lambda k: any(x in k for x in ("httpx", "httpcore", "jinja2", "pydantic", "tokeniz", "sqlite")),
        ),
    }


# -- output -------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| shape | load | path | p50 added ms | p99 added ms | TTFB p50 added ms | calls/s "
        "| proxy CPU ms/call | errors | gw/LiteLLM p50 | gw/LiteLLM p99 | gw/LiteLLM CPU "
        "| goal (p50 ≤1/5 at 1, p99 ≤1/3 loaded) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]

    def f(x: float | None, nd: int = 2) -> str:
        return "n/a" if x is None or x != x else f"{x:.{nd}f}"

    for p in report["points"]:
        ratios = p["ratio_gateway_vs_litellm"]
        shape = p["shape"] + (" (mid-conv.)" if p["mode"] == "mid-conversation" else "")
        for path in PATHS:
            d = p["paths"][path]
            if path == "direct":
                lines.append(
                    f"| {shape} | {p['load']} | direct (p50 {f(d['p50_ms'])}, p99 {f(d['p99_ms'])} ms) "
                    f"| – | – | – | {f(d['calls_per_s'], 0)} | – | {d['errors']} | | | | |"
                )
                continue
            extra = (
                f" {f(ratios['added_p50'])} | {f(ratios['added_p99'])} "
                f"| {f(ratios.get('proxy_cpu_per_call'))} | {'yes' if p['goal_met'] else 'NO'} |"
                if path == "gateway"
                else " | | | |"
            )
            lines.append(
                f"| {shape} | {p['load']} | {path} | {f(d['added_p50_ms'])} | {f(d['added_p99_ms'])} | "
                f"{f(d['added_ttfb_p50_ms'])} | {f(d['calls_per_s'], 0)} "
                f"| {f(d['cpu_ms_per_call'].get('proxy'))} | {d['errors']} |{extra}"
            )
    out = ["", "## Gateway overhead vs LiteLLM (added = path − direct, median over rounds)", "", *lines]
    tc = report.get("turn_cost") or {}
    if tc:
        out += ["", f"Added latency at turn {report['plan']['turns']} vs turn 1 (HTTP, p50 per turn):", ""]
        for load, row in tc.items():
            for path, d in row.items():
                vals = list(d.values())
                out.append(
                    f"- {load} {path}: turn 1 {f(vals[0])} ms, turn {report['plan']['turns']} {f(vals[1])} ms"
                    f" (x{f(vals[2])}); turns 2-6 {f(vals[3])} ms, last 5 {f(vals[4])} ms (x{f(vals[5])})"
                )
    ss = report.get("server_side_turn_cost")
    if ss:
        turns = report["plan"]["turns"]
        out.append(
            f"- server side, in-process (parse + token memory): turn {turns} / turn 1 = "
            f"x{f(ss[f'ratio_turn{turns}_vs_turn1'])}; without token memory turn {turns} would cost "
            f"x{f(ss[f'turn{turns}_full_retokenize_vs_token_memory'])} more"
        )
    ttft = report.get("time_to_first_token")
    if ttft:
        step = ttft["decode_step_ms"]
        out += [
            "",
            f"Time to first token, the engine decoding {f(step, 0)} ms a token "
            f"(goal: within {f(GOAL_TTFT_STEPS, 0)} steps; met: {'yes' if ttft['goal_met'] else 'NO'}):",
            "",
            "| path | TTFT p50 ms | max ms | decode steps |",
            "|---|---:|---:|---:|",
        ]
        for dialect, d in ttft["dialects"].items():
            name = "direct (engine)" if dialect == "direct" else f"gateway, {dialect}"
            out.append(
                f"| {name} | {f(d['ttft_p50_ms'])} | {f(d['ttft_max_ms'])} | {f(d['in_decode_steps'])} |"
            )
    mem = report.get("memory")
    if mem:
        n, turns = mem["rollouts_with_full_history"], mem["turns"]
        rss = f"RSS {f(mem['rss_before_mb'], 1)} -> {f(mem['rss_after_mb'], 1)} MB"
        out.append(
            f"- memory per open rollout ({n} rollouts x {turns} turns): "
            f"{f(mem['kb_per_rollout'], 1)} KB ({rss})"
        )
    for c in report.get("server_crashes") or []:
        out.append(f"- CRASH: {c['server']} exited with {c['exit_code']} before {c['before']} (restarted)")
    la = report.get("load_average", {})
    out.append(
        f"- LiteLLM {report['litellm_version']}; run time {report['run_time_s']:.0f} s; machine load average "
        f"{la.get('start')} at start, {la.get('end')} at the end ({report['machine']['cpus']} CPUs)"
    )
    return "\n".join(out)


def _clean(o: Any) -> Any:
    """JSON without NaN: NaN becomes null; floats are rounded."""
    if isinstance(o, float):
        return None if o != o or o in (float("inf"), float("-inf")) else round(o, 3)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run of about 2 minutes")
    ap.add_argument(
        "--out",
        default=str(HERE / "results" / "gateway_overhead.json"),
        help="where the JSON goes ('-' for stdout)",
    )
    ap.add_argument("--shapes", default="small,harness", help="comma-separated subset of small,harness")
    ap.add_argument("--loads", default="1,64,512", help="comma-separated subset of the loads")
    ap.add_argument("--skip-memory", action="store_true", help="skip the memory-per-rollout phase")
    ap.add_argument("--skip-ttft", action="store_true", help="skip the time-to-first-token phase")
    ap.add_argument("--memory-rollouts", type=int, default=None, help="rollouts for the memory phase")
    ap.add_argument("--durability", choices=["full", "normal"], default="full", help="the gateway's store")
    ap.add_argument("--bench-venv", default=str(ROOT / ".venv-bench"), help="the venv with LiteLLM")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the gateway during the 512-client points (into the JSON)",
    )
    ap.add_argument("--workdir", default=None, help="keep logs and stores here (default: a temp dir)")
    ap.add_argument("--render", metavar="JSON", help="only print the markdown table of a saved result")
    args = ap.parse_args()
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return

    started = time.monotonic()
    load_start = round(os.getloadavg()[0], 2)  # other work on the machine shows up here
    plan = quick_plan() if args.quick else full_plan()
    shapes, loads = set(args.shapes.split(",")), {int(x) for x in args.loads.split(",")}
    plan.points = [p for p in plan.points if p.shape.split("_")[0] in shapes and p.load in loads]
    if args.memory_rollouts is not None:
        plan.memory_rollouts = args.memory_rollouts
    bench_venv = Path(args.bench_venv)
    bench_python, litellm_bin = str(bench_venv / "bin/python"), str(bench_venv / "bin/litellm")
    for exe in (bench_python, litellm_bin):
        if not Path(exe).exists():
            sys.exit(f"{exe} is missing: run `make bench` (it builds {bench_venv})")
    litellm_version = subprocess.run(
        [bench_python, "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()

    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))

    from transformers import AutoTokenizer

    from openforgerl.modelkit import cached_model

    model_dir = str(cached_model("tiny", 0))
    tok = AutoTokenizer.from_pretrained(model_dir)
    completion_ids = tok.encode(workload.FAKE_COMPLETION_TEXT, add_special_tokens=False)
    completion_ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
    assert tok.decode(completion_ids[:-1]) == workload.FAKE_COMPLETION_TEXT

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}; LiteLLM {litellm_version}; {'quick' if args.quick else 'full'} run")
    stack = Stack(work, model_dir, completion_ids, bench_python, litellm_bin, args.durability)
    gen: LoadGen | None = None
    report: dict[str, Any] = {
        "benchmark": "gateway_overhead",
        "mode": "quick" if args.quick else "full",
        "litellm_version": litellm_version,
        "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1)},
        "gateway_durability": args.durability,
        "plan": {
            "turns": plan.turns,
            "points": [vars(p) for p in plan.points],
            "memory_rollouts": plan.memory_rollouts,
        },
        "bodies_bytes": {
            "small": len(workload.bodies(workload.FAKE_MODEL, turns=1)["small"][0]),
            "harness_turn1": len(workload.bodies(workload.FAKE_MODEL, turns=plan.turns)["harness"][0]),
            "harness_last_turn": len(workload.bodies(workload.FAKE_MODEL, turns=plan.turns)["harness"][-1]),
        },
        "fake_completion_tokens": len(completion_ids),
    }
    try:
        stack.start_fake()
        stack.start_gateway()
        stack.start_litellm()
        gen = LoadGen(bench_python, work / "loadgen.log")
        log("servers up: " + ", ".join(f"{k} {v}" for k, v in stack.urls.items()))
        points: list[dict[str, Any]] = []
        for point in plan.points:
            log(f"point {point.shape} x {point.load} clients ({point.rounds} rounds)")
            pyspy = bench_venv / "bin" / "py-spy" if args.profile and point.load >= 512 else None
            if pyspy is not None and not pyspy.exists():
                log(f"  --profile: {pyspy} is missing (make bench installs it); not profiling")
                pyspy = None
            points.append(run_point(stack, gen, point, plan, pyspy))
        report["points"] = points
        report["server_crashes"] = stack.crashes
        report["turn_cost"] = turn_cost(points, plan.turns)
        report["foreign_connections"] = {k: s.foreign_connections() for k, s in stack.servers.items()}
        if not args.skip_ttft:
            log(f"time to first token per dialect, the engine decoding {TTFT_DELAY_MS:.0f} ms a token")
            text_ids = [*tok.encode(TTFT_TEXT, add_special_tokens=False), completion_ids[-1]]
            report["time_to_first_token"] = time_to_first_token(stack, 10 if args.quick else 30, text_ids)
        stack.servers.pop("gateway").stop()
        stack.servers.pop("litellm").stop()
        if "harness" in shapes:
            log("server-side turn cost (in process)")
            report["server_side_turn_cost"] = server_side_turn_cost(model_dir, plan.turns)
        if not args.skip_memory:
            log(f"memory per open rollout: {plan.memory_rollouts} rollouts x {plan.turns} turns")
            report["memory"] = memory_per_rollout(stack, gen, plan)
    finally:
        if gen is not None:
            gen.close()
        stack.stop()
    report["run_time_s"] = round(time.monotonic() - started, 1)
    report["load_average"] = {"start": load_start, "end": round(os.getloadavg()[0], 2)}
    report["client_bottleneck_note"] = (
        "client_cpu_util is the load generator's CPU time over the phase's wall time (1.0 = one core "
        "busy); near 1.0 the client, not the path, limits calls/s"
    )
    data = json.dumps(_clean(report), indent=1)
    if args.out == "-":
        print(data)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(data + "\n")
        log(f"JSON written to {out}")
    print(markdown(report))


if __name__ == "__main__":
    main()
