"""The one protocol every inference engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from openforgerl.images import Image


def engine_setting(more: str = "") -> Any:
    """The engine spec (what `engines.make_engine` takes) as a setting, declared once for every
    config that starts an engine (the gateway's, eval's, train's); `more` ends its help."""
    from openforgerl.settings import setting

    return setting(
        "builtin",
        "builtin (transformers, this process), vllm (a vLLM server on loopback that the run starts and "
        "stops, from OPENFORGE_VLLM_PYTHON or ./.venv-vllm), vllm:URL or sglang:URL (a running "
        f"server){more}.",
    )


FinishReason = Literal["stop", "length", "abort"]
# A server's finish reason by name (vLLM's and SGLang's use these); any other is recorded as "abort".
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
PREFIX_CACHE_MB = 512.0  # the built-in engine's prefix cache unless told otherwise


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Sampling actually used for one generation (after the run's policy was applied)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # A structured-output request (OpenAI `response_format` shape), for engines that can constrain
    # decoding to it; the others ignore it and the record says it was not honoured.
    response_format: dict[str, Any] | None = field(default=None, hash=False, compare=False)


# Called on the event loop with each run of ids as they are sampled (see Engine.generate).
TokenSink = Callable[[Sequence[int]], None]


@dataclass(slots=True)
class GenerateResult:
    """The ids the engine sampled, their logprobs and the policy version that sampled them.

    `logprobs[i]` is the log-probability of `completion_ids[i]` under the sampling distribution
    (logits / temperature, before top-p truncation); with temperature 1 this is the model's own
    distribution, which is what an RL trainer recomputes.
    """

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    # The stop string or stop token that ended generation, when one did.
    stop_reason: str | int | None = None
    extra: dict[str, object] = field(default_factory=dict)


def policy_version_end(start: int, reloads_at_start: int, now: int, reloads_now: int) -> int | None:
    """For a remote engine that swaps weights while requests run (versions and reloads in flight,
    at a generation's start and end): the version it ended on when the weights may have changed
    under it (its tokens may come from two versions), else None. An update still in flight may
    already have swapped the weights, so it counts as made."""
    if not (reloads_at_start or reloads_now or start != now):
        return None
    return now + 1 if reloads_now else now


class EngineError(Exception):
    """The engine failed this request (a bug or a bad request the engine refused)."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached or is not ready; the caller should retry later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineOverloaded(EngineError):
    """More requests are queued than the engine accepts; the caller should back off."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ContextLengthExceeded(EngineError, ValueError):
    """The prompt leaves no room for even one completion token in the model's context."""

    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(
            f"prompt of {prompt_tokens} tokens leaves no room in a context of {max_context} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


def completion_room(prompt_tokens: int, max_tokens: int, max_context: int, reserve: int = 0) -> int:
    """`max_tokens` clamped to the room a prompt of `prompt_tokens` leaves in a context of
    `max_context` tokens (less `reserve`, tokens a server keeps free besides); ContextLengthExceeded
    when not even one completion token fits."""
    room = max_context - prompt_tokens - reserve
    if room < 1:
        raise ContextLengthExceeded(prompt_tokens, max_context)
    return min(max_tokens, room)


@runtime_checkable
class Engine(Protocol):
    """generate(prompt_ids, sampling) -> completion ids, logprobs, finish reason, policy version.

    Cancelling the awaiting task aborts the generation (a client disconnected).

    Streaming: given `on_tokens`, an engine that can calls it on the event loop with each run of
    newly sampled ids, in order, before `generate` returns (the built-in engine once per decode
    step, vLLM and SGLang per chunk of their streams). The runs concatenate to a prefix of the
    result's `completion_ids` (normally all of them); the result stays the record's source of truth,
    and an engine that cannot stream never calls it (its answer then streams whole at the end).

    Besides generating, an engine tells the gateway what it can take: `max_context` (the gateway
    clamps max_tokens to the room a prompt leaves) and `supports_response_format`.
    """

    name: str

    @property
    def max_context(self) -> int | None:
        """The model's context length in tokens (prompt + completion); None while unknown (a server
        engine that has not learnt it yet), when the gateway's own limit applies."""
        ...

    @property
    def supports_response_format(self) -> bool:
        """Whether `SamplingParams.response_format` constrains decoding (structured output); the
        others ignore it, and the gateway records the format as asked but not honoured."""
        ...

    @property
    def policy_version(self) -> int: ...

    async def start(self) -> None: ...

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: Sequence[Image] = (),
        on_tokens: TokenSink | None = None,
    ) -> GenerateResult:
        """`images` are the prompt's images in order, one per image placeholder run in `prompt_ids`
        (the renderer expanded each to the model's number of image tokens). An engine whose model
        takes no images raises EngineError when given any."""
        ...

    async def load_weights(self, path: str) -> int:
        """Load new weights in place; returns the new policy version."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Generation:
    """One call of `Engine.generate`, as an engine built on `EngineBase` receives it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    images: Sequence[Image] = ()
    on_tokens: TokenSink | None = None


class EngineBase(ABC):
    """`Engine.generate` for the engines of this project: what every one refuses alike (an empty
    prompt, images for a model or server that takes none) is said here, then `_generate` does the
    engine's own work on the call as one `Generation`."""

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: Sequence[Image] = (),
        on_tokens: TokenSink | None = None,
    ) -> GenerateResult:
        if not prompt_ids:
            raise EngineError("empty prompt")
        if images and (why := self.refuses_images()):
            raise EngineError(why)
        return await self._generate(Generation(list(prompt_ids), sampling, tuple(images), on_tokens))

    def refuses_images(self) -> str | None:
        """Why this engine takes no images (None: it takes them)."""
        return None

    @abstractmethod
    async def _generate(self, call: Generation) -> GenerateResult: ...
