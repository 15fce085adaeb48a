"""OpenAI Responses: `POST /v1/responses` (JSON or SSE) and the WebSocket transport on `GET /v1/responses`.

Request -> `Conversation`:
- `input` items: messages (user/system/developer/assistant), `function_call`, `function_call_output`
  and `reasoning` (its text becomes the assistant turn's reasoning). The assistant-side items of one
  answer (reasoning, message, function calls) merge into one assistant message, so an echoed answer
  matches the token memory's record of it. `instructions` become a leading system message.
- tools: `function` tools as they are; the functions inside a `namespace` tool are flattened to
  `<namespace>__<name>` (just `<namespace><name>` when the namespace already ends in `__` or `/`, as
  Codex names them itself), and calls of those come back as `name` + `namespace`. Hosted and custom
  tools (web_search, file_search, custom, ...) are not served: the model never sees them (logged once
  per type), and they are not an error, since Codex always sends web_search.
- `text.format` becomes `Conversation.response_format` in the Chat Completions shape.
- Images: `input_image` parts with an `image_url` (a data URL) or a `file_id` (an image uploaded to
  the gateway, `POST /v1/files`), in messages and in a `function_call_output` given as a list of
  parts (a tool's screenshot). A message's images come before its text.

State: clients send `store: false` yet chain requests with `previous_response_id` + only the new
items (Codex over WebSocket always does). The gateway remembers, per rollout, in memory and bounded,
each response's conversation (instructions, messages including its output, tools), and expands such a
request to the full conversation before it reaches the core. A request without `instructions` or
`tools` inherits those of the previous response. A response that memory has lost (a restarted gateway,
or one forgotten for newer ones) is rebuilt from the store, scoped to the rollout: its call's record
and the records of the calls its prompt extends hold the conversation (each holds the messages its
parent had not seen, and its answer), and the call keeps, in its transaction, the response id, whether
the conversation starts with the instructions, and the tools as the Response lists them (once per
branch, and again when they change). A prewarm (`generate: false`) makes no call: its context lives
in memory only.

WebSocket (Codex's built-in provider; `openai-beta: responses_websockets=...`): the key is checked on
the handshake like on HTTP (401 in the Responses error shape otherwise). Each text frame
`{"type": "response.create", ...body...}` is answered with the same events as the SSE stream, one
JSON text frame each; `generate: false` answers at once with an empty completed response whose
context is remembered (Codex's prewarm); `response.processed` frames need no answer; failures before
generation are `{"type": "error", "status", "error": {...}, "headers"}` frames, after it
`response.failed`, and the connection stays open.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from openforgerl import jsonutil
from openforgerl.conversation import (
    Conversation,
    Message,
    Role,
    SamplingRequest,
    Tool,
    ToolCall,
    parse_arguments,
)
from openforgerl.engines.parsers import Delta
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome, PreparedCall, Session, message_from_record
from openforgerl.gateway.dialects import MAX_MESSAGES, MAX_TOOLS
from openforgerl.gateway.dialects.openai_chat import error_body
from openforgerl.gateway.errors import GatewayError, bad_request, load_image
from openforgerl.gateway.http import JSONResponse, Relay
from openforgerl.gateway.streaming import message_deltas
from openforgerl.images import Image, image_from_file, image_from_url
from openforgerl.store import Store

NAME = "openai-responses"
CONTEXTS_PER_ROLLOUT = 16  # responses remembered per rollout: the latest, its retries, side requests
ROLLOUTS_REMEMBERED = 2048  # rollouts with remembered responses (least recently used go first)

log = logging.getLogger(__name__)


class _Wire(BaseModel):
    # Harnesses send many fields this gateway has no use for; they are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class Part(_Wire):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # the model sees the image as sent, whatever the detail asked


class MessageItem(_Wire):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Wire):
    call_id: str
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""
    namespace: str | None = None


class FunctionCallOutputItem(_Wire):
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Wire):
    summary: list[Part] = []
    content: list[Part] | None = None


class FunctionToolDef(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceToolDef(_Wire):
    name: str = Field(min_length=1)
    description: str = ""
    tools: list[dict[str, Any]] = []


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None


class ResponsesRequest(_Wire):
    model: str
    input: str | Annotated[list[Any], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    tools: list[Any] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, strict=True)  # not "10", not true
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    # WebSocket extension (Codex's prewarm): remember the context, do not call the model.
    generate: bool = True


_ITEMS: dict[str, type[_Wire]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _invalid(exc: ValidationError, prefix: str = "") -> GatewayError:
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err['msg']}")
    loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    if not loc:
        return bad_request(f"The request body must be a JSON object: {err['msg']}")
    return bad_request(f"Invalid value for '{loc}': {err['msg']}", param=loc)


def _validate(model: type[_Wire], data: Any, where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, where) from exc


def _image(part: Part, files: Mapping[str, Image], where: str) -> Image:
    if part.image_url:
        url = part.image_url
        return load_image(lambda: image_from_url(url, files), f"{where}.image_url")
    if part.file_id:
        ref = part.file_id
        return load_image(lambda: image_from_file(ref, files), f"{where}.file_id")
    raise bad_request("An input_image part needs an 'image_url' or a 'file_id'.", param=f"{where}.image_url")


def _content(
    content: str | list[Part], where: str, files: Mapping[str, Image] | None = None
) -> tuple[str, list[Image]]:
    """The text of content parts (joined) and their images; `files=None`: text only."""
    if isinstance(content, str):
        return content, []
    texts = []
    images: list[Image] = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            texts.append(part.text or "")
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        elif part.type == "input_image" and files is not None:
            images.append(_image(part, files, f"{where}.{j}"))
        else:
            allowed = "text and image" if files is not None else "text"
            raise bad_request(
                f"Content part type '{part.type}' is not supported here: send {allowed} parts.",
                param=f"{where}.{j}.type",
            )
    return "".join(texts), images


def _text(content: str | list[Part], where: str) -> str:
    return _content(content, where)[0]


def flat_name(namespace: str, name: str) -> str:
    """The name the model sees for a function inside a namespace tool (Codex's own scheme)."""
    return f"{namespace}{name}" if namespace.endswith(("__", "/")) else f"{namespace}__{name}"


def _assistant(messages: list[Message], new_turn_if_answered: bool) -> Message:
    """The assistant message the next assistant-side item belongs to (a new one when needed)."""
    last = messages[-1] if messages else None
    if (
        last is None
        or last.role != "assistant"
        or (new_turn_if_answered and (last.content or last.tool_calls))
    ):
        last = Message(role="assistant")
        messages.append(last)
    return last


def input_messages(items: str | list[Any] | None, files: Mapping[str, Image] | None = None) -> list[Message]:
    """The request's `input` as conversation messages (GatewayError 400 on what is not supported);
    `files`: the images uploaded to the gateway that the request names, by file id."""
    files = files or {}
    if items is None:
        return []
    if isinstance(items, str):
        return [Message(role="user", content=items)]
    messages: list[Message] = []
    for i, raw in enumerate(items):
        where = f"input.{i}"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(
                f"Input item type {kind!r} is not supported by this gateway: send message, function_call, "
                "function_call_output or reasoning items.",
                param=f"{where}.type",
            )
        item = _validate(model, raw, where)
        if isinstance(item, MessageItem):
            if item.role == "assistant":
                turn = _assistant(messages, new_turn_if_answered=True)
                turn.content += _text(item.content, f"{where}.content")
            else:
                text, images = _content(item.content, f"{where}.content", files)
                role: Role = "user" if item.role == "user" else "system"
                messages.append(Message(role=role, content=text, images=images))
        elif isinstance(item, FunctionCallItem):
            name = flat_name(item.namespace, item.name) if item.namespace else item.name
            call = ToolCall(name, parse_arguments(item.arguments), item.call_id)
            _assistant(messages, new_turn_if_answered=False).tool_calls.append(call)
        elif isinstance(item, FunctionCallOutputItem):
            text, images = _content(item.output, f"{where}.output", files)
            messages.append(Message(role="tool", content=text, tool_call_id=item.call_id, images=images))
        else:
            assert isinstance(item, ReasoningItem)
            parts = item.content if item.content else item.summary
            text = "\n\n".join(_text([p], f"{where}.summary") for p in parts)
            turn = _assistant(messages, new_turn_if_answered=True)
            turn.reasoning = f"{turn.reasoning}\n\n{text}" if turn.reasoning else text
    return messages


@dataclass(slots=True, frozen=True)
class ToolSet:
    """The tools the model sees, and how the Response object lists them."""

    tools: tuple[Tool, ...] = ()
    namespaced: tuple[tuple[str, str, str], ...] = ()  # (flat name, namespace, name)
    listed: tuple[dict[str, Any], ...] = ()

    def origin(self, flat: str) -> tuple[str | None, str]:
        """(namespace, name) of a function the model called."""
        for name, namespace, inner in self.namespaced:
            if name == flat:
                return namespace, inner
        return None, flat


_declined_noted: set[str] = set()  # each declined tool type is logged once per process


def _decline(kind: str) -> None:
    if kind not in _declined_noted:
        _declined_noted.add(kind)
        log.info("Responses tool type %r is not served by this gateway; the model does not see it.", kind)


def _tool_type(raw: Any, where: str) -> str:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str):
        raise bad_request("Each tool must be an object with a 'type'.", param=f"{where}.type")
    return kind


