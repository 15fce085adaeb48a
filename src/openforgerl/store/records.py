"""What the store keeps, as records, and the one public shape of each.

A rollout is a `RolloutRow`, a model call a `CallRow`. Every reader that hands a recorded call on
(the gateway's `GET /admin/rollouts/{id}/calls`, the viewer's `/api/rollout`, the SFT export) gives
it in one shape, `public_calls`: the same keys everywhere, with the full prompt's token ids only
where they are wanted (the viewer fetches a rollout's ids on their own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from openforgerl.conversation import side_request_reason


@dataclass(slots=True)
class RolloutRow:
    id: str
    run_id: str
    task_id: str
    key_hash: str
    status: str = "open"
    reward: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    closed_at: float | None = None

    def public(self) -> dict[str, Any]:
        return {
            "rollout_id": self.id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "status": self.status,
            "reward": self.reward,
            "details": self.details,
            "metadata": self.metadata,
            "sampling": self.sampling,
            "created_at": self.created_at,
            "closed_at": self.closed_at,
        }


@dataclass(slots=True)
class CallRow:
    """One recorded model call. `prompt_prefix_call_id` + `prompt_prefix_len` say that the prompt
    starts with that many ids of the earlier call's prompt + completion."""

    rollout_id: str
    seq: int
    branch_id: int
    parent_call_id: int | None
    branch_reason: str
    dialect: str
    model: str
    engine: str
    status: str
    error: str
    policy_version: int | None
    prompt_prefix_len: int
    prompt_delta: list[int]
    prompt_tokens: int
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None
    stop_reason: str | None
    sampling_requested: dict[str, Any]
    sampling_used: dict[str, Any]
    messages_delta: list[dict[str, Any]]
    response: dict[str, Any]
    parse_errors: list[str]
    memory: dict[str, Any]
    created_at: float
    latency_ms: float
    id: int | None = None
    # The digests of the images in the call's full prompt, in order (the bytes are in `images`).
    image_digests: list[str] = field(default_factory=list)
    # The dialect's id for the response this call answered ('' for none) and what the dialect keeps
    # with it (the `responses` table, not a column of `calls`).
    response_id: str = ""
    response_context: dict[str, Any] = field(default_factory=dict)

    def public(self, *, side_request: str, prompt_ids: Sequence[int] | None = None) -> dict[str, Any]:
        """The call in the public shape (`public_calls`, which knows the rest of the rollout, fills
        in `side_request` and the full prompt); with `prompt_ids`, its token ids and logprobs too."""
        tokens: dict[str, Any] = {}
        if prompt_ids is not None:
            tokens = {
                "prompt_ids": prompt_ids,
                "completion_ids": self.completion_ids,
                "completion_logprobs": self.completion_logprobs,
            }
        return {
            "call_id": self.id,
            "seq": self.seq,
            "status": self.status,
            "error": self.error,
            "model": self.model,
            "dialect": self.dialect,
            "engine": self.engine,
            "branch_id": self.branch_id,
            "parent_call_id": self.parent_call_id,
            "branch_reason": self.branch_reason,
            "side_request": side_request,
            "policy_version": self.policy_version,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.prompt_prefix_len,
            "completion_tokens": len(self.completion_ids),
            **tokens,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "sampling_requested": self.sampling_requested,
            "sampling_used": self.sampling_used,
            "messages_delta": self.messages_delta,
            "response": self.response,
            "parse_errors": self.parse_errors,
            "image_digests": self.image_digests,
            "created_at": self.created_at,
            "latency_ms": self.latency_ms,
        }


def full_prompts(calls: Sequence[CallRow]) -> dict[int, list[int]]:
    """Rebuild each call's full prompt ids from the prefix references (calls in seq order)."""
    by_id = {c.id: c for c in calls}
    prompts: dict[int, list[int]] = {}
    for c in calls:
        assert c.id is not None
        prefix: list[int] = []
        if c.parent_call_id is not None and c.prompt_prefix_len:
            parent = by_id[c.parent_call_id]
            assert parent.id is not None
            prefix = (prompts[parent.id] + parent.completion_ids)[: c.prompt_prefix_len]
        prompts[c.id] = prefix + c.prompt_delta
    return prompts


def public_calls(calls: Sequence[CallRow], *, tokens: bool = True) -> list[dict[str, Any]]:
    """A rollout's calls (all of them, in seq order, as the store returns them) in the one public
    shape of a recorded call. Keys: `call_id`, `seq`, `status`, `error`, `model`, `dialect`,
    `engine`, `branch_id`, `parent_call_id`, `branch_reason`, `side_request` (why the call looks
    like a side request, '' when it does not), `policy_version`, `prompt_tokens`,
    `reused_prompt_tokens` (how many of them are the extended call's exact ids),
    `completion_tokens`, `finish_reason`, `stop_reason`, `sampling_requested`, `sampling_used`,
    `messages_delta` (the messages sent since the extended call; images named by digest),
    `response`, `parse_errors`, `image_digests` (the full prompt's, in order), `created_at`,
    `latency_ms`; with `tokens`, also `prompt_ids` (the full prompt, rebuilt from the prefix
    references), `completion_ids` and `completion_logprobs`."""
    prompts = full_prompts(calls) if tokens else {}
    uses_tools = any(c.sampling_requested.get("tools") for c in calls)
    return [
        c.public(
            side_request=side_request_reason(c.sampling_requested, uses_tools),
            prompt_ids=prompts[c.id] if tokens and c.id is not None else None,
        )
        for c in calls
    ]
