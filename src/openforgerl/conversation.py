"""The gateway's one internal conversation type.

Every dialect translator converts its wire format to and from these types; nothing outside a
translator knows a dialect. They are plain dataclasses so the hot path stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from openforgerl.images import Image
from openforgerl.jsonutil import loads

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(slots=True)
class ToolCall:
    """A function call the model made. `arguments` is the parsed JSON object when it parsed."""

    name: str
    # The parsed JSON object; the raw string when the caller sent arguments that are not JSON.
    arguments: dict[str, Any] | str
    id: str = ""


def parse_arguments(raw: str | dict[str, Any]) -> dict[str, Any] | str:
    """Tool-call arguments as a dialect sent them: the JSON object, or the raw string when it is not
    one (kept as the harness sent it; the template renders it verbatim)."""
    if isinstance(raw, dict):
        return raw
    try:
        parsed = loads(raw) if raw else {}
    except ValueError:  # not JSON, or nested deeper than the gateway reads: kept as text
        return raw
    return parsed if isinstance(parsed, dict) else raw


@dataclass(slots=True)
class Message:
    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""
    # Images the message shows, in order. They come before the message's text: the order
    # vision-language chat templates (and the harnesses' screenshots + question) use.
    images: list[Image] = field(default_factory=list)

    def template_dict(self) -> dict[str, Any]:
        """The shape HF chat templates expect (OpenAI-like, arguments as a mapping); with images,
        content is the processor's list of parts: one {"type": "image"} per image, then the text."""
        content: Any = self.content
        if self.images:
            content = [{"type": "image"} for _ in self.images]
            if self.content:
                content.append({"type": "text", "text": self.content})
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


@dataclass(slots=True)
class Tool:
    """A function the model may call; `parameters` is a JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def template_dict(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(slots=True)
class SamplingRequest:
    """What the caller asked for; None means 'not specified'. The run's policy decides the rest."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass(slots=True)
class Conversation:
    """One model call as the gateway sees it, whatever dialect it arrived in."""

    model: str
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    stream: bool = False
    dialect: str = "openai"


def side_request_reason(requested: dict[str, Any], rollout_uses_tools: bool) -> str:
    """Why a call looks like a side request (title, router, memory extraction), '' if it does not;
    `requested`: the call's recorded `sampling_requested` (what its Conversation asked for).

    Harnesses send these through the same endpoint and key; training may include or skip them.
    """
    reasons = []
    if requested.get("response_format"):
        reasons.append("asks for structured output")
    if rollout_uses_tools and not requested.get("tools"):
        reasons.append("no tools while the rollout's conversation has them")
    return "; ".join(reasons)
