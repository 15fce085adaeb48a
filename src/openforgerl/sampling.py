"""The run's sampling policy: what the trainer needs overrides or clamps what a harness asks."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from openforgerl.conversation import SamplingRequest
from openforgerl.engines.base import SamplingParams

SEED_RANGE = (-(2**63), 2**64)  # what the engines take: a signed or unsigned 64-bit integer


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Each setting a rollout may carry: its check, and the words for the error (checked when the rollout
# is created, so a bad value is the admin call's 400, not a 500 on every call of the rollout).
_VALID: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "max_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "max_context": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: _integer(v) and SEED_RANGE[0] <= v < SEED_RANGE[1], "an integer within 64 bits"),
}


@dataclass(slots=True)
class SamplingPolicy:
    """None leaves the harness's choice (or the default) in place.

    temperature/top_p override what the harness asks (RL needs the training distribution);
    max_tokens is a cap and the default; max_context bounds prompt + completion. seed, a rollout's
    own: call k of the rollout samples with `derive_seed(seed, k)` whatever the harness asks, so the
    same weights give the same rollout and two models sample on the same random numbers.
    """

    temperature: float | None = 1.0
    top_p: float | None = 1.0
    max_tokens: int = 1024
    max_context: int | None = None
    seed: int | None = None

    def merged(self, override: dict[str, Any] | None) -> SamplingPolicy:
        """This policy with a rollout's own settings on top."""
        if not override:
            return self
        known = {f.name for f in fields(self)}
        unknown = set(override) - known
        if unknown:
            raise ValueError(f"unknown sampling settings: {sorted(unknown)}; known: {sorted(known)}")
        for name, value in override.items():
            if (value is not None or name == "max_tokens") and not _VALID[name][0](value):
                raise ValueError(f"sampling {name} must be {_VALID[name][1]}, not {value!r}")
        return SamplingPolicy(**{**asdict(self), **override})

    def resolve(
        self,
        req: SamplingRequest,
        prompt_tokens: int,
        engine_max_context: int,
        stop_token_ids: tuple[int, ...],
        response_format: dict[str, Any] | None = None,
        structured_outputs: bool = False,
        call: int = 0,
    ) -> tuple[SamplingParams, dict[str, Any]]:
        """The parameters to sample with (`call`: the call's place in its rollout, from 0), and a
        record of them and of what was overridden.

        Raises ValueError when the prompt leaves no room for a single completion token.
        """
        max_context = min(self.max_context or engine_max_context, engine_max_context)
        room = max_context - prompt_tokens
        if room < 1:
            raise ValueError(max_context)
        overridden = []
        temperature = req.temperature if req.temperature is not None else 1.0
        if self.temperature is not None and self.temperature != req.temperature:
            temperature = self.temperature
            if req.temperature is not None:
                overridden.append("temperature")
        top_p = req.top_p if req.top_p is not None else 1.0
        if self.top_p is not None and self.top_p != req.top_p:
            top_p = self.top_p
            if req.top_p is not None:
                overridden.append("top_p")
        max_tokens = min(req.max_tokens or self.max_tokens, self.max_tokens, room)
        if req.max_tokens is not None and max_tokens < req.max_tokens:
            overridden.append("max_tokens")
        seed = req.seed
        if self.seed is not None:
            seed = derive_seed(self.seed, call)
            if req.seed is not None:
                overridden.append("seed")
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            stop=tuple(req.stop),
            stop_token_ids=stop_token_ids,
            seed=seed,
            response_format=response_format if structured_outputs else None,
        )
        used = {
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "stop": list(req.stop),
            "seed": seed,
            "max_context": max_context,
            "overridden": overridden,
            "response_format_honoured": bool(response_format) and structured_outputs,
        }
        return params, used


def derive_seed(*parts: object) -> int:
    """A sampling seed in [0, 2**31) that depends only on `parts` (stable across processes, unlike
    hash()); 31 bits because some engines take the seed as a signed 32-bit integer."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**31
