"""Recorded calls + reward -> training samples; the typed record of a call (`RecordedCall`).

Merge mode (the default): a call whose prompt ids start with the whole of an earlier sample's
sequence (prompt + sampled completion, and any calls merged into it since) is appended to that
sample: its new prompt ids with loss mask 0, its completion with mask 1. The test is on the ids
themselves, not on the recorded `parent_call_id`, so a sample is exactly the sequence the policy
saw and sampled. A call that extends no sample (history rewritten, compaction, a sub-agent, or a
fork: a second call continuing a sample that another call already continued) starts a new
sample. A multi-turn rollout then costs one forward pass over its tokens instead of one per turn
over the whole prefix again (O(T) instead of O(T^2) tokens).

Per-call mode (the paper's): one sample per call, prompt masked, reward optionally discounted by
gamma^(T - t) for the t-th of T + 1 calls.

Images: a call records the digests of its full prompt's images, in order (the pixels stay in the
store). A call extends a sample only if the sample's images are the first of the call's too (the same
ids with another screenshot of the same size are another sequence), and a sample's `image_digests`
are the images of its whole sequence: what the trainer loads to recompute its logprobs.

Side requests (titles, routers, memory extraction: `side_request_reason`) never merge
with the main conversation; they become their own samples, flagged, or are left out with
`include_side_requests=False`. Calls that failed (no completion) are skipped, and so are text-level
calls (an upstream answered them: no prompt ids, nothing the policy sampled; `openforge export-sft`
turns those into chat rows for SFT).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from openforgerl.store import CallRow, public_calls

Mode = Literal["merge", "per_call"]
NO_VERSION = -1  # in `Sample.policy_versions`: a prompt token, or an engine that reported no version


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """One recorded model call, typed: the public shape of a recorded call (`store.public_calls`), as
    the gateway's `GET /admin/rollouts/{id}/calls` gives it (or the store's rows: `calls_from_rows`).
    The builder reads the full prompt ids, the sampled ids and their logprobs; the behaviour metrics
    read the messages (openforgerl.behaviour)."""

    call_id: int
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    completion_logprobs: Sequence[float]
    policy_version: int | None = None
    finish_reason: str | None = None
    side_request: str = ""  # why the call looks like a side request; '' when it does not
    branch_id: int = 0  # as recorded by the gateway
    branch_reason: str = ""
    status: str = "ok"
    rollout_id: str = ""
    image_digests: Sequence[str] = ()  # the full prompt's images, in order
    seq: int = 0  # the call's place in its rollout
    parent_call_id: int | None = None  # the call whose conversation this one continues
    error: str = ""
    model: str = ""
    dialect: str = ""
    engine: str = ""
    reused_prompt_tokens: int = 0  # prompt ids the gateway's token memory carried over
    stop_reason: str | int | None = None
    sampling_requested: Mapping[str, Any] = field(default_factory=dict)
    sampling_used: Mapping[str, Any] = field(default_factory=dict)
    messages_delta: Sequence[Mapping[str, Any]] = ()  # the messages new in this call's request
    response: Mapping[str, Any] = field(default_factory=dict)  # its answer, as a message
    parse_errors: Sequence[str] = ()
    created_at: float = 0.0
    latency_ms: float | None = None


def calls_from_rows(rows: Sequence[CallRow]) -> list[RecordedCall]:
    """Adapter for the store's rows of one rollout (in seq order), through the public shape of a
    recorded call (`store.public_calls`: the full prompts rebuilt, side requests flagged)."""
    return calls_from_json({"rollout_id": rows[0].rollout_id if rows else "", "calls": public_calls(rows)})


_FIELDS = frozenset(f.name for f in fields(RecordedCall)) - {"rollout_id"}  # in calls_from_json


def calls_from_json(payload: Mapping[str, Any]) -> list[RecordedCall]:
    """Adapter for the body of the gateway's GET /admin/rollouts/{id}/calls: its fields are named as
    RecordedCall's (a null one takes the default)."""
    rollout_id = payload.get("rollout_id", "")
    return [
        RecordedCall(**{k: v for k, v in c.items() if k in _FIELDS and v is not None}, rollout_id=rollout_id)
        for c in payload["calls"]
    ]


