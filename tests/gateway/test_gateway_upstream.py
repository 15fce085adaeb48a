"""Rollouts answered by an upstream model instead of the policy, recorded as text, exported for SFT.

The upstream is real: a second gateway, which speaks both OpenAI Chat Completions and Anthropic
Messages, serving the tiny model's tokenizer with a scripted engine behind it (a tool call, then a
final answer). It checks keys like any provider, so the key the gateway under test reads from its
environment is the upstream rollout's own key, and the upstream's records show what it was sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic import Anthropic
from click.testing import CliRunner
from openai import OpenAI
from transformers import AutoTokenizer

from openforgerl.cli import main
from openforgerl.gateway.export import ExportCounts, chat_rows
from openforgerl.gateway.upstream import UpstreamSpec, parse_key_env, parse_upstream, with_key_envs
from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data
from openforgerl.rollouts.trajectory import build_samples, calls_from_json
from openforgerl.sampling import derive_seed
from openforgerl.store import CallRow, RolloutRow
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway

OPENAI_KEY_ENV = "TEST_TEACHER_OPENAI_KEY"
ANTHROPIC_KEY_ENV = "TEST_TEACHER_ANTHROPIC_KEY"
TOOL_CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
ANSWER = "The file says 17."
READ_FILE = {
    "name": "read_file",
    "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}
OPENAI_TOOLS: Any = [{"type": "function", "function": READ_FILE}]
ANTHROPIC_TOOLS: Any = [
    {
        "name": READ_FILE["name"],
        "description": READ_FILE["description"],
        "input_schema": READ_FILE["parameters"],
    }
]


def teacher_script(tokenizer: Any) -> Any:
    """The upstream's policy: a tool call when it has tools, the answer once a tool result came back."""

    def script(prompt: list[int]) -> str:
        text = tokenizer.decode(prompt)
        last_turn = text.rsplit("<|im_start|>", 2)[-2]
        if "<tool_response>" in last_turn:
            return ANSWER
        return TOOL_CALL if "<tools>" in text else "Hello from the teacher."

    return script


@pytest.fixture(scope="module")
def upstream(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir)
    engine.script = teacher_script(engine.tokenizer)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("upstream"), engine) as gw:
        gw.engine = engine  # type: ignore[attr-defined]
        yield gw


def specs(upstream: Any, **kw: Any) -> list[UpstreamSpec]:
    return [
        UpstreamSpec("t-openai", "openai", "teacher-o", upstream.url + "/v1", OPENAI_KEY_ENV, **kw),
        UpstreamSpec("t-anthropic", "anthropic", "teacher-a", upstream.url, ANTHROPIC_KEY_ENV, **kw),
    ]


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, upstream: Any) -> Iterator[Any]:
    """The gateway under test. Its own engine must never be asked: the upstream answers."""
    engine = ScriptEngine(tiny_model_dir, lambda prompt: "the POLICY answered")
    slow = UpstreamSpec("t-slow", "openai", "teacher-o", upstream.url + "/v1", OPENAI_KEY_ENV, timeout=0.5)
    with running_gateway(
        tiny_model_dir, tmp_path_factory.mktemp("gw"), engine, upstreams=[*specs(upstream), slow]
    ) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g
    assert engine.prompts == []


