"""The gateway through the official OpenAI SDK: plain, streaming, tools, token truth, isolation."""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.sampling import derive_seed
from tests.conftest import CHAT_MODELS
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def client_for(rollout: dict[str, Any]) -> OpenAI:
    return OpenAI(
        base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0, timeout=120
    )


@pytest.fixture(scope="module", params=CHAT_MODELS)
def real_gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A gateway in front of the built-in engine with a real model: the kit's tiny one, and (marker
    real_model) SmolLM2-135M-Instruct with its own tokenizer and template."""
    model_dir = request.getfixturevalue({"tiny": "tiny_model_dir", "smollm2": "smollm2_dir"}[request.param])
    engine = TransformersEngine(str(model_dir))
    with running_gateway(model_dir, tmp_path_factory.mktemp("real"), engine, max_tokens=24) as gw:
        yield gw


def test_plain_completion_records_the_sampled_tokens(real_gateway: Any) -> None:
    rollout = new_rollout(real_gateway, run_id="r1", task_id="t1")
    client = client_for(rollout)
    reply = client.chat.completions.create(
        model="claude-opus-4-1",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"return_token_ids": True},
    )
    assert reply.model == "claude-opus-4-1"
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    [call] = calls_of(real_gateway, rollout["rollout_id"])
    assert call["model"] == "claude-opus-4-1"  # the name asked for is kept; the policy served it
    assert call["policy_version"] == 0
    assert call["completion_ids"] == reply.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert call["prompt_ids"] == reply.model_extra["prompt_token_ids"]  # type: ignore[index]
    assert len(call["completion_logprobs"]) == len(call["completion_ids"])
    assert call["sampling_used"]["temperature"] == 1.0


def test_streaming_with_usage(real_gateway: Any) -> None:
    rollout = new_rollout(real_gateway)
    stream = client_for(rollout).chat.completions.create(
        model="gpt-5",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    [call] = calls_of(real_gateway, rollout["rollout_id"])
    assert usage.completion_tokens == len(call["completion_ids"])
    assert usage.prompt_tokens == len(call["prompt_ids"])


def test_ten_turn_conversation_is_one_token_sequence_with_true_logprobs(real_gateway: Any) -> None:
    rollout = new_rollout(real_gateway)
    client = client_for(rollout)
    messages: list[Any] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Go."},
    ]
    for turn in range(10):
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=12)
        msg = reply.choices[0].message
        # Echo the turn back the way harnesses do: re-serialised by the SDK, reasoning dropped.
        messages.append(msg.model_dump(exclude_none=True, exclude={"reasoning_content"}))
        messages.append({"role": "user", "content": f"Observation {turn}: ok."})
    calls = calls_of(real_gateway, rollout["rollout_id"])
    assert len(calls) == 10
    assert {c["branch_id"] for c in calls} == {calls[0]["branch_id"]}
    for prev, cur in itertools.pairwise(calls):
        sampled = prev["prompt_ids"] + prev["completion_ids"]
        assert cur["prompt_ids"][: len(sampled)] == sampled
        assert cur["parent_call_id"] == prev["call_id"] and cur["branch_reason"] == ""
        assert cur["reused_prompt_tokens"] >= len(sampled)

    # Recorded logprobs agree with a teacher-forced forward pass over the final sequence.
    model_dir = real_gateway.gateway.core.engine.model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    last = calls[-1]
    seq = torch.tensor([last["prompt_ids"] + last["completion_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    worst = 0.0
    for c in calls:
        start = len(c["prompt_ids"])
        for i, (tok, lp) in enumerate(zip(c["completion_ids"], c["completion_logprobs"], strict=True)):
            worst = max(worst, abs(logp[start + i - 1, tok].item() - lp))
    assert worst < 2e-3, f"recorded logprobs differ from a teacher-forced pass by {worst}"


def test_tool_calls_parsed_and_echo_extends_branch(tiny_model_dir: Path, tmp_path: Path) -> None:
    turns = iter(
        [
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt", "n": 1}}\n</tool_call>',
            "<think>\nthe file says hi\n</think>\n\nIt says hi.",
            '<tool_call>\n{"name": "read_file", "arguments": {bad json}\n</tool_call>',
        ]
    )
    engine = ScriptEngine(tiny_model_dir, lambda _: next(turns))
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        rollout = new_rollout(gw)
        client = client_for(rollout)
        messages: list[Any] = [{"role": "user", "content": "Read a.txt"}]
        r1 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert r1.choices[0].finish_reason == "tool_calls"
        [tc] = r1.choices[0].message.tool_calls or []
        assert tc.function.name == "read_file"  # type: ignore[union-attr]
        assert json.loads(tc.function.arguments) == {"path": "a.txt", "n": 1}  # type: ignore[union-attr]
        # The harness re-serialises the call (compact JSON, its own id) before sending it back.
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "toolu_rewritten",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"n":1,"path":"a.txt"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": "toolu_rewritten", "content": "hi"})
        r2 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert r2.choices[0].message.content == "It says hi."
        assert r2.choices[0].message.model_extra["reasoning_content"] == "the file says hi"  # type: ignore[index]
        messages.append({"role": "assistant", "content": "It says hi."})  # reasoning dropped by the client
        messages.append({"role": "user", "content": "again"})
        r3 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        # A malformed call comes back as text and is flagged in the record, never a crash.
        assert r3.choices[0].finish_reason == "stop"
        assert "<tool_call>" in (r3.choices[0].message.content or "")
        calls = calls_of(gw, rollout["rollout_id"])
    assert [c["branch_id"] for c in calls] == [0, 0, 0]
    assert [c["branch_reason"] for c in calls[1:]] == ["", ""]
    assert calls[2]["parse_errors"] and not calls[1]["parse_errors"]
    for prev, cur in itertools.pairwise(calls):
        assert cur["prompt_ids"][: len(prev["prompt_ids"]) + len(prev["completion_ids"])] == (
            prev["prompt_ids"] + prev["completion_ids"]
        )


def test_rewritten_history_starts_a_new_branch_with_a_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        rollout = new_rollout(gw)
        client = client_for(rollout)
        history: list[Any] = [{"role": "system", "content": "time: 10:00"}, {"role": "user", "content": "hi"}]
        client.chat.completions.create(model="m", messages=history)
        history.append({"role": "assistant", "content": "Hello from the script."})
        history.append({"role": "user", "content": "more"})
        history[0] = {"role": "system", "content": "time: 10:01"}  # a context message that moves
        client.chat.completions.create(model="m", messages=history)
        calls = calls_of(gw, rollout["rollout_id"])
    assert calls[0]["branch_reason"] == "first call of the rollout"
    assert calls[1]["branch_id"] != calls[0]["branch_id"]
    assert "message 0 differs" in calls[1]["branch_reason"]
    assert calls[1]["reused_prompt_tokens"] == 0


def test_sampling_policy_overrides_and_clamps(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir), max_tokens=5) as gw:
        rollout = new_rollout(gw, sampling={"temperature": 0.7})
        reply = client_for(rollout).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], temperature=0.1, top_p=0.5, max_tokens=500
        )
        [call] = calls_of(gw, rollout["rollout_id"])
    assert reply.choices[0].finish_reason == "length" and reply.usage and reply.usage.completion_tokens == 5
    assert call["sampling_requested"]["temperature"] == 0.1
    assert call["sampling_used"]["temperature"] == 0.7
    assert call["sampling_used"]["top_p"] == 1.0
    assert call["sampling_used"]["max_tokens"] == 5
    assert set(call["sampling_used"]["overridden"]) == {"temperature", "top_p", "max_tokens"}


def test_a_rollout_seed_fixes_each_call_sampling(real_gateway: Any) -> None:
    """Seeded rollouts (what a seeded evaluation creates): call k samples with derive_seed(seed, k)
    whatever the harness asks, so the same seed repeats the same tokens at temperature 1."""

    def two_calls(rollout: dict[str, Any], **extra: Any) -> list[dict[str, Any]]:
        client = client_for(rollout)
        for _ in range(2):  # the same prompt twice
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}], **extra)
        return calls_of(real_gateway, rollout["rollout_id"])

    first = two_calls(new_rollout(real_gateway, sampling={"seed": 7}))
    again = two_calls(new_rollout(real_gateway, sampling={"seed": 7}), seed=123)
    other = two_calls(new_rollout(real_gateway, sampling={"seed": 8}))
    unseeded = two_calls(new_rollout(real_gateway), seed=123)
    assert [c["sampling_used"]["seed"] for c in first] == [derive_seed(7, 0), derive_seed(7, 1)]
    assert [c["completion_ids"] for c in again] == [c["completion_ids"] for c in first]
    assert again[0]["sampling_requested"]["seed"] == 123 and "seed" in again[0]["sampling_used"]["overridden"]
    assert all(len(c["completion_ids"]) > 5 for c in first + other)
    assert [c["completion_ids"] for c in other] != [c["completion_ids"] for c in first]
    assert first[0]["completion_ids"] != first[1]["completion_ids"]  # each call its own seed
    assert [c["sampling_used"]["seed"] for c in unseeded] == [123, 123]  # no rollout seed: the harness's

    bad = httpx.post(
        real_gateway.url + "/admin/rollouts",
        json={"sampling": {"seed": "7"}},
        headers=real_gateway.admin_headers,
    )
    assert bad.status_code == 400 and "seed must be an integer" in bad.text


def test_64_concurrent_rollouts_are_isolated(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = ScriptEngine(tiny_model_dir, lambda prompt: f"I saw {len(prompt)} tokens.")
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        rollouts = [new_rollout(gw, task_id=f"task-{i}") for i in range(64)]

        def talk(i: int) -> None:
            client = client_for(rollouts[i])
            msgs: list[Any] = [{"role": "user", "content": f"I am rollout {i}. " * (1 + i % 5)}]
            for _ in range(3):
                r = client.chat.completions.create(model=f"m{i}", messages=msgs)
                msgs += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "."},
                ]

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(talk, range(64)))
        for i, ro in enumerate(rollouts):
            calls = calls_of(gw, ro["rollout_id"])
            assert len(calls) == 3 and {c["model"] for c in calls} == {f"m{i}"}
            assert all(c["branch_id"] == 0 for c in calls)
        # One rollout's key cannot reach another rollout's URL, nor the admin API.
        a, b = rollouts[0], rollouts[1]
        with pytest.raises(openai.AuthenticationError):
            OpenAI(
                base_url=b["base_url"] + "/v1", api_key=a["api_key"], max_retries=0
            ).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        r = httpx.get(
            f"{gw.url}/admin/rollouts/{b['rollout_id']}/calls",
            headers={"authorization": f"Bearer {a['api_key']}"},
        )
        assert r.status_code == 401
        assert len(calls_of(gw, b["rollout_id"])) == 3


def test_closed_rollout_refuses_calls_and_keeps_reward(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        rollout = new_rollout(gw, run_id="run-x")
        client = client_for(rollout)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        r = httpx.post(
            f"{gw.url}/admin/rollouts/{rollout['rollout_id']}/close",
            json={"reward": 0.75, "details": {"tests": "3/4"}},
            headers=gw.admin_headers,
        )
        assert r.status_code == 200 and r.json()["status"] == "closed" and r.json()["reward"] == 0.75
        with pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        listed = httpx.get(f"{gw.url}/admin/rollouts?run_id=run-x", headers=gw.admin_headers).json()[
            "rollouts"
        ]
        assert [x["rollout_id"] for x in listed] == [rollout["rollout_id"]]
        assert listed[0]["details"] == {"tests": "3/4"}


def test_weights_update_bumps_policy_version_in_records(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        rollout = new_rollout(gw)
        client = client_for(rollout)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        r = httpx.post(
            gw.url + "/admin/weights", json={"path": str(tiny_model_dir)}, headers=gw.admin_headers
        )
        assert r.json() == {"policy_version": 1}
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}])
        assert [c["policy_version"] for c in calls_of(gw, rollout["rollout_id"])] == [0, 1]


def test_side_requests_are_flagged(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        rollout = new_rollout(gw)
        client = client_for(rollout)
        # A title request first (as opencode sends), then the conversation, then a JSON router request.
        client.chat.completions.create(
            model="small",
            messages=[
                {"role": "system", "content": "You are a title generator."},
                {"role": "user", "content": "fix the bug"},
            ],
        )
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "fix the bug"}], tools=TOOLS
        )
        client.chat.completions.create(
            model="router",
            messages=[{"role": "user", "content": "rate complexity"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": {"type": "object"}},
            },
        )
        calls = calls_of(gw, rollout["rollout_id"])
    assert "no tools" in calls[0]["side_request"]
    assert calls[1]["side_request"] == ""
    assert "structured output" in calls[2]["side_request"]
    assert calls[2]["sampling_requested"]["response_format"]["type"] == "json_schema"
    # This engine cannot constrain decoding; the record says the format was asked, not enforced.
    assert calls[2]["sampling_used"]["response_format_honoured"] is False


def test_response_format_reaches_engines_that_can_honour_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = ScriptEngine(tiny_model_dir)
    engine.supports_response_format = True
    seen: list[Any] = []
    original = engine.generate

    async def generate(prompt_ids: list[int], sampling: Any, images: Any = ()) -> Any:
        seen.append(sampling.response_format)
        return await original(prompt_ids, sampling)

    engine.generate = generate  # type: ignore[method-assign]
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        rollout = new_rollout(gw)
        client_for(rollout).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            response_format=fmt,  # type: ignore[arg-type]
        )
        [call] = calls_of(gw, rollout["rollout_id"])
    assert seen == [fmt] and call["sampling_used"]["response_format_honoured"] is True
