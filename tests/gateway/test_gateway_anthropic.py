"""The gateway through the official Anthropic SDK: messages, streaming, tools, thinking, token truth,
Claude Code's request shapes, errors, and fuzzed bodies."""

from __future__ import annotations

import copy
import itertools
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic import Anthropic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openforgerl.engines.base import GenerateResult, SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.gateway.dialects.anthropic import AnthropicMessages, parse_request, stream_error
from openforgerl.gateway.errors import GatewayError, context_length_exceeded
from tests.conftest import CHAT_MODELS
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway
from tests.strategies import json_values as json_values_of

BASH: Any = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"],
    },
}
# Claude Code's system prompt: a billing header block, then the prompt blocks with cache_control.
SYSTEM: Any = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.a1f; cc_entrypoint=sdk-cli;"},
    {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Use the tools to do the task.", "cache_control": {"type": "ephemeral"}},
]
ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


def client_for(rollout: dict[str, Any], **kw: Any) -> Anthropic:
    options = {"max_retries": 0, "timeout": 60, **kw}
    return Anthropic(base_url=rollout["base_url"], api_key=rollout["api_key"], **options)


def post(rollout: dict[str, Any], body: Any, path: str = "/v1/messages", **kw: Any) -> httpx.Response:
    headers = {"x-api-key": rollout["api_key"], "anthropic-version": "2023-06-01", **kw.pop("headers", {})}
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(rollout["base_url"] + path, content=content, headers=headers, timeout=30, **kw)


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every SSE event; keep-alive comments skipped."""
    out = []
    for chunk in text.split("\n\n"):
        lines = [line for line in chunk.split("\n") if line and not line.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: "), chunk
            out.append((lines[0][7:], orjson.loads(lines[1][6:])))
    return out


class Replies:
    """The scripted engine's answers, in order; a default once they run out."""

    def __init__(self) -> None:
        self.queue: list[str] = []

    def __call__(self, prompt: list[int]) -> str:
        return self.queue.pop(0) if self.queue else "Hello from the script."


