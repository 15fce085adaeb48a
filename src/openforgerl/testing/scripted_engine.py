"""ScriptedEngine: an Engine whose completions are given, not sampled (tests and benchmarks only).

    engine = ScriptedEngine(completion=[11, 12, 13, 2], eos_token_id=2)      # the same reply every time
    engine = ScriptedEngine(script=[[5, 6], Scripted([7], finish_reason="length")])  # replies in turn
    engine = ScriptedEngine(script=lambda req: [len(req.prompt_ids)])        # computed from the request
    engine = ScriptedEngine(script=lambda req: EngineOverloaded("busy"))     # an error, raised

It applies `max_tokens`, `stop_token_ids` and the EOS id like a real engine would (the id that stops
generation is kept in `completion_ids`), and, given `decode`, stop strings. Without latency set it
never sleeps, so it measures the gateway, not the model.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from openforgerl.engines.base import (
    EngineBase,
    EngineError,
    FinishReason,
    GenerateResult,
    Generation,
    SamplingParams,
)
from openforgerl.images import Image


@dataclass(slots=True, frozen=True)
class Scripted:
    """One scripted completion. `finish_reason` None means: decided by max_tokens, stops and EOS,
    and "stop" when the ids simply run out (as if the model had ended its turn)."""

    ids: Sequence[int]
    logprobs: Sequence[float] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True, frozen=True)
class ScriptRequest:
    """What a script callback sees."""

    prompt_ids: list[int]
    sampling: SamplingParams
    policy_version: int
    weights_path: str | None
    index: int  # 0 for the engine's first generate call, then 1, 2, ...
    images: tuple[Image, ...] = ()  # the prompt's images, in order


ScriptItem = Scripted | Sequence[int] | BaseException
ScriptFn = Callable[[ScriptRequest], ScriptItem]

DEFAULT_COMPLETION: tuple[int, ...] = tuple(range(100, 116))


class ScriptedEngine(EngineBase):
    """An Engine that replays scripted completions.

    Args:
        script: a callback (ScriptRequest -> ids | Scripted | exception to raise), or a sequence of
            items used in turn (an EngineError once exhausted); None = `completion` for every call.
        completion: the ids returned when there is no script.
        logprob: the logprob reported for each id that has none given.
        eos_token_id: an id that ends generation (kept as the last id), like a model's EOS.
        decode: ids -> text, needed only to honour stop strings.
        latency_s: seconds each call waits before answering (for cancellation and timeout tests).
        token_latency_s: extra seconds per returned id (a streamed call gets each id after its wait).
        between_tokens: awaited after each id a streamed call was given, with the count given so far
            (tests hold a generation there, to see what a client was sent before it ended).
        policy_version: the starting version; `load_weights` adds one.
    """

    name = "scripted"
    max_context: int | None = None  # no limit of its own: the gateway's applies
    supports_response_format = False

    def __init__(
        self,
        script: ScriptFn | Sequence[ScriptItem] | None = None,
        *,
        completion: Sequence[int] = DEFAULT_COMPLETION,
        logprob: float = -0.5,
        eos_token_id: int | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        latency_s: float = 0.0,
        token_latency_s: float = 0.0,
        between_tokens: Callable[[int], Awaitable[None]] | None = None,
        policy_version: int = 0,
    ) -> None:
        self._fn: ScriptFn | None = None
        self._queue: deque[ScriptItem] | None = None
        if callable(script):
            self._fn = script
        elif script is not None:
            self._queue = deque(script)
        self.completion = list(completion)
        self.logprob = logprob
        self.eos_token_id = eos_token_id
        self.decode = decode
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        self.between_tokens = between_tokens
        self._version = policy_version
        self.weights_path: str | None = None
        self.started = False
        self.closed = False
        self.calls = 0  # generate calls made
        self.cancelled = 0  # generate calls cancelled while waiting
        self.last_request: ScriptRequest | None = None
        # The default reply's logprobs, built once: the benchmark path allocates nothing per call.
        self._default_logprobs = [logprob] * len(self.completion)

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def load_weights(self, path: str) -> int:
        self.weights_path = path
        self._version += 1
        return self._version

    def _next_item(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> ScriptItem:
        req = ScriptRequest(prompt_ids, sampling, self._version, self.weights_path, self.calls, tuple(images))
        self.last_request = req
        if self._fn is not None:
            return self._fn(req)
        if self._queue is not None:
            if not self._queue:
                raise EngineError("ScriptedEngine: the script ran out of completions")
            return self._queue.popleft()
        return self.completion

    async def _generate(self, call: Generation) -> GenerateResult:
        """Images are accepted (a script stands in for any model) and shown to the script in its request."""
        sampling, on_tokens = call.sampling, call.on_tokens
        item = self._next_item(call.prompt_ids, sampling, call.images)
        self.calls += 1
        if isinstance(item, BaseException):
            raise item
        scripted = item if isinstance(item, Scripted) else Scripted(item)
        result = self._apply(scripted, sampling)
        try:
            if on_tokens is None:
                delay = self.latency_s + self.token_latency_s * len(result.completion_ids)
                if delay > 0:
                    await asyncio.sleep(delay)
                return result
            if self.latency_s > 0:
                await asyncio.sleep(self.latency_s)
            for n, token in enumerate(result.completion_ids, start=1):
                if self.token_latency_s > 0:
                    await asyncio.sleep(self.token_latency_s)
                on_tokens((token,))
                if self.between_tokens is not None:
                    await self.between_tokens(n)
            return result
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def _apply(self, s: Scripted, sampling: SamplingParams) -> GenerateResult:
        ids = list(s.ids)
        if s.logprobs is not None:
            logprobs = list(s.logprobs)
            if len(logprobs) != len(ids):
                raise EngineError(f"scripted {len(ids)} ids but {len(logprobs)} logprobs")
        elif ids == self.completion:
            logprobs = list(self._default_logprobs)
        else:
            logprobs = [self.logprob] * len(ids)
        finish: FinishReason = s.finish_reason or "stop"
        stop_reason: str | int | None = s.stop_reason
        if s.finish_reason is None:
            cut, stop_reason = self._find_stop(ids, sampling)
            if cut is not None:
                ids, logprobs = ids[:cut], logprobs[:cut]
            elif len(ids) > sampling.max_tokens:
                ids, logprobs = ids[: sampling.max_tokens], logprobs[: sampling.max_tokens]
                finish = "length"
        return GenerateResult(ids, logprobs, finish, self._version, stop_reason)

    def _find_stop(self, ids: list[int], sampling: SamplingParams) -> tuple[int | None, str | int | None]:
        """Where generation would stop within max_tokens: (ids kept, stop reason) or (None, None)."""
        limit = min(len(ids), sampling.max_tokens)
        stop_ids = set(sampling.stop_token_ids)
        if self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        check_text = bool(sampling.stop) and self.decode is not None
        for i in range(limit):
            if ids[i] in stop_ids:
                return i + 1, ids[i]
            if check_text:
                assert self.decode is not None
                text = self.decode(ids[: i + 1])
                for stop in sampling.stop:
                    if stop in text:
                        return i + 1, stop
        return None, None
