"""Streamed answers: pieces go out as the engine samples them, and reassemble into exactly the
non-streamed answer, with the same record.

- The incremental parse (`AnswerStream` over `CompletionStream`) against `parse_completion`, on
  generated completions cut into random runs of ids: what it sends before the end is always a prefix
  of the final parse, and the rest completes it.
- Through the gateway, in each dialect with its official SDK: the engine holds its generation after a
  few tokens until the client has seen a piece of the answer (ordering, never timing), the streamed
  answer equals a non-streamed call's, and the two records are the same.
- The built-in engine with the tiny model generating: its token sink gets every sampled id, in order,
  before `generate` returns.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from anthropic import Anthropic
from google import genai
from google.genai import types
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI

from openforgerl.conversation import Message
from openforgerl.engines.base import SamplingParams
from openforgerl.engines.parsers import Delta, parse_completion
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.gateway.streaming import AnswerStream
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway

CALL = '{"name": "shell", "arguments": {"cmd": "ls -la </tool_call>"}}'
FRAGMENTS = st.one_of(
    st.text(alphabet="ab <>/\n{}:", max_size=5),
    st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", " ", "\n\n", CALL, "STOP", "<"]),
    st.just(f"<tool_call>{CALL}</tool_call>"),
)


def _decode(ids: Any) -> str:
    return "".join(chr(i) for i in ids)


def _joined(deltas: list[Delta]) -> tuple[str, str, list[tuple[str, Any, str]]]:
    calls = [(d.tool_call.name, d.tool_call.arguments, d.tool_call.id) for d in deltas if d.tool_call]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), calls


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(FRAGMENTS, max_size=14),
    runs=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    in_reasoning=st.booleans(),
    stops=st.sampled_from([(), ("STOP",)]),
)
def test_the_stream_sends_a_prefix_of_the_final_parse_and_the_rest_completes_it(
    pieces: list[str], runs: list[int], in_reasoning: bool, stops: tuple[str, ...]
) -> None:
    text = "".join(pieces)
    # A character-level engine: it stops at the first stop string (whose ids it keeps) or on id 0.
    if stops and "STOP" in text:
        ids, final_text = [ord(c) for c in text[: text.index("STOP") + 4]], text[: text.index("STOP")]
    else:
        ids, final_text = [ord(c) for c in text] + [0], text
    sent: list[Delta] = []
    stream = AnswerStream(_decode, {0}, stops, sent.append, in_reasoning=in_reasoning)
    pos = 0
    for n in itertools.cycle(runs):
        if pos >= len(ids):
            break
        stream.tokens(ids[pos : pos + n])
        pos += n
    parsed = parse_completion(final_text, in_reasoning=in_reasoning)
    final = Message("assistant", parsed.content, parsed.reasoning, parsed.tool_calls)
    before_end = _joined(list(sent))
    stream.finish(final)
    assert stream.mismatches == 0
    calls = [(c.name, c.arguments, c.id) for c in parsed.tool_calls]
    assert _joined(sent) == (parsed.reasoning, parsed.content, calls)
    assert parsed.reasoning.startswith(before_end[0]) and parsed.content.startswith(before_end[1])
    assert calls[: len(before_end[2])] == before_end[2]


def test_text_and_each_tool_call_go_out_before_the_generation_ends() -> None:
    text = f"<think> plan </think> Checking. <tool_call>{CALL}</tool_call> and <tool_call>{CALL}</tool_call>"
    sent: list[Delta] = []
    stream = AnswerStream(_decode, {0}, (), sent.append)
    at_first_call = None
    for i, c in enumerate(text):
        stream.tokens([ord(c)])
        if at_first_call is None and any(d.tool_call for d in sent):
            at_first_call = i
    # Sent as its real closing tag completed (the first `</tool_call>` is inside its JSON string).
    assert at_first_call == text.index("}}</tool_call>") + len("}}</tool_call>") - 1
    reasoning, content, calls = _joined(sent)
    # Everything but the whitespace the final strip may drop was sent before the end.
    assert (reasoning, content, len(calls)) == ("plan", "Checking.  and", 2)


# -- through the gateway, in each dialect --------------------------------------------------

ANSWER = "<think>\nFirst list the files.\n</think>\n\nLet me look at the files in this folder now.\n"
CALLS = ANSWER + f"<tool_call>\n{CALL}\n</tool_call>"
HOLD_AT = 8  # tokens sampled before the engine waits for the client to have seen a piece
SHELL = {"name": "shell", "description": "Run a command.", "parameters": {"type": "object"}}


class Gate:
    """Holds the engine after HOLD_AT tokens until the client has seen a piece of the answer."""

    def __init__(self, engine: ScriptEngine) -> None:
        self.opened = threading.Event()
        self.passed = False  # the engine went past the gate (opened, or given up after 30 s)
        self.seen_while_held = False
        engine.between_tokens = self.between

    async def between(self, n: int) -> None:
        if n == HOLD_AT:
            await asyncio.to_thread(self.opened.wait, 30)
            self.passed = True
        await asyncio.sleep(0)

    def seen(self) -> None:
        """The client got a piece of the answer."""
        if not self.opened.is_set():
            self.seen_while_held = not self.passed
            self.opened.set()


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("streaming"), engine, max_tokens=128) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g


def _same_records(gw: Any, streamed: dict[str, Any], whole: dict[str, Any], tolerance: float = 0.0) -> None:
    """The two calls' records hold the same (logprobs within `tolerance`: a model's float rounding
    differs with what shares its batch or cache)."""
    (a,), (b,) = calls_of(gw, streamed["rollout_id"]), calls_of(gw, whole["rollout_id"])
    keys = ["prompt_ids", "completion_ids", "response", "finish_reason", "parse_errors"]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["status"] == b["status"] == "ok"
    pairs = zip(a["completion_logprobs"], b["completion_logprobs"], strict=True)
    assert all(abs(x - y) <= tolerance for x, y in pairs)


@pytest.mark.parametrize("answer", [ANSWER, CALLS], ids=["text", "tool_call"])
def test_openai_chat_streams_pieces_that_reassemble_the_answer(gw: Any, answer: str) -> None:
    gw.engine.script = lambda prompt: answer
    ask: Any = {
        "model": "m",
        "messages": [{"role": "user", "content": "What is here?"}],
        "tools": [{"type": "function", "function": SHELL}],
    }
    whole_ro, streamed_ro = new_rollout(gw), new_rollout(gw)
    whole = OpenAI(
        base_url=whole_ro["base_url"] + "/v1", api_key=whole_ro["api_key"]
    ).chat.completions.create(**ask)
    gate = Gate(gw.engine)
    client = OpenAI(base_url=streamed_ro["base_url"] + "/v1", api_key=streamed_ro["api_key"])
    content, reasoning, calls = "", "", {}
    try:
        for chunk in client.chat.completions.create(**ask, stream=True):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            piece = (delta.content or "") + ((delta.model_extra or {}).get("reasoning_content") or "")
            if piece:
                gate.seen()
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for c in delta.tool_calls or []:
                got = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += c.id or ""
                got["name"] += c.function.name or "" if c.function else ""
                got["arguments"] += c.function.arguments or "" if c.function else ""
    finally:
        gw.engine.between_tokens = None
    assert gate.seen_while_held  # a piece arrived while the engine was still generating
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert reasoning == (message.model_extra or {}).get("reasoning_content", "")
    expected = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
        for c in message.tool_calls or []
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert len(expected) == (1 if answer == CALLS else 0)
    _same_records(gw, streamed_ro, whole_ro)


def test_anthropic_streams_thinking_and_text_that_reassemble_the_message(gw: Any) -> None:
    gw.engine.script = lambda prompt: CALLS
    ask: Any = {
        "model": "claude-x",
        "max_tokens": 128,
        "messages": [{"role": "user", "content": "What is here?"}],
        "tools": [{"name": "shell", "description": "Run a command.", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 64},
    }
    whole_ro, streamed_ro = new_rollout(gw), new_rollout(gw)
    whole = Anthropic(base_url=whole_ro["base_url"], api_key=whole_ro["api_key"]).messages.create(**ask)
    gate = Gate(gw.engine)
    client = Anthropic(base_url=streamed_ro["base_url"], api_key=streamed_ro["api_key"])
    try:
        with client.messages.stream(**ask) as stream:
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type in (
                    "thinking_delta",
                    "text_delta",
                ):
                    gate.seen()
            final = stream.get_final_message()
    finally:
        gw.engine.between_tokens = None
    assert gate.seen_while_held

    def blocks(message: Any) -> list[dict[str, Any]]:
        return [b.model_dump(exclude={"signature"}) for b in message.content]

    assert blocks(final) == blocks(whole) and [b["type"] for b in blocks(final)] == [
        "thinking",
        "text",
        "tool_use",
    ]
    assert final.stop_reason == whole.stop_reason == "tool_use"
    _same_records(gw, streamed_ro, whole_ro)


def test_gemini_streams_parts_that_reassemble_the_answer(gw: Any) -> None:
    gw.engine.script = lambda prompt: CALLS
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(name="shell", description="Run.")])
    config = types.GenerateContentConfig(
        tools=[tool],
        thinking_config=types.ThinkingConfig(include_thoughts=True),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    whole_ro, streamed_ro = new_rollout(gw), new_rollout(gw)

    def client(ro: dict[str, Any]) -> genai.Client:
        return genai.Client(api_key=ro["api_key"], http_options=types.HttpOptions(base_url=ro["base_url"]))

    asker = client(whole_ro)  # kept: a client that is collected closes its connections
    whole = asker.models.generate_content(model="gemini-x", contents="What is here?", config=config)
    gate = Gate(gw.engine)
    parts: list[dict[str, Any]] = []
    streamer = client(streamed_ro)
    try:
        for chunk in streamer.models.generate_content_stream(
            model="gemini-x", contents="What is here?", config=config
        ):
            got = (
                chunk.candidates[0].content.parts or []
                if chunk.candidates and chunk.candidates[0].content
                else []
            )
            if any(p.text for p in got):
                gate.seen()
            parts += [p.model_dump(exclude_none=True) for p in got]
    finally:
        gw.engine.between_tokens = None
    assert gate.seen_while_held
    merged: list[dict[str, Any]] = []
    for p in parts:  # a client joins consecutive text parts of one kind
        if merged and "text" in p and "text" in merged[-1] and p.get("thought") == merged[-1].get("thought"):
            merged[-1]["text"] += p["text"]
        else:
            merged.append(dict(p))
    assert whole.candidates and whole.candidates[0].content
    assert merged == [p.model_dump(exclude_none=True) for p in whole.candidates[0].content.parts or []]
    assert [("thought" in p, "function_call" in p) for p in merged] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    _same_records(gw, streamed_ro, whole_ro)


def test_responses_streams_items_that_reassemble_the_response(gw: Any) -> None:
    gw.engine.script = lambda prompt: CALLS
    ask: Any = {"model": "m", "input": "What is here?", "tools": [{"type": "function", **SHELL}]}
    whole_ro, streamed_ro = new_rollout(gw), new_rollout(gw)
    whole = OpenAI(base_url=whole_ro["base_url"] + "/v1", api_key=whole_ro["api_key"]).responses.create(**ask)
    gate = Gate(gw.engine)
    client = OpenAI(base_url=streamed_ro["base_url"] + "/v1", api_key=streamed_ro["api_key"])
    texts = {"reasoning": "", "text": ""}
    try:
        with client.responses.stream(**ask) as stream:
            for event in stream:
                if event.type == "response.reasoning_summary_text.delta":
                    texts["reasoning"] += event.delta
                    gate.seen()
                elif event.type == "response.output_text.delta":
                    texts["text"] += event.delta
                    gate.seen()
            final = stream.get_final_response()
    finally:
        gw.engine.between_tokens = None
    assert gate.seen_while_held

    def items(response: Any) -> list[dict[str, Any]]:
        # (the stream's helper adds `parsed: None` to the text: not on the wire)
        return [json.loads(o.model_dump_json(exclude={"id"}, exclude_none=True)) for o in response.output]

    assert items(final) == items(whole) and [o.type for o in final.output] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert texts["text"] == whole.output_text and texts["reasoning"] == "First list the files."
    _same_records(gw, streamed_ro, whole_ro)


# -- the built-in engine ---------------------------------------------------------------------


def test_the_builtin_engine_hands_over_each_sampled_id_before_it_returns(tiny_model_dir: Path) -> None:
    async def main() -> tuple[list[int], list[bool], list[int], list[int]]:
        engine = TransformersEngine(tiny_model_dir, max_batch_size=4, threads=1)
        await engine.start()
        try:
            runs: list[int] = []
            returned: list[bool] = []  # for each run: had generate returned already?

            def sink(ids: Any) -> None:
                runs.extend(ids)
                returned.append(task.done())

            sampling = SamplingParams(max_tokens=24, seed=3)
            task = asyncio.ensure_future(engine.generate([1, 2, 3, 4], sampling, on_tokens=sink))
            result = await task
            plain = await engine.generate([1, 2, 3, 4], sampling)
            return runs, returned, result.completion_ids, plain.completion_ids
        finally:
            await engine.close()

    streamed, returned, completion, plain = asyncio.run(main())
    assert streamed == completion == plain and len(completion) > 1
    assert len(returned) == len(completion) and not any(returned)  # one run per decode step, all before


def test_the_tiny_model_streams_through_the_gateway_as_it_answers_whole(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real model generating (greedy, so the two calls sample alike): every dialect's stream,
    decoded piece by piece, reassembles into the record's answer."""
    with running_gateway(tiny_model_dir, tmp_path, max_tokens=48) as g:
        for seed in range(3):
            ask: Any = {
                "model": "m",
                "messages": [{"role": "user", "content": f"Tell me about {seed} files."}],
                "tools": [{"type": "function", "function": SHELL}],
            }
            greedy = {"sampling": {"temperature": 0.0}}  # the run's policy decides sampling, not the ask
            whole_ro, streamed_ro = new_rollout(g, **greedy), new_rollout(g, **greedy)
            whole = OpenAI(base_url=whole_ro["base_url"] + "/v1", api_key=whole_ro["api_key"])
            message = whole.chat.completions.create(**ask).choices[0].message
            client = OpenAI(base_url=streamed_ro["base_url"] + "/v1", api_key=streamed_ro["api_key"])
            chunks = list(client.chat.completions.create(**ask, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content == (message.content or "")
            _same_records(g, streamed_ro, whole_ro, tolerance=1e-4)
            (record,) = calls_of(g, streamed_ro["rollout_id"])
            pieces = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
            assert pieces > 1 or len(record["completion_ids"]) <= 2  # it streamed as it sampled
