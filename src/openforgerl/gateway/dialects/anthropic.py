"""Anthropic Messages (Claude Code, pi): wire models, and the translation to and from a `Conversation`.

Choices the wire format leaves open, and why:

- Text blocks of one message (system, user, tool result) are joined with a newline, so a string and
  a list with one text block become the same `Message`. Claude Code moves `cache_control` to the
  newest block every turn, flipping that message between the two forms; token memory never notices.
- The `system` prompt is kept as sent, Claude Code's `x-anthropic-billing-header` block included:
  it is constant within a session (so token memory loses nothing) and it is what the policy will
  see when deployed behind Claude Code.
- A `tool_result` with `is_error: true` becomes a tool message starting "Error: ", so the model sees
  the failure the harness reported. Several tool results in one user turn become several tool
  messages; text beside them becomes a user message, in the order sent.
- `thinking` blocks are the assistant's reasoning; `redacted_thinking` is dropped (encrypted, nothing
  a model can read). `thinking.display == "omitted"` (Claude Code) is honoured: the block comes back
  with its signature but without its text; the record keeps every sampled token regardless.
- Images (in user turns and inside `tool_result`s) come in as base64 or as a `file` source naming
  an image uploaded to the gateway (`POST /v1/files`); a `url` source gets a 400, since the gateway
  fetches nothing (the record must hold the pixels). A message's images come before its text.
  Documents get a 400. So do server tools (a `type` other than "custom", e.g.
  `web_search_20250305`): nobody here runs them, and a model answering a search that never ran
  would fabricate the results. `defer_loading` is ignored: with no tool search, a
  deferred tool is listed like any other. A final assistant message (prefill) gets a 400: the chat
  template always opens a new turn.
- `usage.input_tokens` counts the prompt tokens not reused from token memory and
  `cache_read_input_tokens` the reused ones; their sum is the prompt length, as in Anthropic's API
  (Claude Code adds them up to decide when to compact).
- An engine that is down stays the core's 503, typed `api_error`; a 529 (injected faults) is an
  `overloaded_error`. Claude Code 2.1.332 retried five 503s in a row as it did five 529s, but it
  treats overload specially (`--fallback-model` switches models on it). After a stream has begun
  the status is spent, so engine trouble is an `overloaded_error` event, as Anthropic sends it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from openforgerl.conversation import Conversation, Message, SamplingRequest, Tool, ToolCall
from openforgerl.engines.parsers import Delta
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome, PreparedCall
from openforgerl.gateway.dialects import MAX_MESSAGES, MAX_TOOLS, validated
from openforgerl.gateway.errors import GatewayError, bad_request, load_image
from openforgerl.images import Image, image_from_base64, image_from_file

NAME = "anthropic"


class _Wire(BaseModel):
    # Claude Code sends many fields this gateway has no use for (cache_control, context_management,
    # safeguards, metadata, top_k, ...); they are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ImageSource(_Wire):
    type: str
    media_type: str | None = None  # not trusted: the type is read from the bytes
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


class ImageBlock(_Wire):
    type: Literal["image"]
    source: ImageSource


class DocumentBlock(_Wire):
    type: Literal["document"]


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = ""
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


ResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str = ""


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"]


Block = Annotated[
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class WireMessage(_Wire):
    # "system" inside `messages` is not in Anthropic's public API, but Claude Code sends it.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(_Wire):
    type: str | None = None  # absent or "custom": a function the client runs
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingConfig(_Wire):
    type: str
    display: str | None = None


class OutputConfig(_Wire):
    format: dict[str, Any] | None = None


class MessagesRequest(_Wire):
    model: str
    messages: list[WireMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    # Required by Anthropic's API; optional here, so the run's policy supplies the default.
    max_tokens: int | None = Field(default=None, ge=1, strict=True)  # not "10", not true
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's older spelling


def _unsupported(block: Block, param: str, place: str) -> GatewayError:
    if isinstance(block, DocumentBlock):
        return bad_request(
            "Document input is not supported by this gateway: send text or images.", param=param
        )
    return bad_request(f"'{block.type}' blocks are not allowed in {place}.", param=param)


def _image(block: ImageBlock, files: Mapping[str, Image], where: str) -> Image:
    source = block.source
    if source.type == "base64":
        data = source.data or ""
        return load_image(lambda: image_from_base64(data), f"{where}.source.data")
    if source.type == "file":
        ref = source.file_id or ""
        return load_image(lambda: image_from_file(ref, files), f"{where}.source.file_id")
    if source.type == "url":
        raise bad_request(
            "Image source type 'url' is not supported: this gateway fetches nothing (its record must hold "
            "the pixels). Send the image as a 'base64' source, or upload it (POST /v1/files) and use a "
            "'file' source.",
            param=f"{where}.source.type",
        )
    raise bad_request(
        f"Image source type '{source.type}' is not supported: use 'base64' or 'file'.",
        param=f"{where}.source.type",
    )


def _result(
    content: str | Sequence[ResultPart], files: Mapping[str, Image], where: str
) -> tuple[str, list[Image]]:
    """A tool result's text (its text blocks, one per line) and its images."""
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    images: list[Image] = []
    for i, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            images.append(_image(block, files, f"{where}.{i}"))
        else:
            raise _unsupported(block, f"{where}.{i}.type", "tool results")
    return "\n".join(texts), images


