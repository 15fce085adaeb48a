"""The OpenAI Responses dialect through the official SDK: HTTP (JSON and SSE), WebSocket, chaining,
tools (function, namespace, hosted), reasoning, errors, a real tiny model, and fuzzed bodies."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets.sync.client
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.gateway import http as gateway_http
from openforgerl.gateway.dialects.responses import Context, Contexts, ToolSet
from tests.conftest import CHAT_MODELS
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway
from tests.strategies import json_values as json_values_of

EXEC: Any = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    "strict": False,
}
# What Codex sends besides its functions: a namespace of sub-agent functions and web_search.
SPAWN: Any = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}],
}
CODEX_TOOLS: Any = [EXEC, SPAWN, {"type": "web_search"}]
CALL_LS = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>'
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def client_for(rollout: dict[str, Any]) -> OpenAI:
    return OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("responses"), engine, max_tokens=64) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g


@pytest.fixture()
def script(gw: Any) -> Iterator[Any]:
    """Set the completions the scripted engine answers with, in turn (the engine is shared)."""
    engine = gw.engine

    def set_script(*texts: str) -> None:
        replies = iter(texts)
        engine.script = lambda prompt: next(replies)

    yield set_script
    engine.script, engine.down, engine.delay = (lambda prompt: "Hello from the script."), False, 0.0


def assert_one_branch(calls: list[dict[str, Any]]) -> None:
    """Every call extends the previous one: the recorded sequence is exactly what was sampled."""
    assert {c["branch_id"] for c in calls} == {calls[0]["branch_id"]}, [c["branch_reason"] for c in calls]
    for prev, cur in itertools.pairwise(calls):
        sampled = prev["prompt_ids"] + prev["completion_ids"]
        assert cur["prompt_ids"][: len(sampled)] == sampled
        assert cur["parent_call_id"] == prev["call_id"] and cur["branch_reason"] == ""


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events, each checked against the SDK's own event models, in sequence order."""
    # SSE lines end at \n only (str.splitlines would also split at U+0085 inside the JSON).
    events = [orjson.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


_http = httpx.Client(timeout=30)  # one client: creating one per request costs more than the request


def post(rollout: dict[str, Any], body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"authorization": f"Bearer {rollout['api_key']}", "content-type": "application/json"}
    return _http.post(rollout["base_url"] + "/v1/responses", content=content, headers=headers)


def test_codex_function_call_round_trip_streams_and_stays_on_one_branch(gw: Any, script: Any) -> None:
    script(CALL_LS, "Two files.", "Bye.")
    rollout = new_rollout(gw)
    client = client_for(rollout)
    history: list[Any] = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
    ]
    body = {"model": "gpt-5-codex", "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": True}
    extra = {"store": False, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1"}
    extra |= {"reasoning": {"summary": "auto"}, "client_metadata": {"x": "1"}}
    stream = client.responses.create(**body, input=history, stream=True, extra_body=extra)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response  # type: ignore[union-attr]
    [call] = final.output
    assert call.type == "function_call" and call.name == "exec_command"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and final.id.startswith("resp_")
    assert json.loads(call.arguments) == {"cmd": "ls"}
    assert [t.type for t in final.tools] == ["function", "namespace"]  # web_search is not served

    # Codex echoes the item verbatim (id and status included) and adds the tool output.
    history += [call.model_dump(exclude_none=True)]
    history += [{"type": "function_call_output", "id": "fco_1", "call_id": call.call_id, "output": "a b"}]
    with client.responses.stream(**body, input=history, extra_body=extra) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        second = s.get_final_response()
    assert "".join(deltas) == "Two files." and second.output_text == "Two files." and len(deltas) > 1
    history += [o.model_dump(exclude_none=True) for o in second.output]
    history += [{"role": "user", "content": "Thanks."}]
    third = client.responses.create(**body, input=history, extra_body=extra)
    calls = calls_of(gw, rollout["rollout_id"])
    assert len(calls) == 3 and all(c["dialect"] == "openai-responses" for c in calls)
    assert_one_branch(calls)
    assert second.usage is not None and third.usage is not None
    assert second.usage.input_tokens_details.cached_tokens == calls[1]["reused_prompt_tokens"] > 0
    assert third.usage.input_tokens == len(calls[2]["prompt_ids"])
    assert third.usage.output_tokens == len(calls[2]["completion_ids"])
    assert calls[0]["messages_delta"][0] == {"role": "system", "content": "You are Codex."}


def test_previous_response_id_chains_over_http(gw: Any, script: Any) -> None:
    script(CALL_LS, "Done.", "Again.")
    rollout = new_rollout(gw)
    client = client_for(rollout)
    first = client.responses.create(
        model="m", instructions="Be terse.", input="List files.", tools=[EXEC], store=False
    )
    call = first.output[0]
    assert call.type == "function_call"
    # Only the new item: instructions and tools come from the previous response.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}
    second = client.responses.create(model="m", previous_response_id=first.id, input=[output], store=False)
    assert second.output_text == "Done." and second.previous_response_id == first.id
    assert second.instructions == "Be terse." and [t.type for t in second.tools] == ["function"]
    third = client.responses.create(model="m", previous_response_id=second.id, input="More?")
    assert third.output_text == "Again."
    assert_one_branch(calls_of(gw, rollout["rollout_id"]))
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", previous_response_id="resp_unknown", input="x")
    assert info.value.code == "previous_response_not_found" and info.value.param == "previous_response_id"
    # Response ids are scoped to their rollout.
    with pytest.raises(openai.BadRequestError):
        client_for(new_rollout(gw)).responses.create(model="m", previous_response_id=first.id, input="x")


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")  # inside the SDK
def test_previous_response_id_survives_a_restart(
    gw: Any, script: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A restarted gateway rebuilds a response's context from the store: the chained call's prompt is
    the one a gateway that kept running gives, on the same branch (Codex's WebSocket chain too, begun
    from a prewarm); another rollout's id stays unknown."""
    replies = (CALL_LS, "Two files.", "Bye.")
    codex_base = {"model": "gpt-5-codex", "instructions": "", "tools": CODEX_TOOLS, "store": False}
    developer = {
        "type": "message",
        "role": "developer",
        "content": [{"type": "input_text", "text": "Be Codex."}],
    }
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List."}]}
    headers = {"openai-beta": "responses_websockets=2026-02-06"}

    def first_two(client: OpenAI) -> tuple[Response, Response]:
        first = client.responses.create(
            model="m", instructions="Be terse.", input="List files.", tools=CODEX_TOOLS, store=False
        )
        call = first.output[0]
        assert call.type == "function_call"
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt b.txt"}
        second = client.responses.create(model="m", previous_response_id=first.id, input=[output])
        return first, second

    # The reference: the same conversation on a gateway that is not restarted.
    script(*replies)
    kept = client_for(new_rollout(gw))
    _, second = first_two(kept)
    kept.responses.create(model="m", previous_response_id=second.id, input="Thanks.")
    expected = gw.engine.prompts[-1]

    engine = ScriptEngine(tiny_model_dir, lambda prompt: next(answers))
    answers = iter((CALL_LS, "Two files.", CALL_LS))
    with running_gateway(tiny_model_dir, tmp_path, engine, max_tokens=64) as g:
        rollout, other, codex = new_rollout(g), new_rollout(g), new_rollout(g)
        first, second = first_two(client_for(rollout))
        with client_for(codex).responses.connect(extra_headers=headers) as conn:
            conn.response.create(**codex_base, input=[developer], generate=False)
            warm = [conn.recv() for _ in range(3)][-1].response  # type: ignore[union-attr]
            conn.response.create(**codex_base, previous_response_id=warm.id, input=[user])
            listing = list(until_terminal(conn))[-1].response
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path, engine, max_tokens=64) as g:

        def client(ro: dict[str, Any]) -> OpenAI:  # the same key, at the new gateway's address
            return client_for({**ro, "base_url": f"{g.url}/r/{ro['rollout_id']}"})

        engine.script = lambda prompt: "Bye."
        third = client(rollout).responses.create(model="m", previous_response_id=second.id, input="Thanks.")
        assert third.output_text == "Bye." and third.previous_response_id == second.id
        # Instructions and tools (a namespace's functions included) come from the stored context.
        assert third.instructions == "Be terse."
        assert [t.model_dump(exclude_none=True) for t in third.tools] == [
            t.model_dump(exclude_none=True) for t in second.tools
        ]
        assert engine.prompts[-1] == expected
        calls = calls_of(g, rollout["rollout_id"])
        assert_one_branch(calls)
        assert calls[-1]["messages_delta"] == [{"role": "user", "content": "Thanks."}]
        # An older response of the chain is rebuilt too: its function call maps back to its output.
        output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "a.txt b.txt"}  # type: ignore[union-attr]
        again = client(rollout).responses.create(model="m", previous_response_id=first.id, input=[output])
        assert again.output_text == "Bye." and engine.prompts[-1] == calls[1]["prompt_ids"]
        # Response ids stay scoped to their rollout, and an unknown one is still unknown.
        for ro, response_id in ((other, second.id), (rollout, "resp_unknown")):
            with pytest.raises(openai.BadRequestError) as info:
                client(ro).responses.create(model="m", previous_response_id=response_id, input="x")
            assert info.value.code == "previous_response_not_found"
            assert info.value.param == "previous_response_id"
        # Codex reconnects and goes on from its last response with only the new item.
        [call] = listing.output
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "a b"}
        with client(codex).responses.connect(extra_headers=headers) as conn:
            conn.response.create(**codex_base, previous_response_id=listing.id, input=[output])
            done = list(until_terminal(conn))[-1]
        assert done.type == "response.completed" and done.response.output_text == "Bye."
        calls = calls_of(g, codex["rollout_id"])
        assert_one_branch(calls)
        assert calls[0]["messages_delta"][0] == {"role": "system", "content": "Be Codex."}
        assert calls[1]["messages_delta"] == [
            {"role": "tool", "content": "a b", "tool_call_id": call.call_id}
        ]


