"""A real pretrained model inside real harnesses: SmolLM2-135M-Instruct generates every turn inside
the built-in ReAct harness, mini-swe-agent and pi, on two held-out tools-tiny tasks, through the
gateway, in bubblewrap sandboxes (marker `real_model`; `make test-real-model` installs the CLIs).

One harness study (`openforge eval --harness react,mini-swe-agent,pi`, the default engine path: the
embedded gateway serving the checkpoint with the built-in engine) runs once for the module; the tests
then read what the runner and the gateway recorded. They assert what a user relies on, not the model's
skill: every call was sampled by the model (real logprobs, a policy version, ended by a stop token or
the token limit), every prompt fits the model's 8,192 positions and carries the harness's own system
prompt and tools, calls that extend each other are one branch (one training sequence) and calls that
do not are not, a `<tool_call>` the model writes becomes a tool call or a recorded parse error, and
every rollout ends scored by the verifier, none as an infrastructure error. `-s` prints a line per
harness.

Out of the box the model writes prose or Python instead of tool calls (no `<tool_call>` in any call
of our runs): react and pi end after its first answer, mini-swe-agent after three format errors, each
of which it drops from the history (so each of its calls starts a branch). The branch and parse-error
checks are therefore invariants over whatever happened; the scripted-policy harness tests cover
the extending path.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from openforgerl.evaluate import EvalOptions, run_study
from openforgerl.harnesses.adapters import get
from openforgerl.harnesses.react import SYSTEM_PROMPT as REACT_SYSTEM_PROMPT
from openforgerl.modelkit.pretrained import IM_START
from openforgerl.rollouts.results import RolloutResult, RunState, Status
from openforgerl.rollouts.trajectory import build_samples, calls_from_rows
from openforgerl.sandbox.local import LocalBackend
from openforgerl.store.sqlite import CallRow, RolloutRow, Store
from tests.harness_helpers import HARNESS_MARKS

pytestmark = pytest.mark.real_model

HARNESSES = ("react", "mini-swe-agent", "pi")
CLIS = ("mini-swe-agent", "pi")
# What each harness's own prompt and tools look like in a rendered prompt.
MARKS = {"react": (REACT_SYSTEM_PROMPT, '"name": "submit"', '"name": "write_file"'), **HARNESS_MARKS}
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM"  # the model's default system prompt
MAX_POSITIONS = 8192
STOP_IDS = (2, 0)  # <|im_end|>, <|endoftext|>: the checkpoint's generation_config eos ids
MAX_TOKENS = 64
MAX_TURNS = 3
TASKS = 2


@dataclass
class Recorded:
    """One harness's part of the study: its report, the runner's results, the gateway's records."""

    name: str
    report: dict[str, Any]
    results: list[RolloutResult]
    calls: dict[str, list[CallRow]]  # gateway rollout id -> its calls, in order
    rollouts: dict[str, RolloutRow]  # gateway rollout id -> the gateway's record of it


def _missing(name: str) -> str:
    found = get(name).check()
    return "" if found.ok else f"{name} is not installed: {found.missing}"


def _read(folder: Path) -> tuple[list[RolloutResult], dict[str, list[CallRow]], dict[str, RolloutRow]]:
    state = RunState(folder / "runner.db")
    try:
        results = sorted(state.load().values(), key=lambda r: r.key)
    finally:
        state.close()

    async def read() -> tuple[dict[str, list[CallRow]], dict[str, RolloutRow]]:
        store = Store(folder / "gateway.db")
        try:
            calls = {r.gateway_rollout_id: await store.calls(r.gateway_rollout_id) for r in results}
            rows = {r.gateway_rollout_id: await store.get_rollout(r.gateway_rollout_id) for r in results}
            return calls, {k: v for k, v in rows.items() if v is not None}
        finally:
            await store.close()

    calls, rows = asyncio.run(read())
    return results, calls, rows


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def study(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Recorded]:
    if not LocalBackend().bwrap:
        pytest.skip("bubblewrap is not installed")
    names = [n for n in HARNESSES if n not in CLIS or not _missing(n)]
    out = tmp_path_factory.mktemp("study")
    opts = EvalOptions(
        tasks="tools-tiny",
        split="heldout",
        limit=TASKS,
        model=str(smollm2_dir),  # the embedded gateway with the built-in engine: the default path
        out=out,
        max_tokens=MAX_TOKENS,
        max_turns=MAX_TURNS,
        concurrency=TASKS,
        seed=0,
        progress=False,
    )
    t0 = time.monotonic()
    done = run_study(opts, names)
    took = time.monotonic() - t0
    print(f"\nSmolLM2-135M-Instruct, {TASKS} tools-tiny tasks, {', '.join(names)}: {took:.0f} s")
    recorded = {}
    for name in names:
        results, calls, rows = _read(out / name)
        recorded[name] = Recorded(name, done["harnesses"][name], results, calls, rows)
        print(_summary(recorded[name]))
    return recorded