@pytest.fixture()
def gw(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    replies = Replies()
    engine = ScriptEngine(tiny_model_dir, replies)
    with running_gateway(
        tiny_model_dir, tmp_path, engine, max_context=1024, max_body=50_000, max_inflight=8
    ) as g:
        g.engine, g.replies = engine, replies  # type: ignore[attr-defined]
        yield g


def test_plain_streamed_and_raw_streamed_answers_match_the_record(gw: Any) -> None:
    ro = new_rollout(gw)
    client = client_for(ro)
    ask: Any = {
        "model": "claude-opus-5-5",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hi"}],
    }
    reply = client.messages.create(**ask)
    assert reply.id.startswith("msg_") and reply.model == "claude-opus-5-5" and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "Hello from the script."
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None

    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final: Any = stream.get_final_message()
    assert streamed == "Hello from the script." and final.content[0].text == streamed
    assert final.stop_reason == "end_turn"

    events = list(client.messages.create(**ask, stream=True))
    kinds = [e.type for e in events]
    # The text streams as it is sampled: one block, several deltas.
    assert [k for k, _ in itertools.groupby(kinds)] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert kinds.count("content_block_delta") > 1
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == streamed
    # On the wire: a ping after message_start, and every event's name is its data's type.
    raw = sse_events(post(ro, {**ask, "stream": True}).text)
    assert [name for name, _ in raw][:2] == ["message_start", "ping"]
    assert all(name == data["type"] for name, data in raw)

    calls = calls_of(gw, ro["rollout_id"])
    assert len(calls) == 4 and {c["dialect"] for c in calls} == {"anthropic"}
    for c, usage in [(calls[0], reply.usage), (calls[1], final.usage)]:
        assert usage.output_tokens == len(c["completion_ids"])
        # Anthropic's split: fresh input + cache reads = the whole prompt.
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(c["prompt_ids"])
        assert usage.cache_read_input_tokens == c["reused_prompt_tokens"]
        assert usage.cache_creation_input_tokens == 0


def claude_code_shape(history: list[Any]) -> list[Any]:
    """The history as Claude Code sends it each turn: cache_control on the newest block only, which
    turns the newest message's string content into a block list (and back, one turn later)."""
    out = copy.deepcopy(history)
    if isinstance(out[-1]["content"], str):
        out[-1]["content"] = [{"type": "text", "text": out[-1]["content"]}]
    out[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return out


def test_claude_code_session_with_tools_and_thinking_stays_on_one_branch(gw: Any) -> None:
    gw.replies.queue += [
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "timeout": 5}}\n</tool_call>',
        "<think>\nls showed two files\n</think>\n\nThere are two files.",
        "I will look first.\n"
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "rm b.txt"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>',
        "Done.",
    ]
    ro = new_rollout(gw)
    client = client_for(ro)
    tools: Any = [
        {**BASH, "cache_control": {"type": "ephemeral"}},
        {**BASH, "name": "Read", "description": "Read a file.", "defer_loading": True},
    ]
    extra: Any = {
        "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "output_config": {"effort": "medium"},
    }
    history: list[Any] = [
        {"role": "user", "content": "List the files."},
        {"role": "system", "content": "<env>cwd: /work</env>"},  # Claude Code's mid-conversation system
        {"role": "user", "content": "Go."},
    ]

    def turn(stream: bool = False) -> Any:
        ask: Any = {
            "model": "claude-opus-5-5",
            "max_tokens": 128000,
            "system": SYSTEM,
            "tools": tools,
            "messages": claude_code_shape(history),
            "extra_body": extra,
        }
        if not stream:
            # As Claude Code sends it: the beta endpoint, `POST /v1/messages?beta=true`.
            return client.beta.messages.create(**ask, betas=["claude-code-20250219"])
        with client.messages.stream(**ask) as s:
            return s.get_final_message()

    def echo(reply: Any) -> None:
        history.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
        )

    r1 = turn()
    assert r1.stop_reason == "tool_use"
    [use] = r1.content
    assert use.type == "tool_use" and use.name == "Bash" and use.input == {"command": "ls", "timeout": 5}
    assert use.id.startswith("toolu_")
    echo(r1)
    history.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "a.txt\nb.txt", "is_error": False},
                {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
            ],
        }
    )

    r2 = turn(stream=True)
    assert [b.type for b in r2.content] == ["thinking", "text"] and r2.stop_reason == "end_turn"
    assert r2.content[0].thinking == "ls showed two files" and r2.content[0].signature
    echo(r2)  # with its thinking block and signature, as Claude Code sends it back
    history.append({"role": "user", "content": "Delete b.txt."})

    r3 = turn()
    assert [b.type for b in r3.content] == ["text", "tool_use", "tool_use"] and r3.stop_reason == "tool_use"
    assert r3.content[0].text == "I will look first."
    echo(r3)
    history.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": r3.content[1].id,
                    "content": [{"type": "text", "text": "rm: denied"}],
                    "is_error": True,
                },
                {"type": "tool_result", "tool_use_id": r3.content[2].id, "content": "a.txt\nb.txt"},
            ],
        }
    )
    r4 = turn()
    assert r4.content[0].text == "Done."

    calls = calls_of(gw, ro["rollout_id"])
    assert len(calls) == 4 and {c["branch_id"] for c in calls} == {calls[0]["branch_id"]}
    for prev, cur in itertools.pairwise(calls):
        sampled = prev["prompt_ids"] + prev["completion_ids"]
        assert cur["prompt_ids"][: len(sampled)] == sampled
        assert cur["parent_call_id"] == prev["call_id"] and cur["branch_reason"] == ""
    for reply, c in zip([r1, r2, r3, r4], calls, strict=True):
        assert reply.usage.cache_read_input_tokens == c["reused_prompt_tokens"]
    # The tool results and the reminder became tool messages and a user message.
    assert [m["role"] for m in calls[1]["messages_delta"]] == ["tool", "user"]
    assert [m["role"] for m in calls[3]["messages_delta"]] == ["tool", "tool"]
    prompt = gw.engine.tokenizer.decode(calls[3]["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\nx-anthropic-billing-header: cc_version=2.1.332.a1f;")
    assert "You are a Claude agent.\nUse the tools to do the task." in prompt
    assert "<|im_start|>system\n<env>cwd: /work</env><|im_end|>" in prompt
    assert "<tool_response>\nError: rm: denied\n</tool_response>" in prompt
    assert '"name": "Read"' in prompt  # the deferred tool is listed like any other


def test_thinking_stream_events_and_omitted_display(gw: Any) -> None:
    gw.replies.queue += ["<think>\nponder\n</think>\n\nanswer"] * 2
    ro = new_rollout(gw)
    ask: Any = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]}
    raw = sse_events(
        post(ro, {**ask, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 9}}).text
    )
    blocks = [(d["content_block"]["type"]) for n, d in raw if n == "content_block_start"]
    deltas = [d["delta"]["type"] for n, d in raw if n == "content_block_delta"]
    assert blocks == ["thinking", "text"]
    # Streamed as sampled: thinking deltas, the signature as the block closes, then text deltas.
    assert [k for k, _ in itertools.groupby(deltas)] == ["thinking_delta", "signature_delta", "text_delta"]
    thought = "".join(d["delta"].get("thinking", "") for n, d in raw if n == "content_block_delta")
    assert thought == "ponder"
    # Claude Code asks for display "omitted": the block and its signature come, the text does not.
    reply = client_for(ro).messages.create(**ask, thinking={"type": "adaptive", "display": "omitted"})
    assert reply.content[0].type == "thinking" and reply.content[0].thinking == ""
    assert reply.content[0].signature and reply.content[1].text == "answer"