@dataclass(slots=True)
class Sample:
    """One training sequence. Per-token lists are aligned with `input_ids`."""

    rollout_id: str
    reward: float
    branch_id: int  # the gateway's branch id of the sample's first call
    branch_reason: str  # why that call started a new branch ('' when it extended one)
    side_request: str = ""  # why this is a side request; '' for the main conversation
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on sampled tokens, 0 on the rest
    logprobs: list[float] = field(default_factory=list)  # behaviour logprobs; 0.0 where mask is 0
    policy_versions: list[int] = field(default_factory=list)  # NO_VERSION where mask is 0
    call_ids: list[int] = field(default_factory=list)
    completion_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) per call
    truncated: bool = False  # a completion in it was cut by max_tokens
    advantage: float | None = None  # set by the trainer
    image_digests: list[str] = field(default_factory=list)  # the sequence's images, in order

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_policy_version(self) -> int | None:
        versions = [v for v in self.policy_versions if v != NO_VERSION]
        return min(versions) if versions else None

    @property
    def max_policy_version(self) -> int | None:
        versions = [v for v in self.policy_versions if v != NO_VERSION]
        return max(versions) if versions else None

    def append(self, call: RecordedCall) -> None:
        """Append the call's prompt ids beyond this sequence (mask 0) and its completion (mask 1)."""
        if len(call.completion_logprobs) != len(call.completion_ids):
            raise ValueError(
                f"call {call.call_id}: {len(call.completion_logprobs)} logprobs for "
                f"{len(call.completion_ids)} completion ids"
            )
        new_prompt = call.prompt_ids[len(self.input_ids) :]
        self.image_digests += list(call.image_digests[len(self.image_digests) :])
        self.input_ids += new_prompt
        self.loss_mask += [0] * len(new_prompt)
        self.logprobs += [0.0] * len(new_prompt)
        self.policy_versions += [NO_VERSION] * len(new_prompt)
        start = len(self.input_ids)
        n = len(call.completion_ids)
        self.input_ids += call.completion_ids
        self.loss_mask += [1] * n
        self.logprobs += call.completion_logprobs
        version = NO_VERSION if call.policy_version is None else call.policy_version
        self.policy_versions += [version] * n
        self.call_ids.append(call.call_id)
        self.completion_spans.append((start, start + n))
        self.truncated = self.truncated or call.finish_reason == "length"

    def extended_by(self, call: RecordedCall) -> bool:
        n = len(self.input_ids)
        return (
            bool(self.side_request) == bool(call.side_request)
            and len(call.prompt_ids) >= n
            and list(call.prompt_ids[:n]) == self.input_ids
            and list(call.image_digests[: len(self.image_digests)]) == self.image_digests
        )


def _new_sample(call: RecordedCall, reward: float) -> Sample:
    return Sample(call.rollout_id, reward, call.branch_id, call.branch_reason, call.side_request)


def _usable(calls: Sequence[RecordedCall], include_side_requests: bool) -> list[RecordedCall]:
    # A recorded prompt is never empty (the chat template renders at least the generation prompt),
    # so a call without prompt ids is a text-level one.
    return [
        c
        for c in calls
        if c.status == "ok" and c.prompt_ids and (include_side_requests or not c.side_request)
    ]


def build_samples(
    calls: Sequence[RecordedCall],
    reward: float,
    *,
    mode: Mode = "merge",
    gamma: float = 1.0,
    include_side_requests: bool = True,
) -> list[Sample]:
    """The samples of one rollout's calls (in the order they were made), every one with `reward`
    (per-call mode: discounted by `gamma`). The trainer fills in `advantage`."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if gamma != 1.0 and mode != "per_call":
        raise ValueError("gamma discounts per-call samples; merge mode has one reward per sequence")
    usable = _usable(calls, include_side_requests)
    samples: list[Sample] = []
    if mode == "per_call":
        last = len(usable) - 1
        for t, call in enumerate(usable):
            sample = _new_sample(call, reward * gamma ** (last - t))
            sample.append(call)
            samples.append(sample)
        return samples
    for call in usable:
        extendable = [s for s in samples if s.extended_by(call)]
        if extendable:
            target = max(extendable, key=lambda s: len(s.input_ids))
        else:
            target = _new_sample(call, reward)
            samples.append(target)
        target.append(call)
    return samples


@dataclass(frozen=True, slots=True)
class TokenStats:
    """Training tokens of merged vs per-call samples; add them up over rollouts with `+`."""

    calls: int = 0
    samples: int = 0  # merged samples
    loss_tokens: int = 0  # sampled tokens: the same in both modes
    tokens_merged: int = 0
    tokens_per_call: int = 0

    @property
    def ratio(self) -> float:
        """How many times more tokens per-call training processes than merged training."""
        return self.tokens_per_call / self.tokens_merged if self.tokens_merged else 1.0

    def __add__(self, other: TokenStats) -> TokenStats:
        return TokenStats(
            self.calls + other.calls,
            self.samples + other.samples,
            self.loss_tokens + other.loss_tokens,
            self.tokens_merged + other.tokens_merged,
            self.tokens_per_call + other.tokens_per_call,
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "samples": self.samples,
            "loss_tokens": self.loss_tokens,
            "tokens_merged": self.tokens_merged,
            "tokens_per_call": self.tokens_per_call,
            "ratio": self.ratio,
        }


def token_stats(calls: Sequence[RecordedCall], *, include_side_requests: bool = True) -> TokenStats:
    merged = build_samples(calls, 0.0, include_side_requests=include_side_requests)
    usable = _usable(calls, include_side_requests)
    return TokenStats(
        calls=len(usable),
        samples=len(merged),
        loss_tokens=sum(len(c.completion_ids) for c in usable),
        tokens_merged=sum(len(s.input_ids) for s in merged),
        tokens_per_call=sum(len(c.prompt_ids) + len(c.completion_ids) for c in usable),
    )
