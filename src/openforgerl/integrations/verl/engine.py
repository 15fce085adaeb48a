"""The Engine protocol over veRL's server manager: the gateway's engine IS veRL's rollout servers.

veRL hands every agent loop a `server_manager` (an `LLMServerClient`) whose
`await generate(request_id, prompt_ids=..., sampling_params=...)` returns a `TokenOutput`
(`token_ids`, `log_probs`, `stop_reason`, `extra_fields["global_steps"]`). `VerlServerEngine`
puts our `Engine.generate(prompt_ids, SamplingParams)` on top of it, so the gateway samples from
the very servers veRL trains and syncs weights into.

The gateway runs on its own event loop (a thread); veRL's client belongs to the agent-loop
worker's loop. Each call is therefore submitted to the worker's loop and awaited from the
gateway's: veRL's client never leaves the loop it was made on.

No veRL import here: the manager and its output are duck-typed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from openforgerl.engines.base import (
    EngineBase,
    EngineError,
    EngineUnavailable,
    FinishReason,
    GenerateResult,
    Generation,
    SamplingParams,
)

_MOD = (1 << 61) - 1  # a Mersenne prime: 61-bit polynomial hashes of token prefixes
_BASE = 1_000_003


class ServerManager(Protocol):
    """What the engine needs of veRL's `LLMServerClient`."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> Any: ...


def _extend_hash(h: int, ids: Sequence[int]) -> int:
    for t in ids:
        h = (h * _BASE + int(t) + 1) % _MOD
    return h


@dataclass(frozen=True, slots=True)
class Route:
    request_id: str
    prompt_len: int
    prompt_hash: int  # hash of the whole prompt, extended by the completion in `remember`
    continued: bool  # the prompt continues an earlier call's sequence


class StickyRequestIds:
    """Request ids for veRL's sticky routing (same id -> same server -> its prefix cache).

    veRL routes by request id; an agent loop normally keeps one id per trajectory. Here the engine
    sees only token ids, so a call whose prompt starts with an earlier call's prompt + completion
    (the next turn of the same conversation) gets that call's id; anything else gets a fresh id and
    veRL's least-loaded choice. A wrong guess costs only cache hits, never correctness. Prefix
    hashes make a lookup O(prompt length + distinct remembered lengths).
    """

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self._tips: OrderedDict[tuple[int, int], str] = OrderedDict()  # (length, hash) -> request id
        self._lengths: Counter[int] = Counter()

    def route(self, prompt_ids: Sequence[int]) -> Route:
        prefix = [0] * (len(prompt_ids) + 1)
        for i, t in enumerate(prompt_ids):
            prefix[i + 1] = (prefix[i] * _BASE + int(t) + 1) % _MOD
        for n in sorted(self._lengths, reverse=True):  # the longest earlier sequence wins
            if n <= len(prompt_ids):
                key = (n, prefix[n])
                rid = self._tips.get(key)
                if rid is not None:
                    self._tips.move_to_end(key)
                    return Route(rid, len(prompt_ids), prefix[-1], True)
        return Route(uuid.uuid4().hex, len(prompt_ids), prefix[-1], False)

    def remember(self, route: Route, completion_ids: Sequence[int]) -> None:
        key = (route.prompt_len + len(completion_ids), _extend_hash(route.prompt_hash, completion_ids))
        if key not in self._tips:
            self._lengths[key[0]] += 1
        self._tips[key] = route.request_id
        self._tips.move_to_end(key)
        while len(self._tips) > self.capacity:
            (n, _), _ = self._tips.popitem(last=False)
            self._lengths[n] -= 1
            if not self._lengths[n]:
                del self._lengths[n]

    def __len__(self) -> int:
        return len(self._tips)


