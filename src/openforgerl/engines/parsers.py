"""Split a completion's text into reasoning, content and tool calls (Hermes / Qwen formats).

    <think>reasoning</think>content<tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

Parsing never raises: a malformed tool call stays in `content` as the text the model wrote and is
described in `errors`, so nothing the model sampled is lost.

Tool call ids are deterministic: `call_` + a hash of the completion text and the call's index, so
re-parsing the same completion gives the same ids. Callers that need ids unique across identical
completions should assign their own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from openforgerl.conversation import ToolCall
from openforgerl.jsonutil import check_depth

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ParsedCompletion:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_completion(text: str, *, in_reasoning: bool = False) -> ParsedCompletion:
    """Parse one completion. `in_reasoning`: the prompt already opened `<think>` (the template did).

    Reasoning is a leading `<think>...</think>`; without the closing tag (generation was cut) the
    rest of the text is reasoning. Text before a `</think>` that no `<think>` opened (and no tool call
    precedes) is reasoning as well, since templates that open the block themselves produce exactly that.
    """
    reasoning, rest = _split_reasoning(text, in_reasoning)
    content, calls, errors = _split_tool_calls(rest, text)
    return ParsedCompletion(
        content=content.strip(), reasoning=reasoning.strip(), tool_calls=calls, errors=errors
    )


def _split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    body = text
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        body, in_reasoning = stripped[len(THINK_START) :], True
    end = body.find(THINK_END)
    if end < 0:
        return (body, "") if in_reasoning else ("", text)
    # Without an opening tag, a `</think>` counts only ahead of any tag: reasoning comes first.
    if in_reasoning or not any(tag in body[:end] for tag in (THINK_START, TOOL_CALL_START)):
        return body[:end], body[end + len(THINK_END) :]
    return "", text


def _split_tool_calls(text: str, completion: str) -> tuple[str, list[ToolCall], list[str]]:
    """(text outside well-formed calls, the calls, one error per malformed call)."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        pieces.append(text[pos:start])
        body_start = start + len(TOOL_CALL_START)
        found, end, error = _parse_call(text, body_start)
        if found is not None:
            for call in found:
                call.id = _call_id(completion, len(calls))
                calls.append(call)
        else:
            errors.append(f"tool call at offset {start}: {error}")
            pieces.append(text[start:end])  # keep what the model wrote
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces), calls, errors


def _parse_call(text: str, body_start: int) -> tuple[list[ToolCall] | None, int, str]:
    """The calls whose body starts at `body_start`, the offset after it, and an error when it is malformed.

    Every closing tag is tried in turn, because a JSON string inside the call may itself contain
    `</tool_call>`; the first that closes a valid call wins.
    """
    first_error = ""
    first_close = -1
    close = text.find(TOOL_CALL_END, body_start)
    while close >= 0:
        found, error = _calls_from_json(text[body_start:close])
        end = close + len(TOOL_CALL_END)
        if found is not None:
            return found, end, ""
        if first_close < 0:
            first_close, first_error = end, error
        close = text.find(TOOL_CALL_END, end)
    next_start = text.find(TOOL_CALL_START, body_start)
    if first_close < 0 or 0 <= next_start < first_close:
        # Unclosed: the malformed span runs to the next call, or to the end of the text.
        return None, next_start if next_start >= 0 else len(text), f"{TOOL_CALL_START} is not closed"
    return None, first_close, first_error


def _calls_from_json(body: str) -> tuple[list[ToolCall] | None, str]:
    """One call (a JSON object), or several in a JSON list (SmolLM2's own tool format writes
    `<tool_call>[{...}, {...}]</tool_call>`)."""
    try:
        obj = json.loads(body)
        check_depth(obj)
    except (ValueError, RecursionError) as e:
        return None, f"invalid JSON ({e})"
    objs = obj if isinstance(obj, list) and obj else [obj]
    calls = []
    for one in objs:
        call, error = _call_from_object(one)
        if call is None:
            return None, error
        calls.append(call)
    return calls, ""


def _call_from_object(obj: Any) -> tuple[ToolCall | None, str]:
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "missing function name"
    args: Any = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    elif isinstance(args, str):
        # Some models emit the arguments as a JSON-encoded string, as OpenAI's wire format does.
        try:
            args = json.loads(args)
            check_depth(args)
        except (ValueError, RecursionError) as e:
            return None, f"arguments string is not JSON ({e})"
    if not isinstance(args, dict):
        return None, "arguments are not a JSON object"
    return ToolCall(name=name, arguments=args), ""


def _call_id(completion: str, index: int) -> str:
    digest = hashlib.sha256(f"{index}\0{completion}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"call_{digest[:24]}"
