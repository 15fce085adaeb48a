"""A Messages request as a `Conversation`: its blocks as messages, its tools and tool choice, its
sampling; a 400 worded like the body for what is malformed or not served."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from openforgerl.conversation import Conversation, Message, SamplingRequest, Tool, ToolCall
from openforgerl.gateway.dialects import validated
from openforgerl.gateway.dialects.anthropic.protocol import (
    NAME,
    Block,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    ResultPart,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)
from openforgerl.gateway.errors import GatewayError, bad_request, load_image
from openforgerl.images import Image, image_from_base64, image_from_file


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
