"""Chaining state: what a response id stands for (`Context`: instructions, the conversation up to
and including its output, tools), kept per rollout in bounded memory (`Contexts`), rebuilt from the
store when memory lost it (`rebuilt_context`), and a request expanded by its `previous_response_id`
into the whole conversation (`parse_turn`)."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from openforgerl.conversation import (
    Conversation,
    Message,
    SamplingRequest,
)
from openforgerl.gateway.core import message_from_record
from openforgerl.gateway.dialects.responses.parsing import (
    ToolSet,
    chat_response_format,
    chat_tool_choice,
    input_messages,
    tool_set,
)
from openforgerl.gateway.dialects.responses.protocol import NAME, ResponsesRequest, invalid
from openforgerl.gateway.errors import bad_request
from openforgerl.images import Image
from openforgerl.store import Store

CONTEXTS_PER_ROLLOUT = 16  # responses remembered per rollout: the latest, its retries, side requests
ROLLOUTS_REMEMBERED = 2048  # rollouts with remembered responses (least recently used go first)


@dataclass(slots=True, frozen=True)
class Context:
    """What a response id stands for: the conversation up to and including its output."""

    instructions: str | None
    messages: tuple[Message, ...]
    tools: ToolSet


class Contexts:
    """response id -> Context, per rollout, bounded; the least recently used go first. Thread-safe:
    requests are parsed (and their previous context recalled) on worker threads."""

    def __init__(self, per_rollout: int = CONTEXTS_PER_ROLLOUT, rollouts: int = ROLLOUTS_REMEMBERED) -> None:
        self.per_rollout = per_rollout
        self.rollouts = rollouts
        self._by_rollout: OrderedDict[str, OrderedDict[str, Context]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rollout_id: str, response_id: str) -> Context | None:
        with self._lock:
            contexts = self._by_rollout.get(rollout_id)
            context = contexts.get(response_id) if contexts is not None else None
            if contexts is not None and context is not None:
                self._by_rollout.move_to_end(rollout_id)
                contexts.move_to_end(response_id)
            return context

    def put(self, rollout_id: str, response_id: str, context: Context) -> None:
        with self._lock:
            contexts = self._by_rollout.setdefault(rollout_id, OrderedDict())
            self._by_rollout.move_to_end(rollout_id)
            contexts[response_id] = context
            if len(contexts) > self.per_rollout:
                contexts.popitem(last=False)
            if len(self._by_rollout) > self.rollouts:
                self._by_rollout.popitem(last=False)


@dataclass(slots=True)
class Turn:
    """A parsed request: the conversation for the core and the context it extends."""

    req: ResponsesRequest
    conv: Conversation
    context: Context  # before this response's output
    previous: Context | None = None  # what previous_response_id stood for

    def recorded(self, extends_a_call: bool) -> dict[str, Any]:
        """What the call's record keeps to rebuild this response's context (`rebuilt_context`):
        whether its first message is the instructions, and the tools as listed, unless the call
        extends another (same tools for the model) and they are the previous response's."""
        out: dict[str, Any] = {"instructions": bool(self.context.instructions)}
        if not extends_a_call or (self.previous is not None and self.previous.tools != self.context.tools):
            out["tools"] = list(self.context.tools.listed)
        return out


def parse_turn(
    body: bytes | dict[str, Any],
    recall: Callable[[str], Context | None],
    files: Mapping[str, Image] | None = None,
) -> Turn:
    """The request as a Turn; `recall` gives the context a `previous_response_id` stands for, `files`
    the uploaded images the request names."""
    try:
        if isinstance(body, bytes):
            req = ResponsesRequest.model_validate_json(body)
        else:
            req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc) from exc
    previous = None
    if req.previous_response_id is not None:
        previous = recall(req.previous_response_id)
        if previous is None:
            raise bad_request(
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
    history = [*(previous.messages if previous else ()), *input_messages(req.input, files)]
    instructions = req.instructions
    if instructions is None and previous is not None:
        instructions = previous.instructions
    if req.tools is not None:
        tools = tool_set(req.tools)
    else:
        tools = previous.tools if previous else ToolSet()
    messages = [Message(role="system", content=instructions)] if instructions else []
    messages += history
    if not messages:
        raise bad_request("'input' is required: the conversation is empty.", param="input")
    conv = Conversation(
        model=req.model,
        messages=messages,
        tools=list(tools.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=chat_response_format(req.text),
        sampling=SamplingRequest(
            temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_output_tokens
        ),
        stream=req.stream,
        dialect=NAME,
    )
    return Turn(req, conv, Context(instructions or None, tuple(history), tools), previous)


def rebuilt_context(store: Store, rollout_id: str, response_id: str) -> Context | None:
    """What a response of this rollout stands for, rebuilt from the store (None when the rollout has
    no such response): the conversation its call's record and those of the calls it extends hold,
    with its answer, and the instructions and tools kept with it. Reads the store: for a thread."""
    chain = store.response_chain_sync(rollout_id, response_id)
    if not chain or chain[-1].parent_call_id is not None:  # a parent is missing: not rebuilt
        return None
    records: list[dict[str, Any]] = list(chain[-1].messages_delta)
    for parent, call in itertools.pairwise(reversed(chain)):
        records.append(parent.response)  # the parent's answer, which the call's prompt holds
        records += call.messages_delta
    records.append(chain[0].response)
    images = store.images_sync(d for r in records for d in r.get("images") or [])
    try:
        messages = [message_from_record(r, images) for r in records]
    except KeyError:  # an image the store lacks
        return None
    listed = next((c.response_context["tools"] for c in chain if "tools" in c.response_context), None)
    if listed is not None:
        tools = tool_set(listed)
    else:  # the branch began with a call of another dialect: its definitions, as functions
        defined = chain[-1].sampling_requested.get("tool_definitions")
        if defined is None and chain[-1].sampling_requested.get("tools"):
            return None
        tools = tool_set([{"type": "function", **t["function"]} for t in defined or []])
    instructions = None
    if chain[0].response_context.get("instructions") and messages and messages[0].role == "system":
        instructions, messages = messages[0].content, messages[1:]
    return Context(instructions, tuple(messages), tools)