def _summary(r: Recorded) -> str:
    every = [c for rows in r.calls.values() for c in rows]
    main = [[c for c in calls_from_rows(rows) if not c.side_request] for rows in r.calls.values()]
    prompts = [c.prompt_tokens for c in every] or [0]
    errors = sum(len(c.parse_errors) for c in every)
    tool_calls = sum(len(c.response.get("tool_calls") or []) for c in every)
    branches = sum(len({c.branch_id for c in calls}) for calls in main)
    extended = sum(1 for c in every if c.parent_call_id is not None and not c.branch_reason)
    rewards = [res.reward for res in r.results]
    outcomes = ",".join(sorted({res.outcome for res in r.results}))
    return (
        f"{r.name}: {len(r.results)} rollouts ({outcomes}), {len(every)} calls, "
        f"turns/rollout {statistics.fmean(len(m) for m in main):.1f}, tool calls {tool_calls}, "
        f"parse errors {errors}, branches {branches} ({extended} calls extended one), rewards {rewards}, "
        f"prompt tokens median {statistics.median(prompts):.0f} max {max(prompts)}, "
        f"{r.report['seconds']} s"
    )


def _one(study: dict[str, Recorded], name: str) -> Recorded:
    if name not in study:
        pytest.skip(_missing(name))
    return study[name]


@pytest.mark.parametrize("name", HARNESSES)
def test_every_rollout_ends_scored_by_the_verifier(study: dict[str, Recorded], name: str) -> None:
    r = _one(study, name)
    assert r.report["rollouts"] == TASKS and r.report["scored"] == TASKS, r.report["status"]
    assert r.report["status"] == {"done": TASKS}  # no infrastructure failure, nothing dropped
    for result in r.results:
        assert result.status == Status.DONE and result.reward is not None, result.details
        # The harness ended its own way (a crash or its time limit is a policy outcome, scored 0).
        assert result.outcome in ("ok", "crash", "timeout"), result.outcome
        if result.outcome == "ok":
            assert "verifier" in result.details, result.details
        # The gateway closed the rollout with the same reward: what training reads.
        row = r.rollouts[result.gateway_rollout_id]
        assert (row.status, row.reward) == ("closed", result.reward)
        assert r.calls[result.gateway_rollout_id], "the harness called the model"


@pytest.mark.parametrize("name", HARNESSES)
def test_every_call_was_sampled_by_the_model(study: dict[str, Recorded], name: str) -> None:
    r = _one(study, name)
    outcomes = {res.gateway_rollout_id: res.outcome for res in r.results}
    for rollout_id, calls in r.calls.items():
        answered = [c for c in calls if c.status == "ok"]
        if len(answered) < len(calls):
            # Only a harness killed at its time limit leaves a call unanswered: its last, recorded as
            # aborted (the client went away), with nothing sampled, and never trained on.
            [aborted] = [c for c in calls if c.status != "ok"]
            assert outcomes[rollout_id] == "timeout" and aborted is calls[-1], [
                (c.status, c.error) for c in calls
            ]
            assert aborted.status == "aborted" and not aborted.completion_ids
        assert answered, "the model answered the harness"
        for c in answered:
            assert c.dialect == "openai" and c.policy_version == 0
            assert 0 < len(c.completion_ids) <= MAX_TOKENS
            assert len(c.completion_logprobs) == len(c.completion_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.completion_logprobs)
            # A turn ends at a stop token the engine sampled (kept as the last id), or at the token limit.
            if c.finish_reason == "length":
                assert len(c.completion_ids) == MAX_TOKENS
            else:
                assert c.finish_reason in ("stop", "tool_calls"), c.finish_reason
                assert c.completion_ids[-1] in STOP_IDS, c.completion_ids[-3:]
        # Real sampled logprobs: a scripted policy records 0.0 for every token.
        assert any(lp < -1e-3 for c in answered for lp in c.completion_logprobs)


