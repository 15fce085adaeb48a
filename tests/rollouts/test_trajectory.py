"""The trajectory builder on hand-made call sequences: merging, branches, forks, side requests,
per-call mode, truncated turns, and the adapters from the store's rows and the gateway's JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from openforgerl.rollouts.trajectory import (
    NO_VERSION,
    RecordedCall,
    Sample,
    TokenStats,
    build_samples,
    calls_from_json,
    calls_from_rows,
    token_stats,
)
from openforgerl.store import CallRow

TURN_END = 2


def call(
    call_id: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    version: int | None = 0,
    finish: str = "stop",
    side: str = "",
    status: str = "ok",
) -> RecordedCall:
    return RecordedCall(
        call_id=call_id,
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        completion_logprobs=[-(call_id + i / 10) for i in range(len(completion))],
        policy_version=version,
        finish_reason=finish,
        side_request=side,
        status=status,
        rollout_id="ro_1",
    )


def assert_exact(samples: Sequence[Sample], calls: Sequence[RecordedCall]) -> None:
    """Each call appears once, and its sample reproduces its prompt + completion exactly."""
    by_id = {c.call_id: c for c in calls}
    seen = [cid for s in samples for cid in s.call_ids]
    assert sorted(seen) == sorted(c.call_id for c in calls if c.status == "ok")
    for s in samples:
        n = len(s.input_ids)
        assert len(s.loss_mask) == len(s.logprobs) == len(s.policy_versions) == n
        sampled = set()
        for cid, (start, end) in zip(s.call_ids, s.completion_spans, strict=True):
            c = by_id[cid]
            assert s.input_ids[:end] == [*c.prompt_ids, *c.completion_ids]
            assert s.logprobs[start:end] == list(c.completion_logprobs)
            sampled |= set(range(start, end))
        assert [i for i in range(n) if s.loss_mask[i]] == sorted(sampled)
        assert all(
            s.logprobs[i] == 0.0 and s.policy_versions[i] == NO_VERSION for i in range(n) if i not in sampled
        )


def test_extending_calls_merge_into_one_sequence() -> None:
    calls = [
        call(1, [10, 11, 12], [20, 21, TURN_END], version=3),
        call(2, [10, 11, 12, 20, 21, TURN_END, 13, 14], [22, TURN_END], version=4),
        call(3, [10, 11, 12, 20, 21, TURN_END, 13, 14, 22, TURN_END, 15], [23], version=4),
    ]
    (s,) = build_samples(calls, 0.5)
    assert s.input_ids == [10, 11, 12, 20, 21, TURN_END, 13, 14, 22, TURN_END, 15, 23]
    assert s.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert s.policy_versions == [-1, -1, -1, 3, 3, 3, -1, -1, 4, 4, -1, 4]
    assert (s.min_policy_version, s.max_policy_version) == (3, 4)
    assert (s.call_ids, s.completion_spans) == ([1, 2, 3], [(3, 6), (8, 10), (11, 12)])
    assert (s.reward, s.advantage, s.rollout_id, s.truncated, s.side_request) == (
        0.5,
        None,
        "ro_1",
        False,
        "",
    )
    assert s.num_loss_tokens == 6
    assert_exact([s], calls)


def test_rewritten_history_starts_a_new_sample() -> None:
    calls = [
        call(1, [10, 11], [20, TURN_END]),
        call(2, [10, 11, 20, TURN_END, 12], [21, TURN_END]),
        # compaction: the history is summarised, so the prompt no longer extends the sequence
        call(3, [10, 99, 12], [22, TURN_END]),
        call(4, [10, 99, 12, 22, TURN_END, 13], [23]),
    ]
    a, b = build_samples(calls, 1.0)
    assert (a.call_ids, b.call_ids) == ([1, 2], [3, 4])
    assert b.input_ids == [10, 99, 12, 22, TURN_END, 13, 23] and b.loss_mask == [0, 0, 0, 1, 1, 0, 1]
    assert_exact([a, b], calls)


def test_a_fork_becomes_its_own_sample_with_the_shared_prefix_masked() -> None:
    calls = [
        call(1, [10, 11], [20, TURN_END]),
        call(2, [10, 11, 20, TURN_END, 12], [21, TURN_END]),
        call(3, [10, 11, 20, TURN_END, 13], [22, TURN_END]),  # also continues call 1: a retry, a fork
        call(4, [10, 11, 20, TURN_END, 13, 22, TURN_END, 14], [23]),  # continues the fork
    ]
    a, b = build_samples(calls, 1.0)
    assert (a.call_ids, b.call_ids) == ([1, 2], [3, 4])
    # call 1's sampled tokens are trained once, in the first sample
    assert b.input_ids[:4] == [10, 11, 20, TURN_END] and b.loss_mask[:5] == [0, 0, 0, 0, 0]
    assert_exact([a, b], calls)


def test_parent_call_id_is_not_trusted_only_the_ids() -> None:
    payload: dict[str, Any] = {
        "rollout_id": "ro_9",
        "calls": [
            {"call_id": 1, "prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-0.5]},
            # claims to extend call 1, but its prompt does not start with [1, 2, 3]
            {
                "call_id": 2,
                "parent_call_id": 1,
                "branch_reason": "",
                "prompt_ids": [1, 2, 4, 5],
                "completion_ids": [6],
                "completion_logprobs": [-0.25],
            },
        ],
    }
    samples = build_samples(calls_from_json(payload), 1.0)
    assert [s.call_ids for s in samples] == [[1], [2]] and samples[1].rollout_id == "ro_9"


def test_side_requests_are_separate_flagged_samples() -> None:
    title = "no tools while the rollout's conversation has them"
    calls = [
        call(1, [10, 11], [20, TURN_END]),
        call(2, [50, 51], [60, TURN_END], side=title),
        call(3, [10, 11, 20, TURN_END, 12], [21, TURN_END]),
        # structured output over the very same conversation: it extends the ids, but stays apart
        call(4, [10, 11, 20, TURN_END, 12, 21, TURN_END, 13], [22], side="asks for structured output"),
        call(5, [10, 11, 20, TURN_END, 12, 21, TURN_END, 14], [23]),
    ]
    main, side_title, side_structured = build_samples(calls, 1.0)
    assert main.call_ids == [1, 3, 5] and not main.side_request
    assert (side_title.call_ids, side_title.side_request) == ([2], title)
    assert (side_structured.call_ids, side_structured.side_request) == ([4], "asks for structured output")
    assert_exact([main, side_title, side_structured], calls)
    (only_main,) = build_samples(calls, 1.0, include_side_requests=False)
    assert only_main.input_ids == main.input_ids


def test_per_call_mode_and_discount() -> None:
    calls = [
        call(1, [10], [20, TURN_END]),
        call(2, [10, 20, TURN_END, 11], [21, TURN_END]),
        call(3, [10, 20, TURN_END, 11, 21, TURN_END, 12], [22]),
    ]
    samples = build_samples(calls, 1.0, mode="per_call", gamma=0.5)
    assert [s.reward for s in samples] == [0.25, 0.5, 1.0]
    for s, c in zip(samples, calls, strict=True):
        assert s.input_ids == [*c.prompt_ids, *c.completion_ids]
        assert s.loss_mask == [0] * len(c.prompt_ids) + [1] * len(c.completion_ids)
    assert_exact(samples, calls)
    assert [s.reward for s in build_samples(calls, 0.8, mode="per_call")] == [0.8, 0.8, 0.8]
    with pytest.raises(ValueError, match="merge mode"):
        build_samples(calls, 1.0, gamma=0.9)
    with pytest.raises(ValueError, match="gamma"):
        build_samples(calls, 1.0, mode="per_call", gamma=0.0)


def test_a_truncated_turn_is_closed_by_a_prompt_token_and_still_merges() -> None:
    calls = [
        call(1, [10, 11], [20, 21], finish="length"),  # cut by max_tokens: no turn end sampled
        call(2, [10, 11, 20, 21, TURN_END, 12], [22, TURN_END]),  # the template closed the turn
    ]
    (s,) = build_samples(calls, 1.0)
    assert s.input_ids == [10, 11, 20, 21, TURN_END, 12, 22, TURN_END]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1, 1]  # the closing turn end was never sampled
    assert s.truncated
    assert_exact([s], calls)
    assert [s.truncated for s in build_samples(calls, 1.0, mode="per_call")] == [True, False]


def test_failed_calls_are_skipped_and_bad_logprobs_rejected() -> None:
    calls = [
        call(1, [10], [20, TURN_END]),
        call(2, [10, 20, TURN_END, 11], [], status="error", version=None),
        call(3, [10, 20, TURN_END, 11], [21]),
    ]
    (s,) = build_samples(calls, 1.0)
    assert s.call_ids == [1, 3]
    bad = RecordedCall(call_id=9, prompt_ids=[1], completion_ids=[2, 3], completion_logprobs=[-1.0])
    with pytest.raises(ValueError, match="call 9: 1 logprobs for 2 completion ids"):
        build_samples([bad], 1.0)


def test_token_stats_merged_vs_per_call() -> None:
    calls = [
        call(1, [10] * 100, [20] * 10),
        call(2, [10] * 100 + [20] * 10 + [11] * 20, [21] * 10),
        call(3, [10] * 100 + [20] * 10 + [11] * 20 + [21] * 10 + [12] * 20, [22] * 10),
        call(4, [50] * 30, [60] * 5, side="asks for structured output"),
    ]
    stats = token_stats(calls)
    assert (stats.calls, stats.samples, stats.loss_tokens) == (4, 2, 35)
    assert stats.tokens_merged == 170 + 35
    assert stats.tokens_per_call == 110 + 140 + 170 + 35
    assert stats.ratio == pytest.approx(455 / 205)
    assert token_stats(calls, include_side_requests=False).tokens_merged == 170
    total = stats + stats
    assert (total.tokens_merged, total.ratio) == (410, stats.ratio)
    assert total.as_dict()["samples"] == 4 and TokenStats().ratio == 1.0


def test_calls_from_rows_rebuilds_prompts_and_flags_side_requests() -> None:
    def row(
        call_id: int,
        parent: int | None,
        prefix_len: int,
        delta: list[int],
        completion: list[int],
        tools: int,
        status: str = "ok",
    ) -> CallRow:
        return CallRow(
            rollout_id="ro_2",
            seq=call_id - 1,
            branch_id=0,
            parent_call_id=parent,
            branch_reason="",
            dialect="openai",
            model="m",
            engine="scripted",
            status=status,
            error="",
            policy_version=7,
            prompt_prefix_len=prefix_len,
            prompt_delta=delta,
            prompt_tokens=prefix_len + len(delta),
            completion_ids=completion,
            completion_logprobs=[-0.1] * len(completion),
            finish_reason="stop",
            stop_reason=None,
            sampling_requested={"tools": tools, "response_format": None},
            sampling_used={},
            messages_delta=[],
            response={},
            parse_errors=[],
            memory={},
            created_at=0.0,
            latency_ms=1.0,
            id=call_id,
        )

    rows = [
        row(1, None, 0, [10, 11], [20, TURN_END], tools=2),
        row(2, None, 0, [50], [60], tools=0),  # a title request: no tools in a tool-using rollout
        row(3, 1, 4, [12], [21], tools=2),
    ]
    calls = calls_from_rows(rows)
    assert calls[2].prompt_ids == [10, 11, 20, TURN_END, 12]
    assert [bool(c.side_request) for c in calls] == [False, True, False]
    assert calls[0].rollout_id == "ro_2" and calls[0].policy_version == 7
    main, side = build_samples(calls, 1.0)
    assert (main.call_ids, side.call_ids) == ([1, 3], [2])


@st.composite
def conversation_trees(draw: st.DrawFn) -> list[RecordedCall]:
    """Calls that extend a random earlier call (possibly one already extended), or start afresh."""
    tokens = st.lists(st.integers(3, 9), max_size=4)
    calls: list[RecordedCall] = []
    for call_id in range(1, draw(st.integers(1, 8)) + 1):
        base: list[int] = []
        if calls and draw(st.booleans()):
            parent = calls[draw(st.integers(0, len(calls) - 1))]
            base = [*parent.prompt_ids, *parent.completion_ids]
        prompt = base + draw(tokens) + [1]  # a fresh start always has a prompt
        side = draw(st.sampled_from(["", "", "", "asks for structured output"]))
        calls.append(call(call_id, prompt, draw(tokens), side=side))
    return calls


@given(conversation_trees())
def test_merged_samples_reproduce_every_call_exactly(calls: list[RecordedCall]) -> None:
    samples = build_samples(calls, 1.0)
    assert_exact(samples, calls)
    stats = token_stats(calls)
    assert stats.tokens_merged <= stats.tokens_per_call
    assert stats.loss_tokens == sum(s.num_loss_tokens for s in samples)
