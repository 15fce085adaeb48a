"""A Responses request's parts in the gateway's own terms, with no state: `input` items as
conversation messages (an answer's assistant-side items merged into one message), tools (a
namespace's functions flattened, hosted and custom tools declined), `text.format` and
`tool_choice` in the Chat Completions shape the rest of the gateway records."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from openforgerl.conversation import (
    Message,
    Role,
    Tool,
    ToolCall,
    parse_arguments,
)
from openforgerl.gateway.dialects.responses.protocol import (
    ITEMS,
    TEXT_PARTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolDef,
    MessageItem,
    NamespaceToolDef,
    Part,
    ReasoningItem,
    TextConfig,
    validate,
)
from openforgerl.gateway.errors import bad_request, load_image
from openforgerl.images import Image, image_from_file, image_from_url

log = logging.getLogger(__name__)


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
        if part.type in TEXT_PARTS:
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
        model = ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(
                f"Input item type {kind!r} is not supported by this gateway: send message, function_call, "
                "function_call_output or reasoning items.",
                param=f"{where}.type",
            )
        item = validate(model, raw, where)
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
    return cast(FunctionToolDef, validate(FunctionToolDef, raw, where))


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
            ns = cast(NamespaceToolDef, validate(NamespaceToolDef, raw, where))
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


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
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


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
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
