"""Split a completion's text into reasoning, content and tool calls (Hermes / Qwen formats).

    <think>reasoning</think>content<tool_call>
    {"name": "f", "arguments": {...}}
    </tool_call>

Parsing never raises: a malformed tool call stays in `content` as the text the model wrote and is
described in `errors`, so nothing the model sampled is lost.

Tool call ids are deterministic: `call_` + a hash of the call's index and the completion's text up
to the end of the call, so re-parsing the same completion gives the same ids, and a stream knows a
call's id as soon as the call is closed. Callers that need ids unique across identical completions
should assign their own.

`CompletionStream` is the same parse done incrementally, for answers streamed while the model
samples: what it releases is always a prefix of what `parse_completion` gives for the whole text.
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
    """Parse one completion. `in_reasoning`: the prompt already opened `<think>` (the template did:
    `prompt_opens_reasoning`), so the completion starts inside the reasoning block.

    Reasoning is a leading `<think>...</think>` (or, with `in_reasoning`, the text up to the first
    `</think>`); without the closing tag (generation was cut) the rest of the text is reasoning. A
    `</think>` that nothing opened is content: deciding otherwise would need the whole text, and a
    stream has already shown that text as the answer.
    """
    reasoning, rest = _split_reasoning(text, in_reasoning)
    content, calls, errors = _split_tool_calls(rest, text)
    return ParsedCompletion(
        content=content.strip(), reasoning=reasoning.strip(), tool_calls=calls, errors=errors
    )


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters will do) leaves the model inside `<think>`."""
    return prompt_tail.rstrip().endswith(THINK_START)


def _split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    body = text
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        body, in_reasoning = stripped[len(THINK_START) :], True
    if not in_reasoning:
        return "", text
    end = body.find(THINK_END)
    if end < 0:
        return body, ""
    return body[:end], body[end + len(THINK_END) :]


def _split_tool_calls(text: str, completion: str) -> tuple[str, list[ToolCall], list[str]]:
    """(text outside well-formed calls, the calls, one error per malformed call)."""
    pieces: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    offset = len(completion) - len(text)  # `text` is the completion's tail after the reasoning
    while (start := text.find(TOOL_CALL_START, pos)) >= 0:
        pieces.append(text[pos:start])
        body_start = start + len(TOOL_CALL_START)
        found, end, error = _parse_call(text, body_start)
        if found is not None:
            for call in found:
                call.id = _call_id(completion[: offset + end], len(calls))
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


def _call_id(through_call: str, index: int) -> str:
    """The id of the `index`th call, from the completion's text up to the end of that call."""
    digest = hashlib.sha256(f"{index}\0{through_call}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"call_{digest[:24]}"


@dataclass(slots=True)
class Delta:
    """A piece of an answer as it is streamed: reasoning text, content text, or a whole tool call."""

    reasoning: str = ""
    content: str = ""
    tool_call: ToolCall | None = None


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class CompletionStream:
    """`parse_completion`, incrementally: `feed` it the completion's text as it is decoded; the deltas
    it releases are always a prefix of the whole text's parse, in its order (reasoning, then content,
    with each tool call once it is closed and valid).

    Held back until the text decides them: whitespace that the final strip may drop, the possible
    start of a tag, and everything after a tool call opens until a closing tag makes it a valid call
    (a malformed call's text becomes content only once the whole text is known; `finish` is then
    the caller's: compare with the final parse and send the rest).
    """

    def __init__(self, *, in_reasoning: bool = False) -> None:
        self.text = ""
        self.in_reasoning = in_reasoning
        self._pos = 0  # text[:_pos] is decided
        self._mode = "start"  # start | reasoning | content | call
        self._tried = 0  # in a call: where the next closing tag is looked for
        self._pending_ws = ""  # whitespace released only if more text follows
        self._started = False  # the current section (reasoning/content) has shown text
        self._content_started = False
        self.calls = 0

    def feed(self, chunk: str) -> list[Delta]:
        self.text += chunk
        out: list[Delta] = []
        while True:
            before = (self._mode, self._pos)
            step = getattr(self, "_" + self._mode)()
            out += step
            if (self._mode, self._pos) == before:
                return [d for d in out if d.reasoning or d.content or d.tool_call]

    def _start(self) -> list[Delta]:
        rest = self.text[self._pos :]
        stripped = rest.lstrip()
        if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
            return []  # nothing yet, or what may still become `<think>`
        if stripped.startswith(THINK_START):
            self._pos += len(rest) - len(stripped) + len(THINK_START)
            self._mode = "reasoning"
        else:
            self._mode = "reasoning" if self.in_reasoning else "content"
        return []

    def _section(self, tag: str) -> tuple[str, bool]:
        """The undecided text up to `tag` (True) or up to what may be its start (False)."""
        rest = self.text[self._pos :]
        end = rest.find(tag)
        if end >= 0:
            self._pos += end + len(tag)
            return rest[:end], True
        keep = len(rest) - partial_suffix(rest, tag)
        self._pos += keep
        return rest[:keep], False

    def _released(self, piece: str, started: bool) -> tuple[str, bool]:
        """`piece` as released, without leading whitespace of the section (the final strip drops it)
        and with its trailing whitespace held until more text follows."""
        piece = self._pending_ws + piece
        if not started:
            piece = piece.lstrip()
        body = piece.rstrip()
        self._pending_ws = piece[len(body) :]
        return body, started or bool(body)

    def _reasoning(self) -> list[Delta]:
        piece, closed = self._section(THINK_END)
        text, self._started = self._released(piece, self._started)
        if closed:
            self._mode, self._pending_ws = "content", ""
        return [Delta(reasoning=text)]

    def _content(self) -> list[Delta]:
        piece, opened = self._section(TOOL_CALL_START)
        text, self._content_started = self._released(piece, self._content_started)
        if opened:
            self._pos -= len(TOOL_CALL_START)  # the call starts at its tag
            self._mode, self._tried = "call", self._pos + len(TOOL_CALL_START)
        return [Delta(content=text)]

    def _call(self) -> list[Delta]:
        body_start = self._pos + len(TOOL_CALL_START)
        while (close := self.text.find(TOOL_CALL_END, self._tried)) >= 0:
            self._tried = close + len(TOOL_CALL_END)
            found, _ = _calls_from_json(self.text[body_start:close])
            if found is not None:
                for call in found:
                    call.id = _call_id(self.text[: self._tried], self.calls)
                    self.calls += 1
                self._pos, self._mode = self._tried, "content"
                return [Delta(tool_call=c) for c in found]
        return []