@pytest.fixture()
def teacher(upstream: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A rollout on the upstream whose key the gateway under test finds in its environment."""
    rollout = new_rollout(upstream)
    monkeypatch.setenv(OPENAI_KEY_ENV, rollout["api_key"])
    monkeypatch.setenv(ANTHROPIC_KEY_ENV, rollout["api_key"])
    return rollout


def openai_client(rollout: dict[str, Any]) -> OpenAI:
    return OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0, timeout=60)


def anthropic_client(rollout: dict[str, Any]) -> Anthropic:
    return Anthropic(base_url=rollout["base_url"], api_key=rollout["api_key"], max_retries=0, timeout=60)


def openai_episode(rollout: dict[str, Any]) -> list[str]:
    """A tool call, its result, and the answer (streamed), as an OpenAI-speaking harness plays it."""
    client = openai_client(rollout)
    messages: list[Any] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "What does a.txt say?"},
    ]
    first = client.chat.completions.create(
        model="gpt-5", messages=messages, tools=OPENAI_TOOLS, temperature=0.3, max_tokens=200
    )
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.txt"}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "17"},
    ]
    stream = client.chat.completions.create(
        model="gpt-5", messages=messages, tools=OPENAI_TOOLS, temperature=0.3, max_tokens=200, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    return [call.id, text]


def anthropic_episode(rollout: dict[str, Any]) -> list[str]:
    """The same episode as an Anthropic-speaking harness (Claude Code) plays it: the answer streamed."""
    client = anthropic_client(rollout)
    messages: list[Any] = [{"role": "user", "content": "What does a.txt say?"}]
    ask: Any = {
        "model": "claude-x",
        "max_tokens": 200,
        "system": "You are an agent.",
        "tools": ANTHROPIC_TOOLS,
    }
    first = client.messages.create(messages=messages, extra_body={"temperature": 0.3}, **ask)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "read_file" and use.input == {"path": "a.txt"}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "17"}]},
    ]
    with client.messages.stream(messages=messages, extra_body={"temperature": 0.3}, **ask) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    return [use.id, "".join(b.text for b in final.content if b.type == "text")]


def test_a_rollout_seed_reaches_the_upstream_call_by_call(
    gw: Any, upstream: Any, teacher: dict[str, Any]
) -> None:
    """As for the policy: call k of a seeded rollout asks the teacher for derive_seed(seed, k)."""
    rollout = new_rollout(gw, upstream="t-openai", sampling={"seed": 5})
    openai_episode(rollout)
    expected = [derive_seed(5, 0), derive_seed(5, 1)]
    assert [c["sampling_used"]["seed"] for c in calls_of(gw, rollout["rollout_id"])] == expected
    assert [c["sampling_requested"]["seed"] for c in calls_of(upstream, teacher["rollout_id"])] == expected


EPISODES = {"openai": openai_episode, "anthropic": anthropic_episode}


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_a_harness_in_either_dialect_gets_the_upstreams_answers_recorded_as_text(
    gw: Any, upstream: Any, teacher: dict[str, Any], client: str, kind: str
) -> None:
    rollout = new_rollout(gw, run_id="distill", upstream=f"t-{kind}")
    assert rollout["metadata"] == {"upstream": f"t-{kind}"}
    call_id, answer = EPISODES[client](rollout)
    assert answer == ANSWER

    calls = calls_of(gw, rollout["rollout_id"])
    assert [c["status"] for c in calls] == ["ok", "ok"]
    for c in calls:
        # Text level: the upstream's model and kind, no token ids, no logprobs, no policy version.
        assert c["engine"] == f"upstream:{kind}" and c["model"] == f"teacher-{kind[0]}"
        assert c["sampling_requested"]["model"] in ("gpt-5", "claude-x")
        assert c["prompt_ids"] == c["completion_ids"] == c["completion_logprobs"] == []
        assert c["policy_version"] is None
        assert c["sampling_used"]["upstream"] == f"t-{kind}" and c["sampling_used"]["temperature"] == 0.3
        assert c["sampling_used"]["usage"]["prompt_tokens"] > 0
    first, second = calls
    [sent_call] = first["response"]["tool_calls"]
    assert sent_call["function"] == {"name": "read_file", "arguments": {"path": "a.txt"}}
    assert first["sampling_requested"]["tool_definitions"][0]["function"] == READ_FILE
    # The second call extends the first: only the tool result is new, the branch goes on.
    assert second["parent_call_id"] == first["call_id"] and second["branch_reason"] == ""
    assert second["branch_id"] == first["branch_id"]
    assert [m["role"] for m in second["messages_delta"]] == ["tool"]
    assert (
        second["messages_delta"][0]["content"] == "17"
        and second["messages_delta"][0]["tool_call_id"] == call_id
    )
    assert second["response"]["content"] == ANSWER and second["finish_reason"] == "stop"
    # Nothing here is a token-level sample for the trainer.
    assert build_samples(calls_from_json({"rollout_id": rollout["rollout_id"], "calls": calls}), 1.0) == []

    # The upstream got both calls under the key from the environment, in its own API's dialect.
    seen = calls_of(upstream, teacher["rollout_id"])
    assert [c["dialect"] for c in seen] == [kind, kind]
    assert [c["model"] for c in seen] == [f"teacher-{kind[0]}"] * 2
    assert seen[0]["sampling_requested"]["temperature"] == 0.3
    assert seen[0]["sampling_requested"]["tools"] == 1
    assert seen[1]["parent_call_id"] == seen[0]["call_id"]  # the echoed tool call matched its turn
    tool_result = [m for m in seen[1]["messages_delta"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_result] == ["17"]


def test_a_gemini_harness_whose_calls_have_no_ids(gw: Any, upstream: Any, teacher: dict[str, Any]) -> None:
    """Gemini names tool results by function, without call ids: the upstream gets ids that pair up."""
    rollout = new_rollout(gw, upstream="t-openai")
    url = f"{rollout['base_url']}/v1beta/models/gemini-x:generateContent"
    headers = {"x-goog-api-key": rollout["api_key"]}
    tools = [{"functionDeclarations": [READ_FILE]}]
    contents: list[Any] = [{"role": "user", "parts": [{"text": "What does a.txt say?"}]}]
    r = httpx.post(url, json={"contents": contents, "tools": tools}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    [part] = r.json()["candidates"][0]["content"]["parts"]
    call = {k: v for k, v in part["functionCall"].items() if k != "id"}  # as older clients echo it
    assert call == {"name": "read_file", "args": {"path": "a.txt"}}
    contents += [
        {"role": "model", "parts": [{"functionCall": call}]},
        {
            "role": "user",
            "parts": [{"functionResponse": {"name": "read_file", "response": {"output": "17"}}}],
        },
    ]
    r = httpx.post(url, json={"contents": contents, "tools": tools}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["candidates"][0]["content"]["parts"][0]["text"] == ANSWER
    # The upstream saw the id-less call and its result paired by an id the gateway gave them.
    first, second = calls_of(upstream, teacher["rollout_id"])
    assert second["parent_call_id"] == first["call_id"]
    [result] = second["messages_delta"]
    assert result["role"] == "tool" and result["tool_call_id"] == "call_1" and "17" in result["content"]


def test_unknown_upstream_is_a_clear_400(gw: Any) -> None:
    r = httpx.post(gw.url + "/admin/rollouts", json={"upstream": "gpt-9"}, headers=gw.admin_headers)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "upstream"
    assert "Unknown upstream 'gpt-9'" in r.json()["error"]["message"]
    assert "t-anthropic, t-openai, t-slow" in r.json()["error"]["message"]
    r = httpx.post(
        gw.url + "/admin/rollouts", json={"metadata": {"upstream": "t-openai"}}, headers=gw.admin_headers
    )
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]


def test_upstream_errors_reach_the_harness_in_its_dialect_and_the_rollout_goes_on(
    gw: Any, upstream: Any, teacher: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def faults(*statuses: int) -> None:
        r = httpx.post(
            f"{upstream.url}/admin/rollouts/{teacher['rollout_id']}/faults",
            json={"errors": list(statuses)},
            headers=upstream.admin_headers,
        )
        assert r.status_code == 200, r.text

    ask: Any = {"model": "gpt-5", "messages": [{"role": "user", "content": "Hi"}]}
    rollout = new_rollout(gw, upstream="t-openai")
    client = openai_client(rollout)
    faults(429, 500)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(**ask)
    assert limited.value.response.headers["retry-after"] == "1"
    assert "rate limited" in limited.value.message
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(**ask)
    assert failed.value.status_code == 500
    assert client.chat.completions.create(**ask).choices[0].message.content == "Hello from the teacher."
    calls = calls_of(gw, rollout["rollout_id"])
    assert [c["status"] for c in calls] == ["error", "error", "ok"]
    assert calls[0]["error"].startswith("upstream 429") and calls[1]["error"].startswith("upstream 500")
    assert calls[0]["engine"] == "upstream:openai" and calls[0]["model"] == "teacher-o"

    # Anthropic's own words: a 429 is a rate_limit_error, a 529 an overloaded_error, and trouble after
    # a stream began an `overloaded_error` event.
    rollout = new_rollout(gw, upstream="t-anthropic")
    claude = anthropic_client(rollout)
    ask = {"model": "claude-x", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}]}
    faults(429, 529, 503)
    with pytest.raises(anthropic.RateLimitError):
        claude.messages.create(**ask)
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        claude.messages.create(**ask)
    assert overloaded.value.response.headers["retry-after"] == "1"
    with pytest.raises(anthropic.APIStatusError) as in_stream:
        list(claude.messages.create(**ask, stream=True))
    assert in_stream.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert claude.messages.create(**ask).content[0].text == "Hello from the teacher."  # type: ignore[union-attr]

    # A timeout is a 504; the upstream's generation is abandoned, the next call works.
    slow = new_rollout(gw, upstream="t-slow")
    upstream.engine.delay = 2.0
    try:
        with pytest.raises(openai.InternalServerError) as timed_out:
            openai_client(slow).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}]
            )
    finally:
        upstream.engine.delay = 0.0
    assert timed_out.value.status_code == 504 and "did not answer within 0.5s" in timed_out.value.message

    # The gateway's own key trouble is not the harness's: a 500 or 502 that says what to fix.
    monkeypatch.delenv(OPENAI_KEY_ENV)
    with pytest.raises(openai.InternalServerError, match=f"\\${OPENAI_KEY_ENV} is not set"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    monkeypatch.setenv(OPENAI_KEY_ENV, "wrong-key")
    with pytest.raises(openai.APIStatusError, match="refused the gateway's key") as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.status_code == 502


def test_a_restarted_gateway_routes_the_rollout_and_continues_its_branch(
    tiny_model_dir: Path, tmp_path: Path, upstream: Any, teacher: dict[str, Any]
) -> None:
    def restarted(**cfg: Any) -> Any:
        return running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir), **cfg)

    def client(g: Any) -> OpenAI:  # the same rollout and key, at the new gateway's address
        return openai_client({**rollout, "base_url": f"{g.url}/r/{rollout['rollout_id']}"})

    messages: list[Any] = [{"role": "user", "content": "What does a.txt say?"}]
    with restarted(upstreams=specs(upstream)[:1]) as g:
        rollout = new_rollout(g, upstream="t-openai")
        first = client(g).chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    [call] = first.choices[0].message.tool_calls or []
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "17"}]
    with restarted(upstreams=specs(upstream)[:1]) as g:
        second = client(g).chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
        assert second.choices[0].message.content == ANSWER
        calls = calls_of(g, rollout["rollout_id"])
    assert calls[1]["parent_call_id"] == calls[0]["call_id"] and calls[1]["engine"] == "upstream:openai"
    assert len(calls_of(upstream, teacher["rollout_id"])) == 2
    # Started without that upstream, the gateway says so instead of letting the policy answer.
    with restarted() as g, pytest.raises(openai.InternalServerError, match="was not started with"):
        client(g).chat.completions.create(model="m", messages=messages)


def test_export_sft_rows_train_on_the_teachers_turns_only(
    gw: Any, teacher: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    rewards = {"openai": 1.0, "anthropic": 1.0, "failed": 0.0}
    for name, reward in rewards.items():
        rollout = new_rollout(gw, run_id="export", task_id=name, upstream="t-openai")
        (anthropic_episode if name == "anthropic" else openai_episode)(rollout)
        r = httpx.post(
            f"{gw.url}/admin/rollouts/{rollout['rollout_id']}/close",
            json={"reward": reward},
            headers=gw.admin_headers,
        )
        assert r.status_code == 200, r.text
    out = tmp_path / "chats.jsonl"
    store = str(gw.gateway.core.store.path)
    args = ["export-sft", "--store", store, "--run", "export", "--min-reward", "1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 conversations from 2 rollouts" in result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["task_id"] for r in rows) == ["anthropic", "openai"]
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
        assert row["tools"] == [{"type": "function", "function": READ_FILE}]
        assert row["models"] == ["teacher-o"] and row["engines"] == ["upstream:openai"]
        assert row["messages"][-1]["content"] == ANSWER

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = load_sft_data(out, tokenizer)
    assert len(samples) == 2
    for s in samples:
        trained = tokenizer.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
        assert trained == f"{TOOL_CALL}<|im_end|>{ANSWER}<|im_end|>"
        assert "# Tools" in tokenizer.decode(s.input_ids)  # the tools are in the prompt, not trained
    trainer = SFTTrainer(tiny_model_dir, SFTConfig(lr=3e-3, epochs=4, batch_size=2, device="cpu"))
    summary = trainer.fit(samples, tmp_path / "student", progress=False)
    assert summary["loss_after"] < summary["loss_before"] - 0.5


def test_upstream_spec_syntax() -> None:
    assert parse_upstream("teacher=openai:gpt-4.1") == UpstreamSpec("teacher", "openai", "gpt-4.1")
    spec = parse_upstream("local=openai:llama3:8b@http://127.0.0.1:11434/v1")
    assert (spec.model, spec.url, spec.env) == ("llama3:8b", "http://127.0.0.1:11434/v1", "OPENAI_API_KEY")
    spec = parse_upstream("c=anthropic:claude-opus-4-1@20250805@https://example.com/")
    assert (spec.model, spec.url, spec.env) == (
        "claude-opus-4-1@20250805",
        "https://example.com",
        "ANTHROPIC_API_KEY",
    )
    assert parse_upstream("c=anthropic:claude-sonnet-4-5").url == "https://api.anthropic.com"
    for bad in ("teacher", "teacher=openai", "t=gemini:x", "=openai:x", "t t=openai:x"):
        with pytest.raises(ValueError):
            parse_upstream(bad)
    [spec] = with_key_envs([parse_upstream("t=openai:m")], dict([parse_key_env("t=MY_KEY")]))
    assert spec.env == "MY_KEY"
    with pytest.raises(ValueError, match="unknown upstream"):
        with_key_envs([parse_upstream("t=openai:m")], {"u": "KEY"})
    with pytest.raises(ValueError):
        parse_key_env("t=not a var")


def _row(call_id: int, parent: int | None, delta: list[Any], answer: str, **kw: Any) -> CallRow:
    return CallRow(
        rollout_id="ro_1",
        seq=call_id,
        branch_id=kw.pop("branch_id", 0),
        parent_call_id=parent,
        branch_reason="",
        dialect="openai",
        model="teacher",
        engine="upstream:openai",
        status=kw.pop("status", "ok"),
        error="",
        policy_version=None,
        prompt_prefix_len=0,
        prompt_delta=[],
        prompt_tokens=0,
        completion_ids=[],
        completion_logprobs=[],
        finish_reason=kw.pop("finish_reason", "stop"),
        stop_reason=None,
        sampling_requested=kw.pop("requested", {"tools": 1, "tool_definitions": OPENAI_TOOLS}),
        sampling_used={},
        messages_delta=delta,
        response={"role": "assistant", "content": answer},
        parse_errors=[],
        memory={},
        created_at=0.0,
        latency_ms=1.0,
        id=call_id,
    )


def test_chat_rows_one_per_branch() -> None:
    """A fork gives two rows sharing their start; harness-written assistant turns get weight 0; side
    requests, answers cut by max_tokens and failed calls stay out."""
    user = {"role": "user", "content": "Go."}
    fed = {"role": "assistant", "content": "An earlier session's turn."}
    calls = [
        _row(1, None, [user, fed, {"role": "user", "content": "Again."}], "A1"),
        _row(2, 1, [{"role": "user", "content": "More."}], "A2"),
        _row(3, 1, [{"role": "user", "content": "Other."}], "A3", branch_id=1),  # a fork of call 1
        _row(4, 2, [{"role": "user", "content": "x"}], "", status="error"),
        _row(5, None, [{"role": "user", "content": "Title?"}], "T", requested={"tools": 0}, branch_id=2),
        _row(6, None, [user], "cut", finish_reason="length", branch_id=3),
    ]
    rollout = RolloutRow("ro_1", "run", "task", "h", reward=1.0)
    counts = ExportCounts()
    rows = chat_rows(rollout, calls, counts)
    assert [r["call_ids"] for r in rows] == [[1, 2], [1, 3]]
    assert [m["content"] for m in rows[0]["messages"]] == [
        "Go.",
        fed["content"],
        "Again.",
        "A1",
        "More.",
        "A2",
    ]
    assert rows[0]["messages"][1]["weight"] == 0 and "weight" not in rows[0]["messages"][3]
    assert rows[1]["messages"][-2:] == [
        {"role": "user", "content": "Other."},
        {"role": "assistant", "content": "A3"},
    ]
    assert rows[0]["tools"] == OPENAI_TOOLS and rows[0]["reward"] == 1.0
    assert counts.skipped == {"side request": 1, "an answer was cut by max_tokens": 1}
