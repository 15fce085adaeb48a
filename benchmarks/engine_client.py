"""The gateway's engine client, old (httpx) vs new (aiohttp), against the ZERO-LATENCY FAKE engine.

A side experiment of the gateway-overhead benchmark: this puts the engine call (a token-id prompt
POSTed to /v1/completions, the JSON answer parsed) under N concurrent callers that each also burn
some CPU per call, as the gateway does around each engine call, and reports the engine-call latency
and the calls per second, for each client:

- `httpx`: a bare httpx.AsyncClient configured as engines/http.py had it before #25 (the old client);
- `aiohttp`: a bare aiohttp.ClientSession with no connection cap;
- `engine`: the engine itself, `VLLMEngine.generate` (engines/http.py on aiohttp: body built, answer
  mapped onto a GenerateResult);
- `engine-stream`: the same with `on_tokens`, i.e. the streamed request (one SSE event per token).

Runs in the main venv (it has both clients and openforgerl); starts its own fake engine on a free port:

    PYTHONPATH=src .venv/bin/python benchmarks/engine_client.py --concurrency 1 64 --prompt-tokens 500 27000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from openforgerl.engines.base import SamplingParams
from openforgerl.engines.vllm import VLLMEngine

HERE = Path(__file__).resolve().parent
KINDS = ("httpx", "aiohttp", "engine", "engine-stream")


def burn(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


async def trial(
    kind: str, url: str, concurrency: int, prompt_tokens: int, work_ms: float, seconds: float
) -> dict[str, Any]:
    body = orjson.dumps(
        {"model": "fake-model", "prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": 64}
    )
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    if kind == "httpx":  # as engines/http.py configured it before #25
        hclient = httpx.AsyncClient(
            timeout=60, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )

        async def post() -> None:
            r = await hclient.post(url, content=body, headers=headers)
            orjson.loads(r.content)

        close: Any = hclient.aclose
    elif kind == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def post() -> None:
            async with session.post(url, data=body, headers=headers) as r:
                orjson.loads(await r.read())

        close = session.close
    else:
        engine = VLLMEngine(url.removesuffix("/v1/completions"), model="fake-model", max_context=1 << 20)
        prompt = list(range(1000, 1000 + prompt_tokens))
        sampling = SamplingParams(max_tokens=64)
        sink = (lambda ids: None) if kind == "engine-stream" else None

        async def post() -> None:
            await engine.generate(prompt, sampling, on_tokens=sink)

        close = engine.close
    deadline = time.perf_counter() + seconds

    async def caller() -> None:
        while time.perf_counter() < deadline:
            burn(work_ms)  # parse + token memory before the engine call
            t = time.perf_counter()
            await post()
            latencies.append((time.perf_counter() - t) * 1000)
            burn(work_ms / 2)  # parse the completion, record, answer

    try:
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    finally:
        await close()
    s = sorted(latencies)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))], 1) if s else float("nan")

    return {
        "client": kind,
        "concurrency": concurrency,
        "prompt_tokens": prompt_tokens,
        "calls_per_s": round(len(s) / seconds, 1),
        "engine_call_p50_ms": q(0.5),
        "engine_call_p99_ms": q(0.99),
        "engine_call_max_ms": q(1.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[500, 27000])
    ap.add_argument("--work-ms", type=float, default=2.0, help="CPU burnt per call before the engine call")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--clients", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--main-python", default=sys.executable, help="the python that runs the fake engine")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = subprocess.Popen(
        [
            args.main_python,
            str(HERE / "fake_engine.py"),
            "--port",
            str(port),
            "--completion-ids",
            "[1, 2, 3]",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        rows = []
        for c in args.concurrency:
            for n in args.prompt_tokens:
                for kind in args.clients:
                    row = asyncio.run(trial(kind, url + "/v1/completions", c, n, args.work_ms, args.seconds))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
        print(json.dumps(rows, indent=1))
    finally:
        fake.terminate()
        fake.wait(timeout=10)


if __name__ == "__main__":
    main()