def _function(raw: dict[str, Any], where: str) -> FunctionToolDef:
    return cast(FunctionToolDef, _validate(FunctionToolDef, raw, where))


def _listed(fn: FunctionToolDef) -> dict[str, Any]:
    return {
        "type": "function",
        "name": fn.name,
        "description": fn.description,
        "parameters": fn.parameters,
        "strict": fn.strict,
    }


def tool_set(raw_tools: list[Any]) -> ToolSet:
    tools: list[Tool] = []
    namespaced: list[tuple[str, str, str]] = []
    listed: list[dict[str, Any]] = []
    for i, raw in enumerate(raw_tools):
        where = f"tools.{i}"
        kind = _tool_type(raw, where)
        if kind == "function":
            fn = _function(raw, where)
            tools.append(Tool(fn.name, fn.description or "", fn.parameters or {}))
            listed.append(_listed(fn))
        elif kind == "namespace":
            ns = cast(NamespaceToolDef, _validate(NamespaceToolDef, raw, where))
            inner = []
            for j, nested in enumerate(ns.tools):
                nested_where = f"{where}.tools.{j}"
                nested_kind = _tool_type(nested, nested_where)
                if nested_kind != "function":
                    _decline(nested_kind)
                    continue
                fn = _function(nested, nested_where)
                name = flat_name(ns.name, fn.name)
                description = "\n\n".join(d for d in (ns.description, fn.description or "") if d)
                tools.append(Tool(name, description, fn.parameters or {}))
                namespaced.append((name, ns.name, fn.name))
                inner.append(_listed(fn))
            listed.append(
                {"type": "namespace", "name": ns.name, "description": ns.description, "tools": inner}
            )
        else:
            _decline(kind)
    return ToolSet(tuple(tools), tuple(namespaced), tuple(listed))


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` in the Chat Completions shape the rest of the gateway records."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    for field, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            raise bad_request(
                f"'text.format.{field}' is required for json_schema.", param=f"text.format.{field}"
            )
    spec = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
    return {"type": "json_schema", "json_schema": spec}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The tool choice in the Chat Completions shape (a function's flattened name)."""
    if not isinstance(choice, dict):
        return choice
    if not isinstance(choice.get("type"), str):
        raise bad_request(
            "'tool_choice' must be none, auto, required or an object with a 'type'.", "tool_choice"
        )
    if choice["type"] != "function":
        return choice
    name, ns = choice.get("name"), choice.get("namespace")
    if not isinstance(name, str) or not isinstance(ns, str | None):
        raise bad_request("A function tool choice needs its 'name'.", param="tool_choice.name")
    return {"type": "function", "function": {"name": flat_name(ns, name) if ns else name}}


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
        raise _invalid(exc) from exc
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
        tool_choice=_tool_choice(req.tool_choice),
        response_format=_response_format(req.text),
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


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


Remember = Callable[[str, Context], None]  # (response id, its context): kept for the rollout


class Reply(serving.Exchange):
    """One response being answered: its ids, its Response object and its numbered events; once it
    is answered, its context is remembered for the rollout (`previous_response_id`)."""

    def __init__(self, turn: Turn, remember: Remember, stream_id: str | None = None) -> None:
        self.turn, self.conv, self._remember = turn, turn.conv, remember
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.stream_id = stream_id  # WebSocket lane: echoed on each event when the client named one
        self.seq = 0
        self._items: list[dict[str, Any]] | None = None
        self._ids: dict[str, str] = {}  # the reasoning and message items' ids, drawn once
        # The stream's state: the item being streamed (its kind, index and text so far), the tool
        # calls (their items follow the message's: text after a call belongs to that message).
        self.open: tuple[str, int] | None = None
        self.index = -1
        self.streamed = {"reasoning": "", "message": ""}
        self.calls: list[ToolCall] = []

    def remember(self, out: CallOutcome | None) -> None:
        """Keep this response's context: the conversation with its output (None: prewarmed)."""
        context = self.turn.context
        messages = context.messages if out is None else (*context.messages, out.message)
        self._remember(self.id, Context(context.instructions, messages, context.tools))

    # -- the HTTP exchange's hooks --------------------------------------------------------
    def without_model(self) -> Response | None:
        if self.turn.req.generate:
            return None
        self.remember(None)
        if self.turn.req.stream:
            return Response(sse(self.prewarm_events()), media_type="text/event-stream")
        return JSONResponse(self.prewarmed())

    def prepared(self, call: PreparedCall) -> None:
        """The call is recorded with what rebuilding this response's context needs."""
        call.response_id = self.id
        call.response_context = self.turn.recorded(call.plan.parent is not None)

    def body(self, out: CallOutcome) -> bytes:
        self.remember(out)
        return jsonutil.dumps(self.completed(out))

    def stream_start(self, call: PreparedCall) -> bytes:
        return sse(self.opening())

    def stream_delta(self, delta: Delta) -> bytes:
        return sse(self.delta_events(delta))

    def stream_end(self, out: CallOutcome) -> bytes:
        self.remember(out)
        return sse(self.end_events(out))

    def stream_error(self, err: GatewayError) -> bytes:
        return sse(self.failed(err))

    # -- the Responses API's objects and events -------------------------------------------
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.seq}
        if self.stream_id is not None:
            event["stream_id"] = self.stream_id
        self.seq += 1
        return event

    def response(
        self, status: str, output: list[dict[str, Any]] | None = None, **extra: Any
    ) -> dict[str, Any]:
        req = self.turn.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": self.turn.context.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": req.model,
            "output": output or [],
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": self._format()},
            "tool_choice": req.tool_choice or "auto",
            "tools": list(self.turn.context.tools.listed),
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            **extra,
        }

    def _format(self) -> dict[str, Any]:
        fmt = self.turn.req.text.format if self.turn.req.text else None
        return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def prewarmed(self) -> dict[str, Any]:
        """The answer to `generate: false`: nothing generated, the context remembered."""
        return self.response("completed", completed_at=int(time.time()))

    def prewarm_events(self) -> list[dict[str, Any]]:
        return [*self.opening(), self.event("response.completed", response=self.prewarmed())]

    def completed(self, out: CallOutcome) -> dict[str, Any]:
        usage = {
            "input_tokens": out.prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": out.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.prompt_tokens + out.completion_tokens,
        }
        done = {"usage": usage, "completed_at": int(time.time())}
        if out.finish_reason == "length":
            details = {"reason": "max_output_tokens"}
            return self.response("incomplete", self.items(out), incomplete_details=details, **done)
        return self.response("completed", self.items(out), **done)

    def items(self, out: CallOutcome) -> list[dict[str, Any]]:
        """The output items (ids are drawn once per Reply, so events and the final object agree)."""
        if self._items is None:
            self._items = list(self._make_items(out))
        return self._items

    def _id(self, prefix: str) -> str:
        return self._ids.setdefault(prefix, _new_id(prefix))

    def _reasoning_item(self, text: str) -> dict[str, Any]:
        return {
            "id": self._id("rs"),
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}],
            "encrypted_content": None,
            "status": "completed",
        }

    def _message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "id": self._id("msg"),
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }

    def _make_items(self, out: CallOutcome) -> Iterator[dict[str, Any]]:
        message = out.message
        if message.reasoning:
            yield self._reasoning_item(message.reasoning)
        # An answer without calls always has a message item, so its echo keeps the assistant turn.
        if message.content or not message.tool_calls:
            yield self._message_item(
                message.content, "incomplete" if out.finish_reason == "length" else "completed"
            )
        for call in message.tool_calls:
            namespace, name = self.turn.context.tools.origin(call.name)
            item = {
                "id": _new_id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": call.id,
                "name": name,
                "arguments": call.arguments
                if isinstance(call.arguments, str)
                else orjson.dumps(call.arguments).decode(),
            }
            if namespace is not None:
                item["namespace"] = namespace
            yield item

    # -- the stream: the reasoning and message items as they are sampled, then the calls' ----------
    def delta_events(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, text in (("reasoning", delta.reasoning), ("message", delta.content)):
            if not text:
                continue
            if self.open is None or self.open[0] != kind:
                events += self._close_open()
                events += self._open_item(kind)
            assert self.open is not None
            self.streamed[kind] += text
            at = {"item_id": self._id("rs" if kind == "reasoning" else "msg"), "output_index": self.open[1]}
            if kind == "reasoning":
                events.append(
                    self.event("response.reasoning_summary_text.delta", **at, summary_index=0, delta=text)
                )
            else:
                events.append(
                    self.event("response.output_text.delta", **at, content_index=0, delta=text, logprobs=[])
                )
        if delta.tool_call is not None:
            self.calls.append(delta.tool_call)
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        self.index += 1
        self.open = (kind, self.index)
        if kind == "reasoning":
            item: dict[str, Any] = {**self._reasoning_item(""), "status": "in_progress", "summary": []}
            at = {"item_id": item["id"], "output_index": self.index}
            part = {"type": "summary_text", "text": ""}
            return [
                self.event("response.output_item.added", output_index=self.index, item=item),
                self.event("response.reasoning_summary_part.added", **at, summary_index=0, part=part),
            ]
        item = {**self._message_item(""), "status": "in_progress", "content": []}
        at = {"item_id": item["id"], "output_index": self.index}
        text_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=self.index, item=item),
            self.event("response.content_part.added", **at, content_index=0, part=text_part),
        ]

    def _close_open(self, status: str = "completed") -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, index = self.open
        self.open = None
        text = self.streamed[kind]
        if kind == "reasoning":
            item = self._reasoning_item(text)
            at = {"item_id": item["id"], "output_index": index, "summary_index": 0}
            events = [
                self.event("response.reasoning_summary_text.done", **at, text=text),
                self.event("response.reasoning_summary_part.done", **at, part=item["summary"][0]),
            ]
        else:
            item = self._message_item(text, status)
            at = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events = [
                self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=item["content"][0]),
            ]
        return [*events, self.event("response.output_item.done", output_index=index, item=item)]

    def end_events(self, out: CallOutcome) -> list[dict[str, Any]]:
        """The events that close a finished call's stream: the open item's end, the message item
        when nothing was said (an answer without calls has one), each call's item, then the
        terminal event."""
        status = "incomplete" if out.finish_reason == "length" else "completed"
        events = self._close_open(status)
        items = self.items(out)
        said = any(item["type"] == "message" for item in items[: self.index + 1])
        for item in items[self.index + 1 :]:
            if item["type"] == "message" and not said:
                events += self._open_item("message") + self._close_open(status)
            elif item["type"] == "function_call":
                self.index += 1
                events += self._call_events(self.index, item)
        final = self.completed(out)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self.event(kind, response=final))
        return events

    def finished(self, out: CallOutcome) -> list[dict[str, Any]]:
        """The events after `opening()` for a call that was not streamed."""
        return [e for d in message_deltas(out.message) for e in self.delta_events(d)] + self.end_events(out)

    def _call_events(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        at = {"item_id": item["id"], "output_index": index}
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            ),
            self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **at, arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def failed(self, err: GatewayError) -> list[dict[str, Any]]:
        """A failure after the stream began: `response.failed` (Codex reads the code to retry)."""
        message = err.message
        if err.retry_after is not None:
            # Codex parses the retry delay of a failed stream from this wording.
            message += f" Please try again in {max(1, round(err.retry_after))}s."
        error = {
            "code": "rate_limit_exceeded" if err.kind == "rate_limit" else "server_error",
            "message": message,
        }
        return [self.event("response.failed", response=self.response("failed", error=error))]


def sse(events: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)


def ws_error(err: GatewayError) -> dict[str, Any]:
    """An error frame before generation began, in the shape Codex and the SDK read (status + error)."""
    error = orjson.loads(error_body(err))["error"]
    headers = err.headers()
    if headers:
        error["headers"] = headers
    return {
        "type": "error",
        "status": err.status,
        "error": error,
        **({"headers": headers} if headers else {}),
    }


class OpenAIResponses(serving.JSONErrors):
    """`POST /v1/responses` and the WebSocket transport on `GET /v1/responses`."""

    name = NAME
    owned = re.compile(r"^(/r/[^/]+)?/v1/responses(/|$)")
    error_body = staticmethod(error_body)

    def __init__(self) -> None:
        self.contexts = Contexts()

    def turn(
        self, rollout_id: str, body: bytes | dict[str, Any], files: Mapping[str, Image], store: Store
    ) -> Turn:
        """Parse a request body, expanding its `previous_response_id` from this rollout's memory, or
        from `store` when memory has lost it (a restart; a read of the store, which is why this
        belongs on a worker thread, like the rest of parsing)."""

        def recall(response_id: str) -> Context | None:
            context = self.contexts.get(rollout_id, response_id)
            if context is None:
                context = rebuilt_context(store, rollout_id, response_id)
                if context is not None:
                    self.contexts.put(rollout_id, response_id, context)
            return context

        return parse_turn(body, recall, files)

    def reply(self, turn: Turn, rollout_id: str, stream_id: str | None = None) -> Reply:
        return Reply(turn, functools.partial(self.contexts.put, rollout_id), stream_id)

    def routes(self, host: serving.Host) -> list[serving.RouteSpec]:
        def parse(body: bytes, files: Mapping[str, Image], at: serving.Incoming) -> Reply:
            return self.reply(self.turn(at.rollout_id, body, files, host.store), at.rollout_id)

        async def serve(websocket: WebSocket, session: Session) -> None:
            await _Socket(self, host, websocket, session).serve()

        return [serving.CallRoute("/v1/responses", parse), serving.SocketRoute("/v1/responses", serve)]


class _Socket:
    """One WebSocket connection: frames are answered in order; a disconnect aborts the generation."""

    def __init__(self, dialect: OpenAIResponses, host: serving.Host, websocket: WebSocket, session: Session):
        self.dialect, self.host, self.websocket, self.session = dialect, host, websocket, session
        self.frames: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self.gone = asyncio.Event()

    async def serve(self) -> None:
        reader = asyncio.ensure_future(self._read())
        try:
            while (frame := await self.frames.get()) is not None:
                try:
                    await self._answer(frame)
                except GatewayError as err:
                    await self._send([ws_error(err)])
                except WebSocketDisconnect:
                    raise
                except Exception as exc:  # a bug must not end the connection: answer 500, as over HTTP
                    internal = GatewayError(500, f"Internal gateway error: {exc!r}", kind="internal")
                    await self._send([ws_error(internal)])
        finally:
            reader.cancel()

    async def _read(self) -> None:
        try:
            while (message := await self.websocket.receive())["type"] != "websocket.disconnect":
                await self.frames.put(message.get("text") or message.get("bytes") or b"")
        finally:  # however reading ends, the connection is over: stop generating, stop serving
            self.gone.set()
            self.frames.put_nowait(None)

    async def _send(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            await self.websocket.send_text(orjson.dumps(event).decode())

    async def _answer(self, frame: str | bytes) -> None:
        try:
            event = jsonutil.loads(frame)
        except ValueError as exc:
            raise bad_request(f"The frame is not valid JSON: {exc}") from exc
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.processed":
            return  # Codex's acknowledgement of a response; it expects no answer
        if kind != "response.create":
            raise bad_request(f"Unsupported event type {kind!r}: send 'response.create'.", param="type")
        stream_id = event.get("stream_id")
        raw = frame.encode() if isinstance(frame, str) else frame
        rollout, store = self.session.rollout.id, self.host.store
        turn = await self.host.parse(
            self.session, raw, lambda _, files: self.dialect.turn(rollout, event, files, store)
        )
        reply = self.dialect.reply(turn, rollout, stream_id if isinstance(stream_id, str) else None)
        if not turn.req.generate:
            reply.remember(None)
            await self._send(reply.prewarm_events())
            return
        prepared = await self.host.prepare(self.session, reply)
        try:
            await self._send(reply.opening())
            outcome = await self._run(prepared, reply)
        except GatewayError as err:
            await self._send(reply.failed(err))
            return
        finally:
            self.host.release(prepared)
        if outcome is not None:
            reply.remember(outcome)
            await self._send(reply.end_events(outcome))

    async def _run(self, prepared: PreparedCall, reply: Reply) -> CallOutcome | None:
        """Generate, sending the answer's events as it is sampled (`response.in_progress` as
        keep-alive while the engine is silent); None if the client went away."""

        async def keepalive() -> None:
            await self._send([reply.event("response.in_progress", response=reply.response("in_progress"))])

        relay: Relay[dict[str, Any]] = Relay()
        task = asyncio.ensure_future(self.host.run(prepared, lambda d: relay.put(reply.delta_events(d))))
        if not await relay.run(task, self.gone.wait(), self._send, keepalive):
            return None
        outcome: CallOutcome = task.result()
        return outcome