def _text(content: str | Sequence[Block], where: str, place: str) -> str:
    """The text of content that holds text blocks only (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, TextBlock):
            raise _unsupported(block, f"{where}.{i}.type", place)
        texts.append(block.text)
    return "\n".join(texts)


def _user(content: str | list[Block], files: Mapping[str, Image], where: str) -> list[Message]:
    """One user turn: each tool_result becomes a tool message, runs of text and images become user
    messages (images first)."""
    if isinstance(content, str):
        return [Message("user", content)]
    out: list[Message] = []
    texts: list[str] = []
    images: list[Image] = []

    def flush() -> None:
        if texts or images:
            out.append(Message("user", "\n".join(texts), images=list(images)))
            texts.clear()
            images.clear()

    for i, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            images.append(_image(block, files, f"{where}.{i}"))
        elif isinstance(block, ToolResultBlock):
            flush()
            body, shown = _result(block.content, files, f"{where}.{i}.content")
            out.append(
                Message(
                    "tool",
                    "Error: " + body if block.is_error else body,
                    tool_call_id=block.tool_use_id,
                    images=shown,
                )
            )
        else:
            raise _unsupported(block, f"{where}.{i}.type", "user messages")
    flush()
    return out or [Message("user", "")]


def _assistant(content: str | list[Block], where: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    texts, reasoning, calls = [], [], []
    for i, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(block.name, block.input, block.id))
        elif not isinstance(block, RedactedThinkingBlock):
            raise _unsupported(block, f"{where}.{i}.type", "assistant messages")
    return Message(
        "assistant", "\n".join(texts), reasoning="\n".join(r for r in reasoning if r), tool_calls=calls
    )


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    """Recorded in OpenAI's spelling, the one every dialect's records share."""
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs the tool's 'name'.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _tools(tools: list[ToolDef] | None) -> list[Tool]:
    out = []
    for i, t in enumerate(tools or []):
        if t.type not in (None, "custom"):
            raise bad_request(
                f"Tool type '{t.type}' is a server tool, which this gateway cannot run; only custom "
                "tools ({name, description, input_schema}) are supported.",
                param=f"tools.{i}.type",
            )
        if t.input_schema is None:
            raise bad_request("Custom tools need an 'input_schema'.", param=f"tools.{i}.input_schema")
        out.append(Tool(t.name, t.description or "", t.input_schema))
    return out


def _validation_error(exc: ValidationError) -> GatewayError:
    # The deepest error is the telling one: a union's other members fail at its root.
    err = max(exc.errors(), key=lambda e: len(e["loc"]))
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err['msg']}")
    # Drop pydantic's union-member labels ('str', 'list[...]') so the path reads like the body.
    loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p == "str")))
    if not loc:
        return bad_request(f"The request body must be a JSON object: {err['msg']}")
    return bad_request(f"Invalid value for '{loc}': {err['msg']}", param=loc)


def parse_request(
    body: bytes, files: Mapping[str, Image] | None = None
) -> tuple[Conversation, MessagesRequest]:
    """The body as a Conversation (and the validated wire request); GatewayError 400 if malformed."""
    req = validated(MessagesRequest, body, _validation_error)
    messages: list[Message] = []
    if req.system is not None:
        messages.append(Message("system", _text(req.system, "system", "system prompts")))
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if m.role == "user":
            messages += _user(m.content, files or {}, where)
        elif m.role == "assistant":
            messages.append(_assistant(m.content, where))
        else:
            messages.append(Message("system", _text(m.content, where, "system messages")))
    if req.messages[-1].role == "assistant":
        # The chat template always opens a new assistant turn, so a prefill cannot be continued.
        raise bad_request(
            "A final assistant message (prefill) is not supported: end with a user message.",
            param=f"messages.{len(req.messages) - 1}.role",
        )
    # temperature, top_p, max_tokens, stop (Anthropic's API takes no seed)
    sampling = SamplingRequest(req.temperature, req.top_p, req.max_tokens, list(req.stop_sequences or []))
    conv = Conversation(
        model=req.model,
        messages=messages,
        tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice),
        response_format=(req.output_config.format if req.output_config else None) or req.output_format,
        sampling=sampling,
        stream=req.stream,
        dialect=NAME,
    )
    return conv, req


# -- answers ---------------------------------------------------------------------------------


def _usage(prompt_tokens: int, reused: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - reused,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": reused,
        "output_tokens": output_tokens,
    }


class MessagesExchange(serving.Exchange):
    """One Messages request: its answer as a message or as the stream of its events."""

    def __init__(self, conv: Conversation, req: MessagesRequest) -> None:
        self.conv, self.req = conv, req
        self.id = f"msg_{secrets.token_hex(12)}"
        # Claude Code asks for `display: "omitted"`: the block comes, its text does not.
        self.hide_thinking = req.thinking is not None and req.thinking.display == "omitted"
        # The stream's state: the open block and its index, the tool calls to send at the end.
        self.block: str | None = None
        self.index = -1
        self.calls: list[ToolCall] = []

    def content(self, out: CallOutcome) -> list[dict[str, Any]]:
        m = out.message
        blocks: list[dict[str, Any]] = []
        if m.reasoning:
            blocks.append(
                {
                    "type": "thinking",
                    "thinking": "" if self.hide_thinking else m.reasoning,
                    "signature": self.signature,
                }
            )
        if m.content:
            blocks.append({"type": "text", "text": m.content})
        blocks += [self.tool_use(c) for c in m.tool_calls]
        return blocks

    @property
    def signature(self) -> str:
        # Opaque to clients, who send it back unchanged; nothing here checks it.
        return f"openforgerl-{self.id}"

    @staticmethod
    def tool_use(call: ToolCall) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": call.id if call.id.startswith("toolu_") else "toolu_" + call.id.removeprefix("call_"),
            "name": call.name,
            # The completion parser only yields JSON objects; only an upstream's answer can hold
            # arguments that are not one, and `input` must be an object.
            "input": call.arguments if isinstance(call.arguments, dict) else {},
        }

    def stop(self, out: CallOutcome) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence."""
        if out.finish_reason == "length":
            return "max_tokens", None
        if out.finish_reason == "tool_calls":
            return "tool_use", None
        if isinstance(out.stop_reason, str):
            return "stop_sequence", out.stop_reason
        return "end_turn", None

    def body(self, out: CallOutcome) -> bytes:
        stop_reason, stop_sequence = self.stop(out)
        return orjson.dumps(
            {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.req.model,
                "content": self.content(out),
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": _usage(out.prompt_tokens, out.cached_tokens, out.completion_tokens),
            }
        )

    def stream_start(self, call: PreparedCall) -> bytes:
        """message_start (the prompt is known before generation) and a ping."""
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(len(call.plan.prompt_ids), call.plan.prefix_len, 0),
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _event(
            "ping", {"type": "ping"}
        )

    # -- the stream: thinking and text blocks as they are sampled; tool_use blocks at the end, since
    # text that follows a call belongs to the one text block that precedes the calls.
    def stream_delta(self, delta: Delta) -> bytes:
        events: list[bytes] = []
        if delta.reasoning:
            events += self._open("thinking")
            if not self.hide_thinking:
                events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._open("text")
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        if delta.tool_call is not None:
            self.calls.append(delta.tool_call)
        return b"".join(events)

    def _open(self, kind: str) -> list[bytes]:
        if self.block == kind:
            return []
        events = self._close()
        self.block, self.index = kind, self.index + 1
        start = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        events.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": start},
            )
        )
        return events

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        events = []
        if self.block == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": self.signature}))
        events.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.block = None
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def stream_end(self, out: CallOutcome) -> bytes:
        """The open block's end, each tool_use block, then message_delta and message_stop."""
        events = self._close()
        for call in self.calls:
            block = self.tool_use(call)
            self.index += 1
            events += [
                _event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": self.index,
                        "content_block": {**block, "input": {}},
                    },
                ),
                self._delta(
                    {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
                ),
                _event("content_block_stop", {"type": "content_block_stop", "index": self.index}),
            ]
        stop_reason, stop_sequence = self.stop(out)
        events.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": _usage(out.prompt_tokens, out.cached_tokens, out.completion_tokens),
                },
            )
        )
        events.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(events)

    def stream_error(self, err: GatewayError) -> bytes:
        return stream_error(err)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# -- errors ----------------------------------------------------------------------------------

