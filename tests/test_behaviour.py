"""Behaviour metrics read from recorded conversations: tool errors, recoveries, give-ups and
self-verification, on hand-written conversations in the shapes the harnesses really produce."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openforgerl.behaviour import aggregate, is_error, main_conversation, of_conversation, steps
from openforgerl.rollouts.trajectory import RecordedCall


def call(name: str, args: dict[str, Any], cid: str = "") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def act(*calls: dict[str, Any], text: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": text, "tool_calls": list(calls)}


def tool(content: str, cid: str = "") -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_call_id": cid}


USER = {"role": "user", "content": "Read a.txt and b.txt. Write their sum to answer.txt."}


@pytest.mark.parametrize(
    ("output", "error"),
    [
        ("error: b.txt: Resource temporarily unavailable", True),  # ReAct's file tools
        ("Error: no such file", True),  # an Anthropic tool_result with is_error
        ("exit code 1\ncat: b.txt: Resource temporarily unavailable\n", True),  # ReAct's bash
        ("exit code 0\n7\n", False),
        ("cat: b.txt: Resource temporarily unavailable\n\nCommand exited with code 1", True),  # pi
        (json.dumps({"returncode": 1, "output": "cat: b.txt: busy"}), True),  # mini-swe-agent
        (json.dumps({"returncode": 0, "output": "7"}), False),
        ("<returncode>2</returncode>\n<output>oops</output>", True),
        ("Command: cat b.txt\nExit Code: 1\nOutput: busy", True),  # Qwen Code
        ("Process exited with code 0\nOutput:\n7", False),  # Codex
        ("7\n", False),
        ("the error was fixed", False),
    ],
)
def test_an_error_is_read_the_way_each_harness_reports_it(output: str, error: bool) -> None:
    assert is_error(output) is error


def test_a_failed_read_then_read_again_is_a_recovery() -> None:
    messages = [
        USER,
        act(call("read_file", {"path": "a.txt"})),
        tool("6\n"),
        act(call("read_file", {"path": "b.txt"})),
        tool("error: b.txt: Resource temporarily unavailable"),
        act(call("read_file", {"path": "b.txt"}), text="b.txt could not be read: reading it again."),
        tool("2\n"),
        act(call("write_file", {"path": "answer.txt", "content": "8"})),
        tool("wrote 1 characters to answer.txt"),
        act(call("submit", {"answer": "8"})),  # the last call has no tool response
    ]
    assert of_conversation(messages) == {
        "tool_calls": 4,
        "tool_errors": 1,
        "error_seen": True,
        "recovered": True,
        "gave_up": False,
        "self_verified": False,
    }


def test_another_action_on_the_same_file_recovers_but_moving_on_to_others_is_giving_up() -> None:
    failed = [USER, act(call("read_file", {"path": "b.txt"})), tool("error: b.txt: busy")]
    via_shell = [*failed, act(call("bash", {"command": "cat b.txt"})), tool("exit code 0\n2\n")]
    assert of_conversation(via_shell)["recovered"] is True
    moved_on = [
        *failed,
        act(call("read_file", {"path": "a.txt"})),
        tool("6\n"),
        act(call("write_file", {"path": "answer.txt", "content": "6"})),
        tool("wrote 1 characters to answer.txt"),
    ]
    acted = of_conversation(moved_on)
    assert (acted["recovered"], acted["gave_up"], acted["tool_errors"]) == (False, True, 1)
    # Retrying and failing again is not a recovery either.
    again = [*failed, act(call("read_file", {"path": "b.txt"})), tool("error: b.txt: busy")]
    assert of_conversation(again)["gave_up"] is True and of_conversation(again)["tool_errors"] == 2


def test_a_conversation_without_errors_has_no_recovery_to_speak_of() -> None:
    acted = of_conversation([USER, act(call("read_file", {"path": "a.txt"})), tool("6\n")])
    assert acted["error_seen"] is False and acted["recovered"] is None and acted["gave_up"] is None
    assert acted["self_verified"] is None  # it wrote nothing


def test_reading_back_the_last_write_is_self_verification() -> None:
    wrote = [
        USER,
        act(call("bash", {"command": "echo 8 > answer.txt"})),
        tool(json.dumps({"returncode": 0, "output": ""})),
    ]
    assert of_conversation(wrote)["self_verified"] is False
    checked = [
        *wrote,
        act(call("bash", {"command": "cat answer.txt"})),
        tool(json.dumps({"returncode": 0, "output": "8"})),
    ]
    assert of_conversation(checked)["self_verified"] is True
    # pi's own file tools: `write` then `read` of the same path.
    pi = [
        USER,
        act(call("write", {"path": "answer.txt", "content": "8\n"}, "w1")),
        tool("Successfully wrote 2 bytes to answer.txt", "w1"),
        act(call("read", {"path": "answer.txt"}, "r1")),
        tool("8", "r1"),
    ]
    assert of_conversation(pi)["self_verified"] is True


def test_parallel_tool_calls_are_paired_with_their_responses_by_id() -> None:
    messages = [
        USER,
        act(call("read_file", {"path": "a.txt"}, "c1"), call("read_file", {"path": "b.txt"}, "c2")),
        tool("2\n", "c2"),
        tool("error: a.txt: busy", "c1"),
    ]
    (first, second) = steps(messages)
    assert (first.name, first.target, first.ok) == ("read_file", "b.txt", True)
    assert (second.target, second.ok) == ("a.txt", False)
    # Arguments the harness sent as a JSON string read the same.
    raw = {"id": "c3", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    (step,) = steps([act(raw), tool("exit code 0\n", "c3")])
    assert step.target == "ls"


def test_the_main_conversation_follows_parent_calls_and_leaves_side_requests_out() -> None:
    def record(
        cid: int, parent: int | None, delta: list[dict[str, Any]], response: dict[str, Any], **kw: Any
    ) -> RecordedCall:
        return RecordedCall(
            cid, [], [], [], parent_call_id=parent, messages_delta=delta, response=response, **kw
        )

    first = act(call("read_file", {"path": "b.txt"}))
    second = act(call("read_file", {"path": "b.txt"}))
    calls = [
        record(1, None, [USER], first),
        record(
            2,
            None,
            [{"role": "user", "content": "Title?"}],
            {"role": "assistant", "content": "Sum"},
            side_request="no tools",
        ),
        record(3, 1, [tool("error: b.txt: busy")], second),
        record(4, 3, [tool("2\n")], {"role": "assistant", "content": "done"}),
        record(5, 4, [], {}, status="error"),  # a failed call answered nothing
    ]
    messages = main_conversation(calls)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert of_conversation(messages)["recovered"] is True


def test_rates_are_over_the_rollouts_they_concern() -> None:
    rows = [
        {
            "tool_calls": 4,
            "tool_errors": 1,
            "error_seen": True,
            "recovered": True,
            "gave_up": False,
            "self_verified": False,
        },
        {
            "tool_calls": 3,
            "tool_errors": 1,
            "error_seen": True,
            "recovered": False,
            "gave_up": True,
            "self_verified": None,
        },
        {
            "tool_calls": 3,
            "tool_errors": 0,
            "error_seen": False,
            "recovered": None,
            "gave_up": None,
            "self_verified": True,
        },
        {
            "tool_calls": 2,
            "tool_errors": 0,
            "error_seen": False,
            "recovered": None,
            "gave_up": None,
            "self_verified": None,
        },
    ]
    out = aggregate(rows)
    assert out["rollouts"] == 4 and out["rollouts_with_errors"] == 2
    assert out["error_rate"] == 0.5
    assert out["recovery_rate"] == 0.5 and out["gave_up_rate"] == 0.5  # of the 2 that met an error
    assert out["self_verification_rate"] == 0.5  # of the 2 that wrote a file
    assert out["tool_errors_mean"] == 0.5
    assert aggregate(rows[2:])["recovery_rate"] is None  # none met an error: no rate, not 0
    assert aggregate([]) == {}
