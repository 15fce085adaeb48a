"""parse_completion: Hermes/Qwen tool calls and <think> reasoning, including malformed and cut-off text."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from openforgerl.conversation import ToolCall
from openforgerl.engines.parsers import parse_completion, prompt_opens_reasoning

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def call_text(name: str, arguments: Any, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments}, ensure_ascii=False)}\n</tool_call>"


def test_plain_text_is_content() -> None:
    p = parse_completion("Hello there.\n")
    assert (p.content, p.reasoning, p.tool_calls, p.errors) == ("Hello there.", "", [], [])


def test_reasoning_then_content() -> None:
    p = parse_completion("<think>\nLet me think.\n</think>\n\nThe answer is 4.")
    assert (p.reasoning, p.content, p.errors) == ("Let me think.", "The answer is 4.", [])


def test_unclosed_think_is_all_reasoning() -> None:
    p = parse_completion("<think>\nStill thinking when the budget ran o")
    assert (p.reasoning, p.content) == ("Still thinking when the budget ran o", "")


def test_template_opened_think() -> None:
    """A template that opens `<think>` in the prompt leaves the completion inside the reasoning; the
    gateway reads that from the prompt. A `</think>` nothing opened is content (a stream could not
    take back the text it already showed as the answer)."""
    text = "The user wants a file.\n</think>\n\nSure."
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    p = parse_completion(text, in_reasoning=True)
    assert (p.reasoning, p.content) == ("The user wants a file.", "Sure.")
    assert (parse_completion(text).reasoning, parse_completion(text).content) == ("", text)
    cut = parse_completion("still reasoning", in_reasoning=True)
    assert (cut.reasoning, cut.content) == ("still reasoning", "")
    assert parse_completion("plain answer", in_reasoning=False).content == "plain answer"
    # A `</think>` inside a tool call's arguments does not make the text before it reasoning.
    p = parse_completion(call_text("echo", {"text": "</think>"}))
    assert p.reasoning == "" and [c.arguments for c in p.tool_calls] == [{"text": "</think>"}]


def test_think_later_in_the_text_is_content() -> None:
    text = "Use <think>tags</think> like this."
    assert parse_completion(text).content == text


def test_several_tool_calls() -> None:
    text = (
        "<think>need two files</think>Reading both.\n"
        + call_text("read_file", {"path": "a.py"})
        + "\n"
        + call_text("read_file", json.dumps({"path": "b.py"}))  # arguments as a JSON string
        + "\n"
        + '<tool_call>\n{"name": "list_dir"}\n</tool_call>'  # no arguments at all
    )
    p = parse_completion(text)
    assert p.errors == []
    assert (p.reasoning, p.content) == ("need two files", "Reading both.")
    assert [(c.name, c.arguments) for c in p.tool_calls] == [
        ("read_file", {"path": "a.py"}),
        ("read_file", {"path": "b.py"}),
        ("list_dir", {}),
    ]
    ids = [c.id for c in p.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 3
    assert [c.id for c in parse_completion(text).tool_calls] == ids  # deterministic


def test_a_json_list_of_calls_in_one_block() -> None:
    """SmolLM2's own tool format: several calls as a JSON list inside one <tool_call> block."""
    reads = [{"name": "read", "arguments": {"path": name}} for name in ("a.txt", "b.txt")]
    text = f"<tool_call>{json.dumps(reads)}</tool_call>"
    p = parse_completion(text)
    assert p.errors == [] and p.content == ""
    assert [(c.name, c.arguments) for c in p.tool_calls] == [
        ("read", {"path": "a.txt"}),
        ("read", {"path": "b.txt"}),
    ]
    assert len({c.id for c in p.tool_calls}) == 2
    # One bad member spoils the block: it stays text, with the reason.
    for bad in ('[{"name": "read"}, 3]', "[]"):
        p = parse_completion(f"<tool_call>{bad}</tool_call>")
        assert p.tool_calls == [] and "not a JSON object" in p.errors[0]


def test_closing_tag_inside_a_json_string() -> None:
    args = {"code": "print('</tool_call>')", "next": "<tool_call>"}
    p = parse_completion(call_text("python", args) + " done")
    assert p.errors == [] and p.content == "done"
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("python", args)]


def test_malformed_calls_stay_in_content() -> None:
    bad_json = '<tool_call>\n{"name": "f", "arguments": {</tool_call>'
    no_name = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'
    list_args = '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'
    good = call_text("ok", {"a": 1})
    text = f"{bad_json} {no_name} {good} {bad_args} {list_args}"
    p = parse_completion(text)
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("ok", {"a": 1})]
    assert p.content == f"{bad_json} {no_name}  {bad_args} {list_args}"
    assert len(p.errors) == 4
    assert "invalid JSON" in p.errors[0] and "name" in p.errors[1]
    assert "not JSON" in p.errors[2] and "not a JSON object" in p.errors[3]


def test_unclosed_call_stays_in_content() -> None:
    text = 'Calling.\n<tool_call>\n{"name": "f", "argum'
    p = parse_completion(text)
    assert p.tool_calls == [] and p.content == text.strip()
    assert len(p.errors) == 1 and "not closed" in p.errors[0]
    # An unclosed call followed by a good one: only the text up to the good one is malformed.
    p = parse_completion("<tool_call>{oops " + call_text("g", {}))
    assert [c.name for c in p.tool_calls] == ["g"] and p.content == "<tool_call>{oops"


def test_tool_calls_inside_reasoning_are_not_calls() -> None:
    p = parse_completion("<think>maybe " + call_text("f", {}) + "</think>No.")
    assert p.tool_calls == [] and p.content == "No." and "<tool_call>" in p.reasoning


# -- properties ------------------------------------------------------------------------------------

fragments = st.sampled_from([*TAGS, "{", "}", '"name"', '"arguments"', ":", ",", '"f"', "\n", " ", "[", "]"])
messy_text = st.lists(st.one_of(fragments, st.text(max_size=8)), max_size=30).map("".join)


@given(st.one_of(st.text(), messy_text), st.booleans())
def test_never_raises(text: str, in_reasoning: bool) -> None:
    p = parse_completion(text, in_reasoning=in_reasoning)
    assert isinstance(p.content, str) and isinstance(p.reasoning, str)
    assert all(isinstance(c, ToolCall) and c.name and isinstance(c.arguments, dict) for c in p.tool_calls)
    if "<tool_call>" not in text:
        assert p.tool_calls == [] and p.errors == []


def _plain(s: str) -> bool:
    return not any(tag in s for tag in TAGS)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)
calls = st.lists(
    st.tuples(st.text(min_size=1), st.dictionaries(st.text(), json_values, max_size=4), st.booleans()),
    max_size=4,
)


@given(
    reasoning=st.text().filter(_plain),
    content=st.text().filter(_plain),
    calls=calls,
)
def test_well_formed_calls_round_trip(
    reasoning: str, content: str, calls: list[tuple[str, dict[str, Any], bool]]
) -> None:
    text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning.strip() else ""
    text += content
    for name, args, as_string in calls:
        text += "\n" + call_text(name, json.dumps(args) if as_string else args)
    p = parse_completion(text)
    assert p.errors == []
    assert (p.reasoning, p.content) == (reasoning.strip(), content.strip())
    assert [(c.name, c.arguments) for c in p.tool_calls] == [(n, a) for n, a, _ in calls]
