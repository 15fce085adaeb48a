"""The Messages API's wire format: the request's models (its content blocks, tools, thinking) and
the error body, as Anthropic spells them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from openforgerl.gateway.dialects import MAX_MESSAGES, MAX_TOOLS
from openforgerl.gateway.errors import GatewayError

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