@pytest.mark.parametrize("name", HARNESSES)
def test_prompts_fit_the_model_and_carry_the_harness_own_prompt_and_tools(
    study: dict[str, Recorded], name: str, tok: Any
) -> None:
    r = _one(study, name)
    system_prompt, *tools = MARKS[name]
    for calls in r.calls.values():
        for c in calls:
            assert c.prompt_tokens + len(c.completion_ids) <= MAX_POSITIONS
        first = calls[0]
        prompt = Store.full_prompts(calls)[first.id]  # type: ignore[index]
        assert len(prompt) == first.prompt_tokens
        text = tok.decode(prompt)
        # The harness's own system message opens the prompt, in the model's ChatML system turn, in
        # place of the model's default one; its tools are rendered into the prompt.
        system = first.messages_delta[0]
        assert system["role"] == "system" and system_prompt in text
        assert text.startswith(f"{IM_START}system\n{system['content']}") and SMOL_SYSTEM not in text
        assert all(mark in text for mark in tools), (name, tools)
        assert text.endswith(f"{IM_START}assistant\n")


@pytest.mark.parametrize("name", HARNESSES)
def test_calls_that_extend_each_other_are_one_branch(study: dict[str, Recorded], name: str) -> None:
    """A call whose prompt ids start with an earlier call's prompt + sampled ids continues that
    call's branch; the training builder merges by the ids themselves, and agrees with the gateway."""
    r = _one(study, name)
    for rollout_id, rows in r.calls.items():
        calls = calls_from_rows(rows)
        by_id = {c.call_id: c for c in calls}
        for row, call in zip(rows, calls, strict=True):
            if row.branch_reason:  # a new branch: no earlier call's sequence is its prompt's start
                assert row.parent_call_id is None
                for earlier in calls[: calls.index(call)]:
                    seq = [*earlier.prompt_ids, *earlier.completion_ids]
                    extends = list(call.prompt_ids[: len(seq)]) == seq
                    assert not extends or earlier.branch_id != call.branch_id, (rollout_id, row.branch_reason)
            else:  # it extended its parent: the parent's prompt + completion are its prompt's start
                parent = by_id[row.parent_call_id]  # type: ignore[index]
                seq = [*parent.prompt_ids, *parent.completion_ids]
                assert list(call.prompt_ids[: len(seq)]) == seq and parent.branch_id == call.branch_id
        main = [c for c in calls if not c.side_request and c.status == "ok"]
        samples = build_samples(main, 0.0)
        assert len(samples) == len({c.branch_id for c in main}), rollout_id
        for s in samples:
            assert len({by_id[i].branch_id for i in s.call_ids}) == 1
            assert len(s.input_ids) <= MAX_POSITIONS


@pytest.mark.parametrize("name", HARNESSES)
def test_a_malformed_tool_call_is_recorded_not_lost(study: dict[str, Recorded], name: str, tok: Any) -> None:
    """Whatever the model wrote: a `<tool_call>` block became a tool call or a parse error, whose
    text stays in the content the harness got; neither ended a rollout as an infrastructure error."""
    r = _one(study, name)
    for rows in r.calls.values():
        for c in rows:
            text = tok.decode(c.completion_ids)
            calls = c.response.get("tool_calls") or []
            if "<tool_call>" in text:
                assert calls or c.parse_errors, text
            if c.parse_errors:
                assert c.status == "ok" and "<tool_call>" in (c.response.get("content") or ""), c.response
            for call in calls:
                assert isinstance(call["function"]["name"], str), call


def test_the_study_reports_the_harnesses_side_by_side(study: dict[str, Recorded]) -> None:
    for name, r in study.items():
        b = r.report["behaviour"]
        assert b["rollouts"] == TASKS and b["turns_mean"] >= 1, name
        version = f"{name} {get(name).version}" if name in CLIS else "openforgerl "
        assert r.report["harness_versions"][name].startswith(version)
    if "mini-swe-agent" in study:  # mini-swe-agent's limit of model calls is the run's max_turns
        assert all(len(calls) <= MAX_TURNS for calls in study["mini-swe-agent"].calls.values())
    if "react" in study:
        assert all(len(calls) <= MAX_TURNS for calls in study["react"].calls.values())
