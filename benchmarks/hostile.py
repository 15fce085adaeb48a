"""A hostile mix: does one heavy client stall everybody else, and is memory handed back after it?

Two gateways side by side in one run, each in its own process, in front of the ZERO-LATENCY FAKE
engine (benchmarks/fake_engine.py), with the tiny model's tokenizer and chat template:

    loop     `openforge gateway --work-threads 0`: parsing, rendering and tokenising on the event
             loop (how the gateway worked before issue #24)
    workers  `openforge gateway` (the default: that work on 2 worker threads)

Each round runs both (order alternating), for `--duration` seconds each: one client sends heavy
requests back to back (one user message of `--heavy-mb` MB: seconds of rendering and tokenising),
`--normal` clients make small chat calls, and a prober GETs /health every 50 ms. Reported per
gateway, as medians over rounds: /health p50/p99/max, the normal calls' p50/p99, and the ratio of
the loop gateway's figures to the workers gateway's.

Memory: a fresh gateway's RSS (default settings) idle, at its peak and at the end of `--large`
large requests (`--large-kb` KB of prompt each, sequential), and 5 s after the last (freed memory
is handed back to the OS a second after heavy work stops).

    .venv/bin/python benchmarks/hostile.py                 # the full run (about 12 minutes)
    .venv/bin/python benchmarks/hostile.py --quick         # a smoke run (about 2 minutes)

Prints one JSON object; with --out, also writes it there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402
from gateway_overhead import ADMIN_TOKEN, Server, free_port  # noqa: E402

CONFIGS = {"loop": ["--work-threads", "0"], "workers": []}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gateway(name: str, work: Path, model_dir: str, engine_url: str, extra: list[str]) -> tuple[Server, str]:
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("openforge")),
        "gateway",
        *("--model", model_dir, "--engine", f"vllm:{engine_url}", "--port", str(port)),
        *("--store", str(work / f"{name}.db"), "--admin-token", ADMIN_TOKEN),
        *("--max-context", "262144", "--max-tokens", "64", "--durability", "normal"),
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    return Server(name, cmd, url + "/health", work / f"{name}.log"), url


def rollout(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/admin/rollouts", json={}, headers=ADMIN, timeout=30)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def chat_body(text: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def heavy_text(mb: float) -> str:
    """Varied prose, so tokenising costs what real text costs (a repeated word is cheaper)."""
    words = "the gateway records every call at token level while harnesses run their tools".split()
    out, size, i = [], 0, 0
    while size < mb * 1e6:
        w = f"{words[i % len(words)]}{i % 977}"
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)


def phase(url: str, duration: float, normal: int, heavy: bytes) -> dict[str, Any]:
    """One gateway under the mix for `duration` seconds."""
    stop = threading.Event()
    health: list[float] = []
    calls: list[float] = []
    heavy_done: list[float] = []

    def prober() -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(url + "/health").raise_for_status()
                health.append(time.perf_counter() - t)
                time.sleep(0.05)

    def client(body: bytes, sink: list[float]) -> None:
        ro = rollout(url)
        headers = {"authorization": f"Bearer {ro['api_key']}", "content-type": "application/json"}
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.post(ro["base_url"] + "/v1/chat/completions", content=body, headers=headers)
                if r.status_code not in (200, 400):  # 400: a heavy prompt over the context, after the work
                    raise RuntimeError(r.text[:300])
                sink.append(time.perf_counter() - t)

    threads = [threading.Thread(target=prober), threading.Thread(target=client, args=(heavy, heavy_done))]
    threads += [threading.Thread(target=client, args=(chat_body("Hi there."), calls)) for _ in range(normal)]
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join()
    return {
        "health_p50_ms": 1000 * percentile(health, 0.5),
        "health_p99_ms": 1000 * percentile(health, 0.99),
        "health_max_ms": 1000 * max(health),
        "health_probes": len(health),
        "normal_p50_ms": 1000 * percentile(calls, 0.5),
        "normal_p99_ms": 1000 * percentile(calls, 0.99),
        "normal_calls": len(calls),
        "heavy_requests": len(heavy_done),
        "heavy_p50_s": percentile(heavy_done, 0.5),
    }


def memory(server: Server, url: str, large: int, large_kb: float) -> dict[str, Any]:
    ro = rollout(url)
    headers = {"authorization": f"Bearer {ro['api_key']}", "content-type": "application/json"}
    before = server.rss()
    peak = before
    with httpx.Client(timeout=300) as c:
        for i in range(large):
            body = chat_body(f"request {i}: " + heavy_text(large_kb / 1000))
            r = c.post(ro["base_url"] + "/v1/chat/completions", content=body, headers=headers)
            if r.status_code not in (200, 400):
                raise RuntimeError(r.text[:300])
            peak = max(peak, server.rss())
    at_end = server.rss()
    time.sleep(5)
    return {
        "large_requests": large,
        "large_kb": large_kb,
        "rss_before_mb": before / 2**20,
        "rss_peak_mb": peak / 2**20,
        "rss_at_end_mb": at_end / 2**20,
        "rss_5s_later_mb": server.rss() / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per gateway per round")
    ap.add_argument("--normal", type=int, default=4, help="clients making small calls")
    ap.add_argument("--heavy-mb", type=float, default=2.0)
    ap.add_argument("--large", type=int, default=1000)
    ap.add_argument("--large-kb", type=float, default=256.0)
    ap.add_argument("--quick", action="store_true", help="1 round of 15 s, 100 large requests")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration, args.large = 1, 15.0, 100

    from transformers import AutoTokenizer

    from openforgerl.modelkit import cached_model

    model_dir = str(cached_model("tiny", 0))
    tok = AutoTokenizer.from_pretrained(model_dir)
    completion = [*tok.encode(workload.FAKE_COMPLETION_TEXT, add_special_tokens=False)]
    completion.append(tok.convert_tokens_to_ids("<|im_end|>"))

    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    port = free_port()
    fake_cmd = [sys.executable, str(HERE / "fake_engine.py"), "--port", str(port)]
    fake = Server("fake", [*fake_cmd, "--completion-ids", json.dumps(completion)], "", work / "fake.log")
    fake.health_url = f"http://127.0.0.1:{port}/health"
    servers = {"fake": fake}
    urls: dict[str, str] = {}
    try:
        fake.start()
        for name, extra in CONFIGS.items():
            servers[name], urls[name] = gateway(name, work, model_dir, f"http://127.0.0.1:{port}", extra)
            servers[name].start()
        servers["memory"], urls["memory"] = gateway("memory", work, model_dir, f"http://127.0.0.1:{port}", [])
        servers["memory"].start()
        heavy = chat_body(heavy_text(args.heavy_mb))
        idle = {}
        for name in CONFIGS:
            url = urls[name]
            with httpx.Client() as c:
                samples = []
                for _ in range(50):
                    t = time.perf_counter()
                    c.get(url + "/health")
                    samples.append(time.perf_counter() - t)
            idle[name] = 1000 * statistics.median(samples)
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
        for r in range(args.rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for name in order:
                rounds[name].append(phase(urls[name], args.duration, args.normal, heavy))
                print(f"round {r + 1} {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
        summary = {
            name: {k: statistics.median(p[k] for p in phases) for k in phases[0]}
            | {"idle_health_ms": idle[name]}
            for name, phases in rounds.items()
        }
        ratios = {
            k: summary["loop"][k] / summary["workers"][k]
            for k in ("health_p50_ms", "health_p99_ms", "health_max_ms", "normal_p50_ms", "normal_p99_ms")
        }
        result = {
            "benchmark": "hostile",
            "heavy_mb": args.heavy_mb,
            "normal_clients": args.normal,
            "rounds": args.rounds,
            "duration_s": args.duration,
            "configs": {name: " ".join(extra) or "(defaults)" for name, extra in CONFIGS.items()},
            "summary": summary,
            "loop_over_workers": ratios,
            "memory": memory(servers["memory"], urls["memory"], args.large, args.large_kb),
            "rounds_detail": rounds,
        }
    finally:
        for server in servers.values():
            if server.proc is not None:
                server.proc.terminate()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
