"""Shared pieces of the gateway tests: a scripted engine and a gateway-in-a-thread fixture."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from openforgerl.engines.base import EngineUnavailable, GenerateResult, SamplingParams, TokenSink
from openforgerl.gateway.server import GatewayConfig
from openforgerl.rl.prompt_tools import text_reply
from openforgerl.testing.gateway import RunningGateway, gateway_thread


class ScriptEngine:
    """A SCRIPTED engine for deterministic tests: answers with texts a test chooses, encoded with the
    real tokenizer and ended with the turn-end token, as a model would sample them. A streamed call
    gets its ids one at a time, as a model samples them; `between_tokens(n)`, when set, is awaited
    after the n-th (a test holds the generation there to see what its client was sent)."""

    name = "scripted"
    max_context = 4096
    supports_response_format = False

    def __init__(self, model_dir: str | Path, script: Callable[[list[int]], str] | None = None) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.script = script or (lambda prompt: "Hello from the script.")
        self.end_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: list[list[int]] = []
        self.down = False
        self.delay = 0.0
        self.cancelled = 0
        self._version = 0
        self.between_tokens: Callable[[int], Awaitable[None]] | None = None

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def load_weights(self, path: str) -> int:
        self._version += 1
        return self._version

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: Any = (),
        on_tokens: TokenSink | None = None,
    ) -> GenerateResult:
        if self.down:
            raise EngineUnavailable("scripted outage", retry_after=2)
        self.prompts.append(list(prompt_ids))
        result = text_reply(
            self.tokenizer, self.end_id, self.script(prompt_ids), sampling, self._version, -0.5
        )
        try:
            await asyncio.sleep(self.delay)
            if on_tokens is not None:
                for n, token in enumerate(result.completion_ids, start=1):
                    on_tokens((token,))
                    await (self.between_tokens(n) if self.between_tokens else asyncio.sleep(0))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return result


@contextmanager
def running_gateway(
    model_dir: str | Path, tmp_path: Path, engine: Any = None, **cfg: Any
) -> Iterator[RunningGateway]:
    config = GatewayConfig(model=str(model_dir), store=str(tmp_path / "gw.db"), port=0, **cfg)
    with gateway_thread(config, engine) as gw:
        yield gw


def new_rollout(gw: RunningGateway, **body: Any) -> dict[str, Any]:
    r = httpx.post(gw.url + "/admin/rollouts", json=body, headers=gw.admin_headers, timeout=30)
    assert r.status_code == 201, r.text
    data: dict[str, Any] = r.json()
    return data


def calls_of(gw: RunningGateway, rollout_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{gw.url}/admin/rollouts/{rollout_id}/calls", headers=gw.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    calls: list[dict[str, Any]] = r.json()["calls"]
    return calls