def test_reasoning_is_a_summary_and_its_echo_extends_the_branch(gw: Any, script: Any) -> None:
    script("<think>\nThe user wants a greeting.\n</think>\n\nHello!", "Bye.")
    rollout = new_rollout(gw)
    r = post(rollout, {"model": "m", "input": "Greet me.", "stream": True})
    events = sse_events(r)
    kinds = [e["type"] for e in events if "reasoning" in e["type"]]
    assert [k for k, _ in itertools.groupby(kinds)] == [
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    assert streamed == "The user wants a greeting."
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == [{"type": "summary_text", "text": "The user wants a greeting."}]
    assert message["id"].startswith("msg_") and message["content"][0]["text"] == "Hello!"
    echoed = [{**reasoning, "encrypted_content": "opaque"}, message]
    client_for(rollout).responses.create(
        model="m",
        input=[{"role": "user", "content": "Greet me."}, *echoed, {"role": "user", "content": "Now go."}],
    )
    calls = calls_of(gw, rollout["rollout_id"])
    assert_one_branch(calls)
    assert calls[0]["response"]["reasoning_content"] == "The user wants a greeting."


def test_namespace_functions_are_flattened_and_mapped_back(gw: Any, script: Any) -> None:
    mcp = {
        "type": "namespace",
        "name": "mcp__files__",
        "description": "File server.",
        "tools": [{"type": "function", "name": "read", "description": "Read a file.", "parameters": {}}],
    }
    call = '<tool_call>\n{"name": "mcp__files__read", "arguments": {"path": "a"}}\n</tool_call>'
    script(call, '<tool_call>\n{"name": "agents__spawn", "arguments": {}}\n</tool_call>', "ok")
    rollout = new_rollout(gw)
    client = client_for(rollout)
    tools = [mcp, SPAWN]
    history: list[Any] = [{"role": "user", "content": "Read a."}]
    first = client.responses.create(model="m", input=history, tools=tools)
    prompt = gw.engine.tokenizer.decode(gw.engine.prompts[-1])
    assert '"name": "mcp__files__read"' in prompt and '"name": "agents__spawn"' in prompt
    assert json.dumps("File server.\n\nRead a file.") in prompt  # the template writes tools as JSON
    [fc] = first.output
    assert fc.type == "function_call" and (fc.namespace, fc.name) == ("mcp__files__", "read")
    history += [
        fc.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": fc.call_id, "output": "A"},
    ]
    second = client.responses.create(model="m", input=history, tools=tools)
    [fc2] = second.output
    assert fc2.type == "function_call" and (fc2.namespace, fc2.name) == ("agents", "spawn")
    history += [
        fc2.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": fc2.call_id, "output": "B"},
    ]
    client.responses.create(model="m", input=history, tools=tools)
    assert_one_branch(calls_of(gw, rollout["rollout_id"]))


def test_hosted_and_custom_tools_are_declined_not_refused(gw: Any, script: Any) -> None:
    rollout = new_rollout(gw)
    hosted = [{"type": t} for t in ("web_search", "file_search", "local_shell", "computer_use_preview")]
    custom = {"type": "custom", "name": "apply_patch", "description": "Patch."}
    reply = client_for(rollout).responses.create(model="m", input="hi", tools=[*hosted, custom, EXEC])
    assert reply.status == "completed" and [t.type for t in reply.tools] == ["function"]
    prompt = gw.engine.tokenizer.decode(gw.engine.prompts[-1])
    assert "exec_command" in prompt and "web_search" not in prompt and "apply_patch" not in prompt


def test_text_format_json_schema_is_recorded(gw: Any, script: Any) -> None:
    script('{"title": "Greeting"}')
    rollout = new_rollout(gw)
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    fmt = {"type": "json_schema", "name": "title", "schema": schema, "strict": True}
    reply = client_for(rollout).responses.create(model="m", input="Title this.", text={"format": fmt})
    assert json.loads(reply.output_text) == {"title": "Greeting"}
    assert (
        reply.text is not None and reply.text.format is not None and reply.text.format.type == "json_schema"
    )
    [call] = calls_of(gw, rollout["rollout_id"])
    assert call["sampling_requested"]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "title", "schema": schema, "strict": True},
    }
    assert call["side_request"]


