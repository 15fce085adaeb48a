"""The Responses API's wire format as this gateway reads it: the request and its input items,
tools and text format as pydantic models (fields a harness sends that the gateway has no use for
are accepted and ignored), and a validation error as the 400 OpenAI's clients expect."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openforgerl.gateway.dialects import MAX_MESSAGES, MAX_TOOLS
from openforgerl.gateway.errors import GatewayError, bad_request

NAME = "openai-responses"


class Wire(BaseModel):
    # Harnesses send many fields this gateway has no use for; they are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class Part(Wire):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # the model sees the image as sent, whatever the detail asked


class MessageItem(Wire):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(Wire):
    call_id: str
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""
    namespace: str | None = None


class FunctionCallOutputItem(Wire):
    call_id: str
    output: str | list[Part]


class ReasoningItem(Wire):
    summary: list[Part] = []
    content: list[Part] | None = None


class FunctionToolDef(Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceToolDef(Wire):
    name: str = Field(min_length=1)
    description: str = ""
    tools: list[dict[str, Any]] = []


class TextFormat(Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Wire):
    format: TextFormat | None = None


class ResponsesRequest(Wire):
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


ITEMS: dict[str, type[Wire]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def invalid(exc: ValidationError, prefix: str = "") -> GatewayError:
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err['msg']}")
    loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    if not loc:
        return bad_request(f"The request body must be a JSON object: {err['msg']}")
    return bad_request(f"Invalid value for '{loc}': {err['msg']}", param=loc)


def validate(model: type[Wire], data: Any, where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, where) from exc
