"""What one model call is to the gateway (a rollout's `Session`, a `PreparedCall`, its `CallOutcome`)
and how it is recorded: its `CallRow`, the messages as a record keeps them, and back."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from openforgerl.conversation import Conversation, Message, ToolCall
from openforgerl.engines.base import SamplingParams
from openforgerl.gateway.errors import ErrorKind, GatewayError
from openforgerl.images import Image
from openforgerl.rendering import PromptPlan, TokenMemory
from openforgerl.sampling import SamplingPolicy
from openforgerl.store import CallRow, RolloutRow


def injected_fault(status: int) -> GatewayError:
    kinds: dict[int, ErrorKind] = {429: "rate_limit", 500: "internal", 503: "unavailable", 529: "unavailable"}
    return GatewayError(
        status,
        f"Injected fault {status} (requested through the admin API).",
        kind=kinds.get(status, "internal"),
        retry_after=1 if status in (429, 503, 529) else None,
    )


def recorded_message(m: Message) -> dict[str, Any]:
    """A message as a call's record keeps it: the template's shape, with its text as a string and
    its images as digests (the bytes are in the store's images table, once each)."""
    out = m.template_dict()
    if m.images:
        out["content"] = m.content
        out["images"] = [im.digest for im in m.images]
    return out


def message_from_record(record: Mapping[str, Any], images: Mapping[str, Image]) -> Message:
    """A message as `recorded_message` (or `Message.template_dict`, for an answer) kept it; `images`:
    the images it names, by digest (KeyError for one that is missing)."""
    content = record.get("content") or ""
    if not isinstance(content, str):  # a template's parts: the text part (images are named apart)
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return Message(
        role=record["role"],
        content=content,
        reasoning=record.get("reasoning_content") or "",
        tool_calls=[
            ToolCall(c["function"]["name"], c["function"]["arguments"], c.get("id") or "")
            for c in record.get("tool_calls") or []
        ],
        tool_call_id=record.get("tool_call_id") or "",
        name=record.get("name") or "",
        images=[images[d] for d in record.get("images") or []],
    )


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


@dataclass
class Session:
    """A live rollout: its row, its token memory and its call counter."""

    rollout: RolloutRow
    memory: TokenMemory
    policy: SamplingPolicy
    next_seq: int = 0
    # Errors to answer the next calls with, for testing a harness's retry logic (admin API).
    faults: list[int] = field(default_factory=list)
    # The upstream that answers this rollout's calls instead of the policy ('' = the policy); its
    # name is kept in the rollout's metadata, so a restarted gateway routes the rollout alike.
    upstream: str = ""


@dataclass(slots=True)
class PreparedCall:
    session: Session
    conv: Conversation
    plan: PromptPlan
    params: SamplingParams | None  # None for an upstream's call
    used: dict[str, Any]
    seq: int
    started: float
    released: bool = False
    upstream_body: dict[str, Any] | None = None  # the request an upstream gets
    images: list[Image] = field(default_factory=list)  # the prompt's images, in order
    # The dialect's id for the response, and what it keeps with it, recorded with the call if it
    # succeeds (the Responses API's previous_response_id is served from these after a restart).
    response_id: str = ""
    response_context: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CallOutcome:
    call_id: int
    message: Message
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    policy_version: int  # -1 when an upstream answered (its counts above are its own)
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    parse_errors: list[str] = field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or token id that ended generation


def call_row(call: PreparedCall, engine: str, status: str, error: str, message: Message | None) -> CallRow:
    """The record of a call, without what an engine returned (no ids, logprobs or version)."""
    conv, plan = call.conv, call.plan
    return CallRow(
        rollout_id=call.session.rollout.id,
        seq=call.seq,
        branch_id=-1,
        parent_call_id=plan.parent.call_id if plan.parent else None,
        branch_reason=plan.miss_reason,
        dialect=conv.dialect,
        model=conv.model,
        engine=engine,
        status=status,
        error=error,
        policy_version=None,
        prompt_prefix_len=plan.prefix_len,
        prompt_delta=plan.prompt_ids[plan.prefix_len :],
        prompt_tokens=len(plan.prompt_ids),
        completion_ids=[],
        completion_logprobs=[],
        finish_reason="abort" if status == "aborted" else None,
        stop_reason=None,
        sampling_requested={
            **asdict(conv.sampling),
            "tools": len(conv.tools),
            "tool_choice": conv.tool_choice,
            "response_format": conv.response_format,
            # The definitions once per branch: the calls extending it were given the same ones.
            **({"tool_definitions": [t.template_dict() for t in conv.tools]} if not plan.parent else {}),
        },
        sampling_used=call.used,
        messages_delta=[recorded_message(m) for m in conv.messages[plan.first_new_message :]],
        response=message.template_dict() if message else {},
        parse_errors=[],
        memory={},
        created_at=call.started,
        latency_ms=(time.time() - call.started) * 1000,
        image_digests=[im.digest for im in call.images],
    )
