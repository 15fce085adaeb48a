"""The load generator of the gateway-overhead benchmark: its own process, asyncio + aiohttp on uvloop.

Runs in .venv-bench (aiohttp comes with LiteLLM there). The driver (gateway_overhead.py) talks to
it over stdin/stdout, one JSON object a line: a phase to run in, the phase's samples out. It only
ever connects to the URLs it is given (loopback addresses).

Per phase the driver sends the spec, the load generator warms up and prepares (rollouts, history)
and answers; the driver reads the servers' CPU counters and sends {"cmd": "go"}; the timed part
runs and its samples come back. A phase: `concurrency` streaming clients, each in a loop that is
bounded in count and in time.

- shape "small": each client sends the small body `per_client` times.
- shape "harness": the clients take conversations off a shared counter until `conversations` are
  done; a conversation is turns 1..`turns` sent one after another (the next turn only after the
  answer to the previous), on the gateway in a rollout of its own.
- shape "harness_mid": each client sends `per_client` consecutive turns from the middle of a
  conversation (start turns spread over the conversation); on the gateway its rollout first gets
  the conversation so far in one untimed call, so the timed turns go through the token memory.

Latency is measured from just before the request is written to the end of the response body
(the SSE stream's `[DONE]`); time to first byte is the first body chunk.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import aiohttp
import orjson

from workload import FAKE_MODEL, GATEWAY_MODEL, LITELLM_MODEL, bodies

MODELS = {"direct": FAKE_MODEL, "gateway": GATEWAY_MODEL, "litellm": LITELLM_MODEL}


class Phase:
    def __init__(self, session: aiohttp.ClientSession, spec: dict[str, Any], payloads: list[bytes]) -> None:
        self.session = session
        self.spec = spec
        self.payloads = payloads
        self.deadline = 0.0
        # One sample per request: (turn, latency ms, ttfb ms, ok, end time since the phase start).
        self.samples: list[tuple[int, float, float, bool, float]] = []
        self.errors: dict[str, int] = {}
        self.t0 = 0.0
        self.prepared = 0
        self.ready = asyncio.Event()
        self.tasks: list[asyncio.Future[None]] = []

    async def create_rollout(self) -> tuple[str, str]:
        """(chat completions URL, api key) of a new gateway rollout."""
        async with self.session.post(
            self.spec["admin_url"] + "/admin/rollouts",
            data=b'{"run_id": "bench"}',
            headers={
                "authorization": f"Bearer {self.spec['admin_token']}",
                "content-type": "application/json",
            },
        ) as r:
            data = orjson.loads(await r.read())
            if r.status != 201:
                raise RuntimeError(f"creating a rollout failed: HTTP {r.status} {data}")
        return data["base_url"] + "/v1/chat/completions", data["api_key"]

    async def endpoint(self) -> tuple[str, str]:
        if self.spec["path"] == "gateway":
            return await self.create_rollout()
        return self.spec["url"], self.spec["api_key"]

    async def call(self, url: str, key: str, body: bytes, turn: int) -> None:
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        start = time.perf_counter()
        ttfb = 0.0
        ok = False
        try:
            async with self.session.post(url, data=body, headers=headers) as r:
                buf = bytearray()
                async for chunk in r.content.iter_any():
                    if not buf:
                        ttfb = time.perf_counter() - start
                    buf += chunk
                end = time.perf_counter()
                tail = bytes(buf[-2000:])
                if r.status != 200:
                    self._error(f"HTTP {r.status}: {bytes(buf[:200])!r}")
                elif not tail.endswith(b"data: [DONE]\n\n") or b'"usage"' not in tail:
                    self._error(f"incomplete stream: {tail[-200:]!r}")
                elif b'"error"' in buf:
                    self._error(f"error event: {bytes(buf[-300:])!r}")
                else:
                    ok = True
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            end = time.perf_counter()
            self._error(f"{type(exc).__name__}: {exc}")
        self.samples.append((turn, (end - start) * 1000, ttfb * 1000, ok, end - self.t0))

    def _error(self, what: str) -> None:
        key = what[:160]
        self.errors[key] = self.errors.get(key, 0) + 1

    async def small_client(self) -> None:
        url, key = await self.endpoint()
        self.prepared += 1
        await self.ready.wait()
        for _ in range(self.spec["per_client"]):
            if time.perf_counter() > self.deadline:
                return
            await self.call(url, key, self.payloads[0], 0)

    async def harness_client(self, counter: list[int]) -> None:
        """Whole conversations, turn 1 to the last, one rollout each."""
        turns = self.spec["turns"]
        # The first conversation's rollout is made before the clock starts; later ones on the way.
        first: tuple[str, str] | None = await self.endpoint()
        self.prepared += 1
        await self.ready.wait()
        while counter[0] < self.spec["conversations"] and time.perf_counter() < self.deadline:
            counter[0] += 1
            url, key = first or await self.endpoint()
            first = None
            for turn in range(1, turns + 1):
                if time.perf_counter() > self.deadline:
                    return
                await self.call(url, key, self.payloads[turn - 1], turn)

    async def harness_mid_client(self, index: int, setup: asyncio.Semaphore) -> None:
        """`per_client` consecutive turns from the middle of a conversation (steady state).

        Client i starts at a turn spread evenly over [2, turns - per_client + 1]. On the gateway the
        rollout first gets the conversation so far in one untimed call (a new branch), so the timed
        turns extend it through the token memory, as they would after turns 1..start-1.
        """
        turns, k, n = self.spec["turns"], self.spec["per_client"], self.spec["concurrency"]
        span = max(0, turns - k - 1)
        start = 2 + (index * span) // max(1, n - 1) if span else 2
        start = min(start, max(1, turns - k + 1))
        async with setup:
            url, key = await self.endpoint()
            if self.spec["path"] == "gateway" and start > 1:
                self.t0, self.deadline = time.perf_counter(), time.perf_counter() + 120
                await self.call(url, key, self.payloads[start - 2], -(start - 1))
        self.prepared += 1
        await self.ready.wait()
        for turn in range(start, min(turns, start + k - 1) + 1):
            if time.perf_counter() > self.deadline:
                return
            await self.call(url, key, self.payloads[turn - 1], turn)

    async def prepare(self) -> dict[str, Any]:
        """Warm-up, rollouts and (mid-conversation) history: everything before the clock starts."""
        n = self.spec["concurrency"]
        if self.spec.get("warmup", True):
            await self.warmup(n)
        self.prepared = 0
        shape = self.spec["shape"]
        if shape == "small":
            self.tasks = [asyncio.ensure_future(self.small_client()) for _ in range(n)]
        elif shape == "harness_mid":
            setup = asyncio.Semaphore(32)
            self.tasks = [asyncio.ensure_future(self.harness_mid_client(i, setup)) for i in range(n)]
        else:
            counter = [0]
            self.tasks = [asyncio.ensure_future(self.harness_client(counter)) for _ in range(n)]
        setup_deadline = time.perf_counter() + 300
        while self.prepared < n and time.perf_counter() < setup_deadline:
            failed = next((t for t in self.tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                raise RuntimeError(f"a client failed during setup: {failed.exception()!r}")
            await asyncio.sleep(0.01)
        setup_samples = [s for s in self.samples if s[0] < 0]
        self.samples, self.errors = [], {}
        return {
            "prepared": self.prepared,
            "setup_calls": len(setup_samples),
            "setup_errors": sum(1 for s in setup_samples if not s[3]),
        }

    async def go(self) -> dict[str, Any]:
        """The timed part: start every client at once and wait for them (bounded in time)."""
        cpu0, self.t0 = time.process_time(), time.perf_counter()
        self.deadline = self.t0 + self.spec["duration_s"]
        self.ready.set()
        await asyncio.wait(self.tasks, timeout=self.spec["duration_s"] + 60)
        for t in self.tasks:
            t.cancel()
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - cpu0
        ends = [s[4] for s in self.samples]
        return {
            "samples": self.samples,
            "errors": self.errors,
            "wall_s": wall,
            "active_s": max(ends) if ends else wall,
            "client_cpu_s": cpu,
        }

    async def warmup(self, n: int) -> None:
        """Open the connections this phase will use (n concurrent small calls, not timed)."""
        url, key = await self.endpoint()
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + 60
        small = bodies(MODELS[self.spec["path"]], turns=1)["small"][0]
        await asyncio.gather(*(self.call(url, key, small, 0) for _ in range(n)))
        self.samples = []
        self.errors = {}


def write(obj: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


async def main() -> None:
    import uvloop  # noqa: F401  (installed with LiteLLM's proxy extra)

    payloads = {path: bodies(model) for path, model in MODELS.items()}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=300, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=300, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        write({"ready": True})
        while line := await reader.readline():
            spec = orjson.loads(line)
            if spec.get("cmd") == "quit":
                break
            shape = spec["shape"]
            turns = spec.get("turns", 30)
            body_list = payloads[spec["path"]]["small" if shape == "small" else "harness"]
            spec.setdefault("turns", turns)
            spec.setdefault("per_client", 1_000_000)
            spec.setdefault("conversations", spec["concurrency"])
            try:
                phase = Phase(session, spec, body_list[:turns])
                reply = await phase.prepare()
            except Exception as exc:
                reply = {"fatal": f"{type(exc).__name__}: {exc}"}
            write(reply)
            if "fatal" in reply:
                continue
            # The driver reads the servers' CPU counters, then says go.
            go = await reader.readline()
            if orjson.loads(go or b"{}").get("cmd") != "go":
                break
            try:
                result = await phase.go()
            except Exception as exc:
                result = {"fatal": f"{type(exc).__name__}: {exc}"}
            write(result)


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
