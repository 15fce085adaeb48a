"""An answer in the Messages API's shape: one message, or the stream of its events (blocks opened,
their deltas, closed; the tool calls at the end; the usage)."""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from openforgerl.conversation import Conversation, ToolCall
from openforgerl.engines.parsers import Delta
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome, PreparedCall
from openforgerl.gateway.dialects.anthropic.protocol import MessagesRequest, stream_error
from openforgerl.gateway.errors import GatewayError


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