def test_max_output_tokens_makes_an_incomplete_response(gw: Any, script: Any) -> None:
    script("one two three four five six", "one two three four five six")
    rollout = new_rollout(gw)
    reply = client_for(rollout).responses.create(model="m", input="Count.", max_output_tokens=3)
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 3
    assert reply.output[0].status == "incomplete"  # type: ignore[union-attr]
    events = sse_events(
        post(rollout, {"model": "m", "input": "Count.", "max_output_tokens": 3, "stream": True})
    )
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_errors_in_the_responses_shape_through_the_sdk(gw: Any, script: Any) -> None:
    rollout = new_rollout(gw)
    client = client_for(rollout)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=rollout["base_url"] + "/v1", api_key="wrong", max_retries=0).responses.create(
            model="m", input="x"
        )
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=[{"role": "user", "content": [image]}])
    # A text model refuses the part before decoding it, named by its place (an undecodable image for
    # a vision model: tests/gateway/test_gateway_images.py).
    assert "takes no images" in info.value.message
    assert info.value.param == "input.0.content.0.image_url"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="x", temperature=7)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input=[{"type": "item_reference", "id": "msg_1"}])
    assert info.value.param == "input.0.type"
    # 429 and 503 carry retry-after, as for Chat Completions.
    faults = f"{gw.url}/admin/rollouts/{rollout['rollout_id']}/faults"
    assert httpx.post(faults, json={"errors": [429]}, headers=gw.admin_headers).status_code == 200
    with pytest.raises(openai.RateLimitError) as limited:
        client.responses.create(model="m", input="x")
    assert limited.value.response.headers["retry-after"] == "1"
    assert limited.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    gw.engine.down = True
    with pytest.raises(openai.InternalServerError) as down:
        client.responses.create(model="m", input="x")
    assert down.value.status_code == 503 and down.value.response.headers["retry-after"] == "2"
    # After the stream began, the failure is a response.failed event.
    events = sse_events(post(rollout, {"model": "m", "input": "x", "stream": True}))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["code"] == "server_error"
    assert "try again in 2s" in events[-1]["response"]["error"]["message"]
    gw.engine.down = False
    assert client.responses.create(model="m", input="x").status == "completed"
    r = httpx.get(rollout["base_url"] + "/v1/responses/resp_1", headers={"authorization": "Bearer x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def ws_url(rollout: dict[str, Any]) -> str:
    return rollout["base_url"].replace("http://", "ws://") + "/v1/responses"


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")  # inside the SDK
def test_websocket_prewarm_then_chained_frames(gw: Any, script: Any) -> None:
    script(CALL_LS, "Two files.")
    rollout = new_rollout(gw)
    client = client_for(rollout)
    base = {
        "model": "gpt-5-codex",
        "instructions": "",
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "store": False,
    }
    developer = {
        "type": "message",
        "role": "developer",
        "content": [{"type": "input_text", "text": "Be Codex."}],
    }
    headers = {"openai-beta": "responses_websockets=2026-02-06"}
    with client.responses.connect(extra_headers=headers) as conn:
        # Codex's prewarm: the base context, generate=false; answered without calling the model.
        conn.response.create(**base, input=[developer], generate=False)
        prewarm = [conn.recv() for _ in range(3)]
        assert [e.type for e in prewarm] == ["response.created", "response.in_progress", "response.completed"]
        warm = prewarm[-1].response  # type: ignore[union-attr]
        assert warm.status == "completed" and warm.output == []
        assert calls_of(gw, rollout["rollout_id"]) == []
        conn.send({"type": "response.processed", "response_id": warm.id})  # type: ignore[typeddict-item]
        # Then previous_response_id + only the new items, frame after frame.
        user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List."}]}
        conn.response.create(**base, previous_response_id=warm.id, input=[user])
        first = list(until_terminal(conn))
        assert first[-1].type == "response.completed"
        [call] = first[-1].response.output
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "a b"}
        conn.response.create(**base, previous_response_id=first[-1].response.id, input=[output])
        second = list(until_terminal(conn))
        assert second[-1].response.output_text == "Two files."
        for received in [*prewarm, *first, *second]:
            EVENTS.validate_python(received.to_dict())
        # An unknown previous response is an error frame; the connection goes on.
        conn.response.create(**base, previous_response_id="resp_gone", input=[user])
        error = conn.recv()
        assert error.type == "error" and error.status == 400  # type: ignore[union-attr]
        assert error.error.code == "previous_response_not_found"  # type: ignore[union-attr]
    calls = calls_of(gw, rollout["rollout_id"])
    assert len(calls) == 2
    assert_one_branch(calls)
    assert calls[0]["messages_delta"][0] == {"role": "system", "content": "Be Codex."}


def until_terminal(conn: Any) -> Iterator[Any]:
    for received in conn:
        yield received
        if received.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return


def test_websocket_handshake_needs_the_key(gw: Any) -> None:
    rollout = new_rollout(gw)
    with pytest.raises(websockets.InvalidStatus) as refused:
        websockets.sync.client.connect(ws_url(rollout), open_timeout=10)
    assert refused.value.response.status_code == 401
    assert b"invalid_api_key" in refused.value.response.body
    headers = {"authorization": f"Bearer {rollout['api_key']}"}
    with websockets.sync.client.connect(ws_url(rollout), additional_headers=headers, open_timeout=10) as ws:
        ws.send("not json")
        bad = json.loads(ws.recv(timeout=10))
        assert bad["type"] == "error" and bad["status"] == 400
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "hi", "stream_id": "lane"}))
        events = [json.loads(ws.recv(timeout=10))]
        while events[-1]["type"] != "response.completed":
            events.append(json.loads(ws.recv(timeout=10)))
        assert {e["stream_id"] for e in events} == {"lane"}  # the client's lane, on every event