_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "too_large": "request_too_large",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "unavailable": "api_error",
    "internal": "api_error",
}


def _message(err: GatewayError) -> str:
    if err.kind == "context_length":
        # Anthropic's wording, which Claude Code recognises to compact its context and retry.
        d = err.details
        return f"prompt is too long: {d['prompt_tokens']} tokens > {d['max_context']} maximum"
    return err.message


def error_body(err: GatewayError, overloaded: bool = False) -> bytes:
    error_type = "overloaded_error" if overloaded or err.status == 529 else _TYPES[err.kind]
    return orjson.dumps({"type": "error", "error": {"type": error_type, "message": _message(err)}})


def stream_error(err: GatewayError) -> bytes:
    """An error after the stream began (engine trouble): an SSE `error` event the SDK raises."""
    # The status is already 200, so only the type can say "transient": Anthropic's own word for it.
    transient = err.kind in ("rate_limit", "unavailable")
    return b"event: error\ndata: " + error_body(err, overloaded=transient) + b"\n\n"


class AnthropicMessages(serving.JSONErrors):
    """`POST /v1/messages`, `POST /v1/messages/count_tokens`, and the probes Claude Code sends."""

    name = NAME
    owned = re.compile(r"^(/r/[^/]+)?(/v1/messages(/.*)?|/api/hello)$")
    error_body = staticmethod(error_body)

    def routes(self, host: serving.Host) -> list[serving.RouteSpec]:
        def parse(body: bytes, files: Mapping[str, Image], _: serving.Incoming) -> MessagesExchange:
            return MessagesExchange(*parse_request(body, files))

        async def probe(request: Request) -> dict[str, Any]:
            # Claude Code checks that the endpoint is up (HEAD /api/hello, the base URL) before it starts.
            return {"status": "ok"}

        return [
            serving.CallRoute("/v1/messages", parse),
            serving.CountRoute(
                "/v1/messages/count_tokens",
                lambda body, files, _: parse_request(body, files)[0],
                lambda tokens: {"input_tokens": tokens},
            ),
            serving.InfoRoute("/api/hello", probe, ("GET", "HEAD")),
            serving.InfoRoute("", probe, ("GET", "HEAD")),
        ]