def test_count_tokens_is_the_next_calls_prompt_length(gw: Any) -> None:
    ro = new_rollout(gw)
    client = client_for(ro)
    messages: list[Any] = [{"role": "user", "content": "Count me."}]
    counted = client.messages.count_tokens(model="m", system=SYSTEM, tools=[BASH], messages=messages)
    reply = client.messages.create(model="m", max_tokens=50, system=SYSTEM, tools=[BASH], messages=messages)
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Again."}]
    # The second count goes through token memory, like the call after it.
    counted_again = client.messages.count_tokens(model="m", system=SYSTEM, tools=[BASH], messages=messages)
    client.messages.create(model="m", max_tokens=50, system=SYSTEM, tools=[BASH], messages=messages)
    first, second = calls_of(gw, ro["rollout_id"])
    assert counted.input_tokens == len(first["prompt_ids"])
    assert counted_again.input_tokens == len(second["prompt_ids"]) and second["reused_prompt_tokens"] > 0
    assert post(ro, {"model": "m", "messages": []}, "/v1/messages/count_tokens").status_code == 400


class StopStringEngine(ScriptEngine):
    """The scripted engine, also ending at a stop string as real engines do (it stays in the ids)."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Any = ()
    ) -> GenerateResult:
        result = await super().generate(prompt_ids, sampling)
        text = str(self.tokenizer.decode(result.completion_ids))
        hits = [(pos, s) for s in sampling.stop if (pos := text.find(s)) >= 0]
        if not hits:
            return result
        pos, stop = min(hits)
        ids = self.tokenizer.encode(text[: pos + len(stop)], add_special_tokens=False)
        return GenerateResult(ids, [-0.5] * len(ids), "stop", result.policy_version, stop)


def test_stop_reasons(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = StopStringEngine(tiny_model_dir, lambda _: "one two END three FIN")
    with running_gateway(tiny_model_dir, tmp_path, engine) as gw:
        ro = new_rollout(gw)
        client = client_for(ro)
        ask: Any = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]}
        # This SDK no longer has sampling parameters; older clients (and pi) still send them.
        sampling = {"temperature": 0.2, "top_p": 0.9, "top_k": 5}
        r = client.messages.create(**ask, stop_sequences=["FIN", "END"], extra_body=sampling)
        assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", "END", "one two")
        with client.messages.stream(**ask, stop_sequences=["END"]) as s:
            final = s.get_final_message()
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
        assert client.messages.create(**ask).stop_reason == "end_turn"
        assert client.messages.create(**{**ask, "max_tokens": 2}).stop_reason == "max_tokens"
        call = calls_of(gw, ro["rollout_id"])[0]
    assert call["sampling_requested"]["stop"] == ["FIN", "END"]
    assert call["sampling_requested"]["temperature"] == 0.2 and call["sampling_requested"]["top_p"] == 0.9


def test_translation_of_fields_and_forms() -> None:
    def conv(**body: Any) -> Any:
        return parse_request(orjson.dumps({"model": "m", **body}))[0]

    # A string and one text block with cache_control are the same message, in every position.
    as_string = conv(system="S", messages=[{"role": "user", "content": "hi"}])
    as_blocks = conv(
        system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
    )
    assert as_string.messages == as_blocks.messages
    c = conv(
        messages=[{"role": "user", "content": "q"}],
        tools=[BASH],
        tool_choice={"type": "tool", "name": "Bash"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"},
        max_tokens=7,
        stream=True,
        safeguards={"anything": [1, 2]},
    )
    assert c.tool_choice == {"type": "function", "function": {"name": "Bash"}}
    assert c.response_format == {"type": "json_schema", "schema": {"type": "object"}}
    assert c.sampling.max_tokens == 7 and c.stream and c.dialect == "anthropic"
    assert [(t.name, t.parameters) for t in c.tools] == [("Bash", BASH["input_schema"])]
    for choice, expected in [("auto", "auto"), ("any", "required"), ("none", "none")]:
        assert (
            conv(messages=[{"role": "user", "content": "q"}], tool_choice={"type": choice}).tool_choice
            == expected
        )
    # An assistant turn of thinking + text + tool uses is one message; redacted thinking is dropped.
    a = conv(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "b64"},
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        ]
    ).messages[1]
    assert (a.role, a.content, a.reasoning) == ("assistant", "ok", "hm")
    with pytest.raises(GatewayError) as info:
        conv(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t"}, {"type": "document"}],
                }
            ]
        )
    assert (
        info.value.param == "messages.0.content.1.type"
        and "document input is not supported" in info.value.message.lower()
    )
    assert [(t.id, t.name, t.arguments) for t in a.tool_calls] == [
        ("toolu_1", "Bash", {"command": "ls"}),
        ("toolu_2", "Bash", {}),
    ]


def assert_anthropic_error(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    message: str = body["error"]["message"]
    return message


def test_errors_in_anthropic_shape_through_the_sdk(gw: Any) -> None:
    ro = new_rollout(gw)
    client = client_for(ro)
    ask: Any = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "q"}]}
    with pytest.raises(anthropic.AuthenticationError):
        Anthropic(base_url=ro["base_url"], api_key="nope", max_retries=0).messages.create(**ask)
    assert_anthropic_error(post(ro, ask, headers={"x-api-key": "nope"}), 401, "authentication_error")

    # Too long a prompt: Anthropic's wording, which Claude Code reacts to by compacting.
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**{**ask, "messages": [{"role": "user", "content": "word " * 1100}]})
    found = re.search(r"prompt is too long: (\d+) tokens > 1024 maximum", info.value.message)
    assert found and int(found[1]) > 1024
    remote = {"type": "url", "url": "https://example.com/a.png"}
    refused: list[tuple[dict[str, Any], str]] = [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": remote}]}]},
            "fetches nothing",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "prefill"),
        ({"tool_choice": {"type": "tool"}}, "needs the tool's 'name'"),
    ]
    for bad, words in refused:
        with pytest.raises(anthropic.BadRequestError, match=words):
            client.messages.create(**{**ask, **bad})
    assert "not valid JSON" in assert_anthropic_error(post(ro, b"{oops"), 400, "invalid_request_error")
    assert_anthropic_error(post(ro, {**ask, "system": "x" * 60_000}), 413, "request_too_large")

    # At the in-flight limit: 429 with retry-after, which the SDK waits out before it retries.
    gw.gateway.core.max_inflight = 0
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(**ask)
    r = post(ro, ask)
    assert_anthropic_error(r, 429, "rate_limit_error")
    assert r.headers["retry-after"] == "1"
    threading.Timer(0.3, setattr, (gw.gateway.core, "max_inflight", 8)).start()
    start = time.monotonic()
    assert client_for(ro, max_retries=2).messages.create(**ask).stop_reason == "end_turn"
    assert time.monotonic() - start >= 0.9

    # Engine down: 503 with retry-after before a stream; an `overloaded_error` event inside one.
    gw.engine.down = True
    with pytest.raises(anthropic.ServiceUnavailableError):
        client.messages.create(**ask)
    r = post(ro, ask)
    assert_anthropic_error(r, 503, "api_error")
    assert r.headers["retry-after"] == "2"
    with pytest.raises(anthropic.APIStatusError) as stream_info:
        list(client.messages.create(**ask, stream=True))
    body: Any = stream_info.value.body
    assert body["error"]["type"] == "overloaded_error"
    gw.engine.down = False

    httpx.post(f"{gw.url}/admin/rollouts/{ro['rollout_id']}/close", json={}, headers=gw.admin_headers)
    with pytest.raises(anthropic.PermissionDeniedError):
        client.messages.create(**ask)
    assert_anthropic_error(post(ro, ask, "/v1/messages/count_tokens"), 403, "permission_error")


def test_probes_and_owned_paths(gw: Any) -> None:
    ro = new_rollout(gw)
    for url in (gw.url + "/api/hello", gw.url + "/", ro["base_url"], ro["base_url"] + "/api/hello"):
        assert httpx.head(url).status_code == 200 and httpx.get(url).status_code == 200
    owns = AnthropicMessages().owns_path
    assert owns("/v1/messages") and owns("/r/ro_1/v1/messages/batches") and owns("/api/hello")
    assert not owns("/v1/chat/completions") and not owns("/v1/messagesx") and not owns("/r/ro_1/v1/models")


def test_error_rendering() -> None:
    dialect = AnthropicMessages()
    r = dialect.error_response(GatewayError(529, "busy", kind="unavailable", retry_after=3))
    assert r.status_code == 529 and r.headers["retry-after"] == "3"
    assert orjson.loads(r.body)["error"] == {"type": "overloaded_error", "message": "busy"}
    r = dialect.error_response(context_length_exceeded(5000, 4096))
    assert orjson.loads(r.body)["error"]["message"] == "prompt is too long: 5000 tokens > 4096 maximum"
    # In a stream the status is already 200: engine trouble is typed as transient, bugs are not.
    down = GatewayError(503, "engine down", kind="unavailable")
    assert sse_events(stream_error(down).decode())[0][1]["error"]["type"] == "overloaded_error"
    bug = GatewayError(500, "engine failed", kind="internal")
    assert sse_events(stream_error(bug).decode()) == [
        ("error", {"type": "error", "error": {"type": "api_error", "message": "engine failed"}})
    ]


@pytest.mark.parametrize("chat_model_dir", CHAT_MODELS, indirect=True)
def test_real_model(chat_model_dir: Path, tmp_path: Path) -> None:
    engine = TransformersEngine(str(chat_model_dir))
    with running_gateway(chat_model_dir, tmp_path, engine, max_tokens=16) as gw:
        ro = new_rollout(gw)
        client = client_for(ro, timeout=120)
        messages: list[Any] = [{"role": "user", "content": "Say hello."}]
        reply = client.messages.create(
            model="claude-opus-5-5", max_tokens=12, system=SYSTEM, messages=messages, tools=[BASH]
        )
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content] or "…"},
            {"role": "user", "content": "Again."},
        ]
        with client.messages.stream(
            model="m", max_tokens=12, system=SYSTEM, messages=messages, tools=[BASH]
        ) as s:
            final = s.get_final_message()
        calls = calls_of(gw, ro["rollout_id"])
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for usage, c in zip([reply.usage, final.usage], calls, strict=True):
        assert usage.output_tokens == len(c["completion_ids"]) == len(c["completion_logprobs"])
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(c["prompt_ids"])
    if reply.content:  # an empty turn cannot be echoed as Anthropic content; then it is a new branch
        assert calls[1]["branch_id"] == calls[0]["branch_id"] and calls[1]["branch_reason"] == ""


# -- fuzzing ---------------------------------------------------------------------------------

json_values = json_values_of()
cache = {"cache_control": st.just({"type": "ephemeral"})}
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}, optional=cache)
odd_block = st.fixed_dictionaries(
    {"type": st.sampled_from(["image", "document", "redacted_thinking", "server_tool_use", "weird", 3])},
    optional={"data": st.text(max_size=5), "source": json_values},
)
tool_use = st.fixed_dictionaries(
    {
        "type": st.just("tool_use"),
        "id": st.text(max_size=8),
        "name": st.sampled_from(["Bash", "Read"]),
        "input": st.dictionaries(st.text(max_size=5), json_values, max_size=3),
    }
)
tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.text(max_size=8)},
    optional={
        "content": st.text(max_size=20) | st.lists(text_block, max_size=2),
        "is_error": st.booleans(),
        **cache,
    },
)
thinking = st.fixed_dictionaries(
    {"type": st.just("thinking"), "thinking": st.text(max_size=20), "signature": st.text(max_size=8)}
)
tool = st.fixed_dictionaries(
    {"name": st.sampled_from(["Bash", "Read"]), "input_schema": st.just({"type": "object"})},
    optional={"description": st.text(max_size=10), "defer_loading": st.booleans(), **cache},
)
# Well-formed bodies: Claude Code-like conversations with every optional field a harness may send.
valid_turns = st.lists(
    st.tuples(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system"]),
                "content": st.text(max_size=40) | st.lists(text_block | tool_result, min_size=1, max_size=3),
            }
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": st.text(max_size=40) | st.lists(text_block | tool_use | thinking, max_size=3),
            }
        ),
    ),
    max_size=2,
).map(lambda pairs: [m for pair in pairs for m in pair] + [{"role": "user", "content": "go"}])
valid = st.fixed_dictionaries(
    {"model": st.text(max_size=20), "messages": valid_turns},
    optional={
        "max_tokens": st.integers(1, 200_000),
        "system": st.text(max_size=20) | st.lists(text_block, max_size=3),
        "stream": st.booleans(),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "Bash"}]),
        "stop_sequences": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "thinking": st.fixed_dictionaries(
            {"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
            optional={
                "display": st.sampled_from(["omitted", "summarized"]),
                "budget_tokens": st.integers(0, 2**31),
            },
        ),
        "output_config": st.fixed_dictionaries({}, optional={"format": st.just({"type": "json_schema"})}),
        "metadata": json_values,
        "context_management": json_values,
        "safeguards": json_values,
        "top_k": st.integers(0, 500),
    },
)
# Near-valid bodies: any field may hold any JSON, any role and block type may appear.
block = text_block | odd_block | tool_use | tool_result | thinking | json_values
near_valid = st.fixed_dictionaries(
    {
        "model": st.text(max_size=20) | json_values,
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system", "tool", 3, None]),
                    "content": st.text(max_size=40) | st.lists(block, max_size=3) | json_values,
                }
            ),
            min_size=1,
            max_size=4,
        )
        | json_values,
    },
    optional={
        "max_tokens": st.integers(-5, 200_000) | json_values,
        "system": st.text(max_size=20) | st.lists(text_block | odd_block, max_size=3) | json_values,
        "stream": st.booleans() | json_values,
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-1, 2),
        "stop_sequences": st.lists(st.text(max_size=5), max_size=3) | json_values,
        "tools": st.lists(
            tool
            | st.fixed_dictionaries(
                {"type": st.sampled_from(["web_search_20250305", "custom"]), "name": st.text()}
            ),
            max_size=2,
        )
        | json_values,
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none", "bogus"])},
            optional={"name": st.text(max_size=5)},
        )
        | json_values,
        "thinking": json_values,
        "output_config": json_values,
    },
)
bodies = (
    valid.map(orjson.dumps)
    | near_valid.map(orjson.dumps)
    | json_values.map(orjson.dumps)
    | st.binary(max_size=200)
)


@pytest.fixture(scope="module")
def fuzz_gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_gateway(
        tiny_model_dir, tmp_path_factory.mktemp("fuzz"), ScriptEngine(tiny_model_dir), max_tokens=8
    ) as g:
        g.rollout = new_rollout(g)  # type: ignore[attr-defined]
        yield g


def check_answer(r: httpx.Response, counting: bool) -> None:
    assert r.status_code in (200, 400, 413, 429), r.text
    if r.status_code != 200:
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] in ERROR_TYPES, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        return
    if counting:
        assert isinstance(r.json()["input_tokens"], int)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text)
        names = [name for name, _ in events]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
        assert all(name == data["type"] for name, data in events)
        starts = [d["index"] for n, d in events if n == "content_block_start"]
        assert starts == list(range(len(starts)))
        return
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant" and isinstance(body["content"], list)
    assert body["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert body["usage"]["output_tokens"] >= 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, counting=st.booleans())
def test_fuzzed_bodies(fuzz_gw: Any, body: bytes, counting: bool) -> None:
    path = "/v1/messages/count_tokens" if counting else "/v1/messages"
    r = post(fuzz_gw.rollout, body, path, headers={"content-type": "application/json"})
    check_answer(r, counting)