@pytest.mark.parametrize("chat_model_dir", CHAT_MODELS, indirect=True)
def test_real_model_smoke(chat_model_dir: Path, tmp_path: Path) -> None:
    engine = TransformersEngine(str(chat_model_dir))
    with running_gateway(chat_model_dir, tmp_path, engine, max_tokens=16) as real:
        rollout = new_rollout(real)
        client = client_for(rollout)
        reply = client.responses.create(model="m", instructions="Be brief.", input="Say hello.")
        assert reply.status in ("completed", "incomplete") and reply.usage is not None
        events = list(
            client.responses.create(model="m", previous_response_id=reply.id, input="Hi.", stream=True)
        )
        assert events[-1].type in ("response.completed", "response.incomplete")
        calls = calls_of(real, rollout["rollout_id"])
        assert reply.usage.output_tokens == len(calls[0]["completion_ids"])
        assert reply.usage.input_tokens == len(calls[0]["prompt_ids"])
        usage = events[-1].response.usage  # type: ignore[union-attr]
        assert (
            len(calls) == 2 and usage is not None and usage.output_tokens == len(calls[1]["completion_ids"])
        )
        assert_one_branch(calls)


json_values = json_values_of()
texts = st.text(max_size=20)
names = st.text(min_size=1, max_size=8)
text_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": texts}), max_size=2
)
odd_parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_image", "refusal", "input_file", "weird"]), "text": texts}
    ),
    min_size=1,
    max_size=2,
)
# Items and tools as harnesses send them (each field well typed), and mangled ones.
good_items = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer"]),
            "content": texts | text_parts,
        },
        optional={"type": st.just("message"), "id": texts, "status": st.just("completed")},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": texts, "name": names},
        optional={"arguments": texts | st.just('{"cmd": "ls"}'), "namespace": texts, "id": texts},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": texts, "output": texts | text_parts}
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning")},
        optional={
            "summary": st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": texts})),
            "encrypted_content": texts | st.none(),
        },
    ),
)
odd_items = st.one_of(
    st.fixed_dictionaries({"role": json_values, "content": odd_parts | json_values}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "item_reference"])},
        optional={k: json_values for k in ("call_id", "name", "arguments", "output", "summary")},
    ),
    json_values,
)
good_tools = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("function"), "name": names},
        optional={"description": texts, "parameters": st.just({"type": "object"}), "strict": st.booleans()},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("namespace"),
            "name": names,
            "tools": st.lists(
                st.fixed_dictionaries({"type": st.just("function"), "name": names}), max_size=2
            ),
        },
        optional={"description": texts},
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "custom", "mystery"])}),
)
odd_tools = json_values | st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "namespace"])},
    optional={k: json_values for k in ("name", "tools", "parameters")},
)
formats = st.sampled_from(
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "name": "x", "schema": {"type": "object"}},
    ]
)
well_typed = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.text(max_size=30) | st.lists(good_items, min_size=1, max_size=5)},
    optional={
        "instructions": texts,
        "tools": st.lists(good_tools, max_size=3),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "stream": st.booleans(),
        "generate": st.booleans(),
        "max_output_tokens": st.integers(1, 20),
        "temperature": st.floats(0, 2),
        "text": st.fixed_dictionaries({"format": formats}),
        "store": st.booleans(),
    },
)
mangled = st.fixed_dictionaries(
    {
        "model": st.just("m") | json_values,
        "input": st.lists(good_items | odd_items, max_size=4) | json_values,
    },
    optional={
        "instructions": texts | json_values,
        "tools": st.lists(good_tools | odd_tools, max_size=3),
        "tool_choice": st.fixed_dictionaries({"type": st.just("function")}, optional={"name": json_values})
        | json_values,
        "stream": st.booleans() | json_values,
        "max_output_tokens": st.integers(-3, 50_000) | json_values,
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-1, 2),
        "text": st.fixed_dictionaries(
            {"format": st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "yaml"])})}
        )
        | json_values,
        "metadata": st.dictionaries(texts, texts | json_values, max_size=2),
        "previous_response_id": texts | json_values,
        "reasoning": json_values,
    },
)
bodies = st.one_of(
    well_typed.map(orjson.dumps), mangled.map(orjson.dumps), json_values.map(orjson.dumps), st.binary()
)


