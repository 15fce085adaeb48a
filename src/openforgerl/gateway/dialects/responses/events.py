"""A response being answered (`Reply`): its Response object, the numbered events of its SSE stream
or WebSocket frames (opening, deltas as items open and close, the end, a failure), and, once it is
answered, its context remembered for the rollout."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson
from starlette.responses import Response

from openforgerl import jsonutil
from openforgerl.conversation import (
    ToolCall,
)
from openforgerl.engines.parsers import Delta
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome, PreparedCall
from openforgerl.gateway.dialects.openai_chat import error_body
from openforgerl.gateway.dialects.responses.chaining import Context, Turn
from openforgerl.gateway.errors import GatewayError
from openforgerl.gateway.http import JSONResponse
from openforgerl.gateway.streaming import message_deltas


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