class VerlServerEngine(EngineBase):
    """Our Engine over veRL's server manager (see the module doc).

    Args:
        server_manager: veRL's `LLMServerClient` (or anything with its `generate`).
        loop: the event loop the manager belongs to (the agent-loop worker's).
        max_context: prompt + completion limit the gateway enforces (veRL's max model length).
        base_params: sampling settings the gateway does not carry (veRL's `top_k`,
            `repetition_penalty`); temperature, top_p, max_tokens, stop ids and seed come per call.

    Stop *strings* are not forwarded: veRL starts vLLM with `skip_tokenizer_init`, so the server
    cannot match text; the stop token ids (the chat template's turn end) are forwarded.
    """

    name = "verl"
    supports_response_format = False

    def __init__(
        self,
        server_manager: ServerManager,
        loop: asyncio.AbstractEventLoop,
        *,
        max_context: int,
        base_params: Mapping[str, Any] | None = None,
        sticky_capacity: int = 8192,
    ) -> None:
        self.server_manager = server_manager
        self.loop = loop
        self.max_context = max_context
        self.base_params = dict(base_params or {})
        self.routes = StickyRequestIds(sticky_capacity)
        self._version = 0
        self.stats: Counter[str] = Counter()

    @property
    def policy_version(self) -> int:
        """The trainer step of the weights that served the latest call (veRL's `global_steps`)."""
        return self._version

    async def start(self) -> None:
        return None  # veRL starts and owns the servers

    async def close(self) -> None:
        return None

    async def load_weights(self, path: str) -> int:
        raise EngineError("veRL syncs the rollout servers' weights itself; the gateway does not load any")

    def verl_params(self, sampling: SamplingParams) -> dict[str, Any]:
        """Our sampling as veRL's `sampling_params` (keys both vLLM and SGLang servers take)."""
        params = dict(self.base_params)
        params.update(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            logprobs=True,  # the behaviour logprobs are what the trainer corrects against
        )
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        return params

    def refuses_images(self) -> str | None:
        return "the veRL engine does not pass images to veRL's servers yet"

    async def _generate(self, call: Generation) -> GenerateResult:
        prompt_ids, sampling = call.prompt_ids, call.sampling
        if self.loop.is_closed() or not self.loop.is_running():
            raise EngineUnavailable("the veRL agent-loop worker's event loop is not running")
        route = self.routes.route(prompt_ids)
        params = self.verl_params(sampling)
        request = self.server_manager.generate(
            route.request_id, prompt_ids=prompt_ids, sampling_params=params
        )
        try:
            future = asyncio.run_coroutine_threadsafe(request, self.loop)
        except RuntimeError as exc:  # the loop closed in between
            request.close()
            raise EngineUnavailable(f"the veRL agent-loop worker's event loop is gone: {exc}") from exc
        try:
            out = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # the harness went away: abort the request on veRL's side too
            raise
        except Exception as exc:
            self.stats["errors"] += 1
            raise EngineError(f"veRL's server manager failed: {type(exc).__name__}: {exc}") from exc
        result = self.to_result(out, sampling)
        self.stats["calls"] += 1
        self.stats["continued"] += route.continued
        self.routes.remember(route, result.completion_ids)
        result.extra["request_id"] = route.request_id
        return result

    def to_result(self, out: Any, sampling: SamplingParams) -> GenerateResult:
        """veRL's TokenOutput -> our GenerateResult (finish reason from the ids and the budget)."""
        ids = [int(t) for t in out.token_ids]
        logprobs = out.log_probs
        if logprobs is None or len(logprobs) != len(ids):
            got = "none" if logprobs is None else len(logprobs)
            raise EngineError(
                f"veRL returned {got} logprobs for {len(ids)} tokens; the gateway needs one per token "
                "(actor_rollout_ref.rollout.calculate_log_probs=true)"
            )
        extra: dict[str, object] = dict(getattr(out, "extra_fields", None) or {})
        steps = extra.get("global_steps")
        if isinstance(steps, int) and not isinstance(steps, bool):
            self._version = steps
        stop_reason: int | None = None
        finish: FinishReason
        if out.stop_reason in ("aborted", "abort"):
            finish = "abort"
        elif ids and ids[-1] in sampling.stop_token_ids:
            finish, stop_reason = "stop", ids[-1]
        elif out.stop_reason == "length" or len(ids) >= sampling.max_tokens:
            finish = "length"
        else:
            finish = "stop"  # the model's EOS (veRL reports stop and length alike as "completed")
        if getattr(out, "num_preempted", None) is not None:
            extra["num_preempted"] = out.num_preempted
        return GenerateResult(ids, [float(x) for x in logprobs], finish, self._version, stop_reason, extra)
