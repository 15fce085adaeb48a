"""An answer streamed while the engine samples it: token ids -> text -> deltas for the dialects.

The engine hands over ids as they are sampled (`Engine.generate(on_tokens=...)`); `AnswerStream`
decodes them incrementally, holds back what a stop string may still cut, and parses the text with
`CompletionStream`, so each dialect can send text, reasoning and tool calls as they come. When the
call has finished, `finish` compares what was sent with the final message (the record's, parsed
from the whole completion) and sends the rest: the deltas always reassemble into exactly the
answer a non-streamed call gets, and an engine that cannot stream still streams, all at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

from openforgerl.conversation import Message, ToolCall
from openforgerl.engines.parsers import CompletionStream, Delta, partial_suffix

logger = logging.getLogger(__name__)

Emit = Callable[[Delta], None]


def message_deltas(message: Message) -> list[Delta]:
    """A whole answer as deltas (an engine or upstream that did not stream)."""
    deltas = [Delta(reasoning=message.reasoning), Delta(content=message.content)]
    deltas += [Delta(tool_call=c) for c in message.tool_calls]
    return [d for d in deltas if d.reasoning or d.content or d.tool_call]


def _same_call(a: ToolCall, b: ToolCall) -> bool:
    return (a.name, a.arguments, a.id) == (b.name, b.arguments, b.id)


class AnswerStream:
    """One call's answer as it streams. `tokens` is the engine's token sink (on the event loop)."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_ids: Collection[int],
        stops: Sequence[str],
        emit: Emit,
        *,
        in_reasoning: bool = False,
    ) -> None:
        self.decode, self.stop_ids, self.stops, self.emit = decode, stop_ids, [s for s in stops if s], emit
        self.parser = CompletionStream(in_reasoning=in_reasoning)
        self.ids: list[int] = []
        # Incremental detokenising as vLLM does it: the text of ids[prefix:] minus that of
        # ids[prefix:read] is what the newest ids add (a slice decoded alone may differ at its start).
        self._prefix = self._read = 0
        self.text = ""  # decoded so far
        self._fed = 0  # characters of `text` given to the parser
        self._stopped = False  # a stop string appeared: the rest is cut from the answer
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []
        self.mismatches = 0

    def tokens(self, ids: Sequence[int]) -> None:
        if self._stopped:
            return
        # The id that ends the turn is not part of the answer's text (it ends the engine's output).
        self.ids += [t for t in ids if t not in self.stop_ids]
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # a character not complete yet
            return
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        limit = len(self.text)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self._fed - len(stop)))
            if at >= 0:
                limit, self._stopped = min(limit, at), True
        if not self._stopped and self.stops:
            limit -= max(partial_suffix(self.text, s) for s in self.stops)
        if limit > self._fed:
            for delta in self.parser.feed(self.text[self._fed : limit]):
                self._send(delta)
            self._fed = limit

    def _send(self, delta: Delta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        if delta.tool_call is not None:
            self.calls.append(delta.tool_call)
        self.emit(delta)

    def finish(self, message: Message) -> None:
        """Send what the final answer holds beyond what was streamed."""
        sent = len(self.calls)
        rest = [
            Delta(reasoning=message.reasoning.removeprefix(self.reasoning)),
            Delta(content=message.content.removeprefix(self.content)),
            *(Delta(tool_call=c) for c in message.tool_calls[sent:]),
        ]
        if not (
            message.reasoning.startswith(self.reasoning)
            and message.content.startswith(self.content)
            and len(message.tool_calls) >= sent
            and all(_same_call(a, b) for a, b in zip(self.calls, message.tool_calls, strict=False))
        ):
            # Never expected (the stream's parse is the final parse's prefix); the client's copy of
            # the answer now differs from the record's, so say so.
            self.mismatches += 1
            logger.warning(
                "a streamed answer differs from its final parse: sent reasoning %r content %r and %d "
                "calls; final reasoning %r content %r and %d calls",
                self.reasoning[-80:],
                self.content[-80:],
                sent,
                message.reasoning[-80:],
                message.content[-80:],
                len(message.tool_calls),
            )
        for delta in rest:
            if delta.reasoning or delta.content or delta.tool_call:
                self._send(delta)