@pytest.fixture(scope="module")
def fuzz_rollout(gw: Any) -> dict[str, Any]:
    return new_rollout(gw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_fuzzed_bodies_get_a_valid_response_or_a_well_formed_error(
    gw: Any, fuzz_rollout: dict[str, Any], body: bytes
) -> None:
    r = post(fuzz_rollout, body)
    event(f"status {r.status_code}")  # shown by --hypothesis-show-statistics
    assert r.status_code in (200, 400), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        Response.model_validate(events[-1]["response"])
    else:
        assert Response.model_validate(r.json()).object == "response"


def test_websocket_keepalive_then_disconnect_aborts_the_generation(
    gw: Any, script: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_http, "KEEPALIVE_S", 0.1)  # the keep-alive pace of every stream
    gw.engine.delay = 30.0
    rollout = new_rollout(gw)
    headers = {"authorization": f"Bearer {rollout['api_key']}"}
    cancelled = gw.engine.cancelled
    with websockets.sync.client.connect(ws_url(rollout), additional_headers=headers, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "m", "input": "hi"}))
        kinds = [json.loads(ws.recv(timeout=10))["type"] for _ in range(4)]
        assert kinds == ["response.created", *["response.in_progress"] * 3]  # keep-alives while generating
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and gw.engine.cancelled == cancelled:
        time.sleep(0.05)
    assert gw.engine.cancelled == cancelled + 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not calls_of(gw, rollout["rollout_id"]):
        time.sleep(0.05)
    [call] = calls_of(gw, rollout["rollout_id"])
    assert call["status"] == "aborted"


def test_remembered_contexts_are_bounded_per_rollout_and_overall() -> None:
    contexts = Contexts(per_rollout=2, rollouts=2)
    context = Context(None, (), ToolSet())
    for rollout, response in [("a", "1"), ("a", "2"), ("b", "1"), ("a", "3")]:
        contexts.put(rollout, response, context)
    assert contexts.get("a", "1") is None and contexts.get("a", "3") is context
    assert contexts.get("b", "1") is context  # now the most recently used rollout
    contexts.put("c", "1", context)
    assert contexts.get("a", "2") is None and contexts.get("c", "1") is context
