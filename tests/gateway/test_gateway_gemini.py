"""The Gemini dialect through the official google-genai SDK and Gemini CLI-shaped requests."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.gateway import http
from openforgerl.gateway.dialects.gemini import DECLINED_TOOLS_HEADER, Gemini, parse_request
from tests.conftest import CHAT_MODELS
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway
from tests.strategies import json_values as json_values_of

CLI_MODEL = "gemini-3.1-pro-preview"
ROUTER_MODEL = "gemini-3.5-flash-lite"
SHELL_TOOL: dict[str, Any] = {
    "name": "run_shell_command",
    "description": "Runs a shell command.",
    "parametersJsonSchema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
    },
}
TOOL_CALL = '<tool_call>\n{"name": "run_shell_command", "arguments": {"command": "ls"}}\n</tool_call>'
GOOGLE_STATUSES = {
    "INVALID_ARGUMENT",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "NOT_FOUND",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "INTERNAL",
}


def client_for(rollout: dict[str, Any]) -> genai.Client:
    return genai.Client(
        api_key=rollout["api_key"], http_options=types.HttpOptions(base_url=rollout["base_url"])
    )


def cli_headers(rollout: dict[str, Any], model: str = CLI_MODEL) -> dict[str, str]:
    """What Gemini CLI 0.61 sends with every model call."""
    return {
        "x-goog-api-key": rollout["api_key"],
        "x-goog-api-client": "gl-node/20.20.2",
        "user-agent": f"GeminiCLI-tui/0.61.0/{model} (linux; x64; terminal)",
        "content-type": "application/json",
    }


def cli_body(contents: list[Any]) -> dict[str, Any]:
    return {
        "contents": contents,
        "systemInstruction": {"role": "user", "parts": [{"text": "You are an interactive CLI agent."}]},
        "tools": [{"functionDeclarations": [SHELL_TOOL]}],
        "generationConfig": {
            "temperature": 1,
            "topP": 0.95,
            "topK": 64,
            "thinkingConfig": {"includeThoughts": True, "thinkingLevel": "HIGH"},
        },
    }


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]


def sdk_parts(chunk: types.GenerateContentResponse) -> list[types.Part]:
    """A streamed chunk's parts: every chunk has some, but the last, which may carry only the finish
    reason and usage (a streamed answer's last piece is sent before the gateway knows it is last)."""
    assert chunk.candidates and chunk.candidates[0].content
    parts = chunk.candidates[0].content.parts or []
    assert parts or chunk.candidates[0].finish_reason is not None
    return parts


def merged(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed parts as a client consolidates them: consecutive text parts of a kind (thought or
    not) joined; each chunk of a stream carries the text sampled since the last."""
    out: list[dict[str, Any]] = []
    for p in parts:
        if out and set(p) <= {"text", "thought"} and set(out[-1]) <= {"text", "thought"}:
            if p.get("thought") == out[-1].get("thought"):
                out[-1] = {**out[-1], "text": out[-1]["text"] + p["text"]}
                continue
        out.append(dict(p))
    return out


def parts_of(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return merged([p for c in chunks for p in c["candidates"][0]["content"]["parts"]])


def sdk_texts(chunks: list[types.GenerateContentResponse]) -> list[tuple[str | None, bool | None]]:
    parts = [p.model_dump(exclude_none=True) for c in chunks for p in sdk_parts(c)]
    return [(p.get("text"), p.get("thought")) for p in merged(parts)]


def assert_one_branch(calls: list[dict[str, Any]]) -> None:
    assert len({c["branch_id"] for c in calls}) == 1
    for prev, cur in itertools.pairwise(calls):
        sampled = prev["prompt_ids"] + prev["completion_ids"]
        assert cur["prompt_ids"][: len(sampled)] == sampled
        assert cur["parent_call_id"] == prev["call_id"] and cur["branch_reason"] == ""
        assert cur["reused_prompt_tokens"] == len(sampled)


def assert_google_error(r: httpx.Response, status: int, google_status: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == status and err["status"] == google_status
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["details"], list)
    return err


class Script:
    """The engine's answers, in order; the last one repeats."""

    def __init__(self, *texts: str) -> None:
        self.texts = list(texts)

    def __call__(self, prompt: list[int]) -> str:
        return self.texts.pop(0) if len(self.texts) > 1 else self.texts[0]


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("gemini"), engine) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(
        tiny_model_dir,
        tmp_path_factory.mktemp("gemini-small"),
        engine,
        max_context=256,
        max_body=20_000,
        max_inflight=4,
    ) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g


def test_generate_content_with_the_sdk(gw: Any) -> None:
    gw.engine.script = Script("Hello from the script.")
    rollout = new_rollout(gw)
    # Keep the client referenced: a collected genai.Client closes its HTTP client under the call.
    client = client_for(rollout)
    reply = client.models.generate_content(
        model=CLI_MODEL,
        contents="Say hello.",
        config=types.GenerateContentConfig(
            system_instruction="Be brief.", temperature=0.5, max_output_tokens=50
        ),
    )
    assert reply.text == "Hello from the script."
    assert reply.model_version == CLI_MODEL
    assert reply.candidates and reply.candidates[0].finish_reason == types.FinishReason.STOP
    [call] = calls_of(gw, rollout["rollout_id"])
    assert call["model"] == CLI_MODEL and call["dialect"] == "gemini"
    assert call["messages_delta"][0] == {"role": "system", "content": "Be brief."}
    assert call["sampling_requested"]["temperature"] == 0.5 and call["sampling_requested"]["max_tokens"] == 50
    usage = reply.usage_metadata
    assert usage is not None
    assert usage.prompt_token_count == len(call["prompt_ids"])
    assert usage.candidates_token_count == len(call["completion_ids"])
    assert usage.total_token_count == len(call["prompt_ids"]) + len(call["completion_ids"])
    assert usage.cached_content_token_count == 0


def test_stream_with_alt_sse_and_as_a_json_array(gw: Any) -> None:
    gw.engine.script = Script("<think>\nshort plan\n</think>\n\nThe answer.")
    rollout = new_rollout(gw)
    client = client_for(rollout)
    config = types.GenerateContentConfig(thinking_config=types.ThinkingConfig(include_thoughts=True))
    chunks = list(client.models.generate_content_stream(model="m.x-1", contents="Q", config=config))
    assert len(chunks) > 3  # the thought and the answer stream in pieces
    assert sdk_texts(chunks) == [
        ("short plan", True),
        ("The answer.", None),
    ]
    reasons = [c.candidates[0].finish_reason for c in chunks if c.candidates]
    assert reasons[-1] == types.FinishReason.STOP and set(reasons[:-1]) == {None}
    assert chunks[-1].usage_metadata is not None and chunks[0].usage_metadata is None

    # Without alt=sse the API answers one JSON array of the same responses; no thoughts unasked.
    url = f"{rollout['base_url']}/v1beta/models/m.x-1:streamGenerateContent"
    r = httpx.post(
        url, json={"contents": [{"role": "user", "parts": [{"text": "Q"}]}]}, headers=cli_headers(rollout)
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    array = r.json()
    assert [p["text"] for p in parts_of(array)] == ["The answer."]
    assert array[-1]["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in array[-1]
    calls = calls_of(gw, rollout["rollout_id"])
    assert [c["model"] for c in calls] == ["m.x-1", "m.x-1"]
    assert array[-1]["usageMetadata"]["candidatesTokenCount"] == len(calls[1]["completion_ids"])


def test_keepalives_while_generating_do_not_break_the_python_sdk(gw: Any, monkeypatch: Any) -> None:
    # The SDK parses every line that is not `data:` as JSON: an SSE comment would break it.
    monkeypatch.setattr(http, "KEEPALIVE_S", 0.05)
    gw.engine.script = Script("Slow answer.")
    gw.engine.delay = 0.4
    rollout = new_rollout(gw)
    client = client_for(rollout)
    try:
        chunks = list(client.models.generate_content_stream(model=CLI_MODEL, contents="Q"))
        url = f"{rollout['base_url']}/v1beta/models/{CLI_MODEL}:streamGenerateContent?alt=sse"
        r = httpx.post(url, json=cli_body([{"parts": [{"text": "Q"}]}]), headers=cli_headers(rollout))
    finally:
        gw.engine.delay = 0.0
    assert [text for text, _ in sdk_texts(chunks)] == ["Slow answer."]
    assert r.text.startswith("\r\n\r\n") and not any(line.startswith(":") for line in r.text.splitlines())
    assert parts_of(sse_events(r)) == [{"text": "Slow answer."}]


def test_count_tokens_equals_the_next_calls_prompt(gw: Any) -> None:
    gw.engine.script = Script("Hi.", TOOL_CALL, "Done.")
    rollout = new_rollout(gw)
    client = client_for(rollout)
    counted = client.models.count_tokens(model=CLI_MODEL, contents="Hi there").total_tokens
    client.models.generate_content(model=CLI_MODEL, contents="Hi there")
    contents: list[Any] = [{"role": "user", "parts": [{"text": "List the files."}]}]
    count_url = f"{rollout['base_url']}/v1beta/models/{CLI_MODEL}:countTokens"
    gen_url = f"{rollout['base_url']}/v1beta/models/{CLI_MODEL}:streamGenerateContent?alt=sse"
    totals = [counted]
    for turn in range(2):
        r = httpx.post(
            count_url, json={"generateContentRequest": cli_body(contents)}, headers=cli_headers(rollout)
        )
        assert r.status_code == 200, r.text
        totals.append(r.json()["totalTokens"])
        events = sse_events(httpx.post(gen_url, json=cli_body(contents), headers=cli_headers(rollout)))
        if turn == 0:
            response = {"name": "run_shell_command", "response": {"output": "a.txt"}}
            contents += [
                {"role": "model", "parts": parts_of(events)},
                {"role": "user", "parts": [{"functionResponse": response}]},
            ]
    calls = calls_of(gw, rollout["rollout_id"])
    # countTokens plans with the token memory too: the last count includes the sampled ids exactly.
    assert totals == [len(c["prompt_ids"]) for c in calls]
    assert calls[2]["reused_prompt_tokens"] > 0
    assert_one_branch(calls[1:])


def test_gemini_cli_function_call_round_trip_is_one_branch(gw: Any) -> None:
    gw.engine.script = Script(
        "<think>\nlook first\n</think>\n\nLet me look.\n" + TOOL_CALL,
        TOOL_CALL.replace('"ls"', '"cat a.txt", "description": "read"'),
        "It says hi.",
    )
    rollout = new_rollout(gw)
    url = f"{rollout['base_url']}/v1beta/models/{CLI_MODEL}:streamGenerateContent?alt=sse"
    contents: list[Any] = [{"role": "user", "parts": [{"text": "What is in a.txt?"}]}]
    for turn in range(3):
        events = sse_events(httpx.post(url, json=cli_body(contents), headers=cli_headers(rollout)))
        parts = parts_of(events)
        assert events[-1]["candidates"][0]["finishReason"] == "STOP"
        assert all(e["modelVersion"] == CLI_MODEL for e in events)
        if turn == 2:
            assert parts == [{"text": "It says hi."}]
            break
        calls = [p["functionCall"] for p in parts if "functionCall" in p]
        assert len(calls) == 1 and calls[0]["name"] == "run_shell_command"
        if turn == 0:
            assert parts[:2] == [{"text": "look first", "thought": True}, {"text": "Let me look."}]
        # Gemini CLI keeps the non-thought parts, gives the call its own id and the skip signature.
        echoed = [
            {
                "functionCall": {**p["functionCall"], "id": f"run_shell_command-17{turn}-abc"},
                "thoughtSignature": "skip_thought_signature_validator",
            }
            if "functionCall" in p
            else p
            for p in parts
            if not p.get("thought")
        ]
        contents += [
            {"role": "model", "parts": echoed},
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "id": f"run_shell_command-17{turn}-abc",
                            "name": "run_shell_command",
                            "response": {"output": "<untrusted_context>\nOutput: hi\n</untrusted_context>"},
                        }
                    }
                ],
            },
        ]
    records = calls_of(gw, rollout["rollout_id"])
    assert len(records) == 3
    assert_one_branch(records)
    assert (
        records[1]["messages_delta"][-1]["content"] == "<untrusted_context>\nOutput: hi\n</untrusted_context>"
    )
    assert records[0]["response"]["reasoning_content"] == "look first"


def test_echo_ids_and_thought_signatures_do_not_change_the_message() -> None:
    def body(echo_ids: bool) -> bytes:
        ids = {"id": "f-123"} if echo_ids else {}
        signature = {"thoughtSignature": "skip_thought_signature_validator"} if echo_ids else {}
        contents = [
            {"role": "user", "parts": [{"text": "go"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "ok"},
                    {"functionCall": {"name": "f", "args": {"a": 1}, **ids}, **signature},
                ],
            },
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "f", "response": {"output": "x"}, **ids}}],
            },
        ]
        return json.dumps({"contents": contents}).encode()

    plain = parse_request(body(echo_ids=False), "m", True).conv.messages
    assert parse_request(body(echo_ids=True), "m", True).conv.messages == plain
    assert [m.role for m in plain] == ["user", "assistant", "tool"] and plain[2].content == "x"


def test_owns_its_paths_only() -> None:
    dialect = Gemini()
    for path in (
        "/v1beta/models/m:generateContent",
        "/r/ro_1/v1beta/anything",
        "/v1/models/a.b-c:countTokens",
        "/r/ro_1/v1beta",  # what a client makes of .../v1beta/models/.. : a 404 in Gemini's shape
    ):
        assert dialect.owns_path(path)
    for path in ("/v1/models", "/v1/chat/completions", "/v1/messages", "/r/ro_1/v1/responses", "/v1betax"):
        assert not dialect.owns_path(path)


def test_sdk_tools_with_openapi_schema_and_declined_tools(gw: Any, tiny_model_dir: Path) -> None:
    gw.engine.script = Script(TOOL_CALL)
    rollout = new_rollout(gw)
    declaration = types.FunctionDeclaration(
        name="run_shell_command",
        description="Runs a shell command.",
        parameters=types.Schema(
            type=types.Type.OBJECT, properties={"command": types.Schema(type=types.Type.STRING)}
        ),
    )
    config = types.GenerateContentConfig(
        tools=[
            types.Tool(function_declarations=[declaration]),
            types.Tool(google_search=types.GoogleSearch()),
            types.Tool(code_execution=types.ToolCodeExecution()),
        ],
        tool_config=types.ToolConfig(
            function_calling_config=types.FunctionCallingConfig(mode=types.FunctionCallingConfigMode.ANY)
        ),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    client = client_for(rollout)
    reply = client.models.generate_content(model=CLI_MODEL, contents="ls please", config=config)
    [call] = reply.function_calls or []
    assert call.name == "run_shell_command" and call.args == {"command": "ls"} and call.id
    assert reply.sdk_http_response and reply.sdk_http_response.headers
    assert reply.sdk_http_response.headers[DECLINED_TOOLS_HEADER] == "googleSearch, codeExecution"
    [record] = calls_of(gw, rollout["rollout_id"])
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir).decode(record["prompt_ids"])
    # Gemini's upper-case schema types reach the chat template as JSON Schema.
    assert '"type": "object"' in prompt and '"type": "string"' in prompt and "OBJECT" not in prompt
    assert prompt.count('"name": "run_shell_command"') == 1
    assert record["sampling_requested"]["tool_choice"] == "required"


def test_router_side_request_is_recorded_beside_the_conversation(gw: Any) -> None:
    route = '{"reasoning": "simple", "model_choice": "flash"}'
    gw.engine.script = Script(route, TOOL_CALL, "Two files.", route, "Bye.")
    rollout = new_rollout(gw)
    base = rollout["base_url"] + "/v1beta/models"

    def router(history: list[Any]) -> None:
        body = {
            "contents": history,
            "systemInstruction": {"role": "user", "parts": [{"text": "You are a routing classifier."}]},
            "generationConfig": {
                "responseMimeType": "application/json",
                "responseJsonSchema": {"type": "object", "properties": {"model_choice": {"type": "string"}}},
                "thinkingConfig": {"thinkingBudget": 512},
            },
        }
        r = httpx.post(
            f"{base}/{ROUTER_MODEL}:generateContent", json=body, headers=cli_headers(rollout, ROUTER_MODEL)
        )
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["candidates"][0]["content"]["parts"][0]["text"])["model_choice"] == "flash"

    def main(contents: list[Any]) -> list[dict[str, Any]]:
        url = f"{base}/{CLI_MODEL}:streamGenerateContent?alt=sse"
        return parts_of(sse_events(httpx.post(url, json=cli_body(contents), headers=cli_headers(rollout))))

    contents: list[Any] = [{"role": "user", "parts": [{"text": "How many files?"}]}]
    router(contents)
    parts = main(contents)
    contents += [
        {"role": "model", "parts": parts},
        {
            "role": "user",
            "parts": [{"functionResponse": {"name": "run_shell_command", "response": {"output": "a b"}}}],
        },
    ]
    contents += [{"role": "model", "parts": main(contents)}, {"role": "user", "parts": [{"text": "Thanks."}]}]
    router(contents)
    assert main(contents) == [{"text": "Bye."}]
    calls = calls_of(gw, rollout["rollout_id"])
    assert [c["model"] for c in calls] == [ROUTER_MODEL, CLI_MODEL, CLI_MODEL, ROUTER_MODEL, CLI_MODEL]
    routers = [calls[0], calls[3]]
    for c in routers:
        assert c["status"] == "ok" and c["sampling_requested"]["response_format"]["type"] == "json_schema"
        assert c["side_request"]
    assert_one_branch([calls[1], calls[2], calls[4]])


def test_v1_paths_key_in_query_and_models(gw: Any) -> None:
    gw.engine.script = Script("Hi.")
    rollout = new_rollout(gw)
    body = {"contents": [{"parts": [{"text": "x"}]}]}
    r = httpx.post(
        f"{rollout['base_url']}/v1/models/gemini-2.5-pro:generateContent?key={rollout['api_key']}", json=body
    )
    assert r.status_code == 200 and r.json()["candidates"][0]["content"]["parts"] == [{"text": "Hi."}]
    # Without the rollout prefix the key alone finds the rollout.
    r = httpx.post(f"{gw.url}/v1beta/models/x:generateContent", json=body, headers=cli_headers(rollout))
    assert r.status_code == 200
    r = httpx.get(f"{rollout['base_url']}/v1beta/models", headers=cli_headers(rollout))
    assert r.status_code == 200 and r.json()["models"][0]["inputTokenLimit"] == gw.gateway.core.max_context
    # The Python SDK speaks /v1 by default; GET /v1/models/... belongs to the OpenAI dialect.
    beta = types.HttpOptions(base_url=rollout["base_url"], api_version="v1beta")
    client = genai.Client(api_key=rollout["api_key"], http_options=beta)
    model = client.models.get(model="gemini-9")
    assert model.name == "models/gemini-9" and "generateContent" in (model.supported_actions or [])
    assert len(calls_of(gw, rollout["rollout_id"])) == 2


def test_errors_in_googles_shape(small: Any) -> None:
    rollout = new_rollout(small)
    url = f"{rollout['base_url']}/v1beta/models/{CLI_MODEL}:generateContent"
    ok = {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}
    headers = cli_headers(rollout)
    client = client_for(rollout)

    assert_google_error(httpx.post(url, json=ok), 401, "UNAUTHENTICATED")
    assert_google_error(httpx.post(url + "?key=wrong", json=ok), 401, "UNAUTHENTICATED")
    wrong = genai.Client(api_key="wrong", http_options=types.HttpOptions(base_url=rollout["base_url"]))
    with pytest.raises(genai_errors.ClientError) as info:
        wrong.models.generate_content(model=CLI_MODEL, contents="x")
    assert info.value.code == 401 and info.value.status == "UNAUTHENTICATED"

    long = {"contents": [{"role": "user", "parts": [{"text": "word " * 400}]}]}
    err = assert_google_error(httpx.post(url, json=long, headers=headers), 400, "INVALID_ARGUMENT")
    prompt_tokens = int(err["message"].split("(")[1].split(")")[0])
    assert err["message"] == (
        f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens allowed (256)."
    )
    with pytest.raises(genai_errors.ClientError) as info:
        client.models.generate_content(model=CLI_MODEL, contents="word " * 400)
    assert info.value.code == 400 and "exceeds the maximum number of tokens allowed (256)" in (
        info.value.message or ""
    )

    image = {
        "contents": [
            {"parts": [{"text": "what is this?"}, {"inlineData": {"mimeType": "image/png", "data": "AAAA"}}]}
        ]
    }
    # This model reads no images: the part is refused before it is decoded, named by its place (an
    # undecodable image for a vision model: tests/gateway/test_gateway_images.py).
    err = assert_google_error(httpx.post(url, json=image, headers=headers), 400, "INVALID_ARGUMENT")
    assert "takes no images" in err["message"]
    assert err["details"][0]["fieldViolations"][0]["field"] == "contents.0.parts.1.inlineData.data"
    bad = [
        b"{not json",
        b"[1, 2]",
        b"{}",
        json.dumps({**ok, "generationConfig": {"candidateCount": 2}}).encode(),
        json.dumps({**ok, "generationConfig": {"temperature": 7}}).encode(),
        json.dumps({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}).encode(),
        json.dumps({"contents": [{"role": "user", "parts": []}]}).encode(),
        json.dumps({"contents": [{"parts": [{"text": "x" * 30_000}]}]}).encode(),  # over max_body
    ]
    for body in bad:
        assert_google_error(httpx.post(url, content=body, headers=headers), 400, "INVALID_ARGUMENT")
    assert_google_error(
        httpx.post(url.replace(":generateContent", ":embedContent"), json=ok, headers=headers),
        404,
        "NOT_FOUND",
    )
    assert_google_error(httpx.get(url, headers=headers), 404, "NOT_FOUND")
    assert_google_error(httpx.put(url, json=ok, headers=headers), 404, "NOT_FOUND")

    small.engine.down = True
    try:
        r = httpx.post(url, json=ok, headers=headers)
        err = assert_google_error(r, 503, "UNAVAILABLE")
        assert r.headers["retry-after"] == "2"
        assert {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "2s"} in err["details"]
        # After the stream began, the error still reaches the SDK with its code.
        with pytest.raises(genai_errors.ServerError) as server_info:
            list(client.models.generate_content_stream(model=CLI_MODEL, contents="x"))
        assert server_info.value.code == 503 and server_info.value.status == "UNAVAILABLE"
    finally:
        small.engine.down = False
    assert httpx.post(url, json=ok, headers=headers).status_code == 200

    # Faults queued through the admin API (harness retry tests) come back in Google's shape too.
    admin = f"{small.url}/admin/rollouts/{rollout['rollout_id']}"
    assert httpx.post(admin + "/faults", json={"errors": [429, 500]}, headers=small.admin_headers).is_success
    err = assert_google_error(httpx.post(url, json=ok, headers=headers), 429, "RESOURCE_EXHAUSTED")
    assert err["details"] == [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"}]
    assert_google_error(httpx.post(url, json=ok, headers=headers), 500, "INTERNAL")
    assert httpx.post(url, json=ok, headers=headers).status_code == 200

    r = httpx.post(admin + "/close", json={}, headers=small.admin_headers)
    assert r.status_code == 200
    assert_google_error(httpx.post(url, json=ok, headers=headers), 403, "PERMISSION_DENIED")


def test_overload_is_429_resource_exhausted_with_retry_info(small: Any) -> None:
    small.engine.delay = 1.0
    rollouts = [new_rollout(small) for _ in range(8)]
    body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(
                *[
                    client.post(
                        f"{ro['base_url']}/v1beta/models/m:generateContent",
                        json=body,
                        headers=cli_headers(ro),
                    )
                    for ro in rollouts
                ]
            )

    try:
        responses = asyncio.run(burst())
    finally:
        small.engine.delay = 0.0
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 4 and 429 in codes
    for r in responses:
        if r.status_code == 429:
            err = assert_google_error(r, 429, "RESOURCE_EXHAUSTED")
            assert int(r.headers["retry-after"]) >= 1
            assert err["details"] == [
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"}
            ]


@pytest.mark.parametrize("chat_model_dir", CHAT_MODELS, indirect=True)
def test_real_model_through_the_sdk(chat_model_dir: Path, tmp_path: Path) -> None:
    engine = TransformersEngine(str(chat_model_dir))
    with running_gateway(chat_model_dir, tmp_path, engine, max_tokens=16) as real:
        rollout = new_rollout(real)
        client = client_for(rollout)
        reply = client.models.generate_content(model=CLI_MODEL, contents="Say hello.")
        chunks = list(client.models.generate_content_stream(model=CLI_MODEL, contents="Count to three."))
        calls = calls_of(real, rollout["rollout_id"])
    assert [c["status"] for c in calls] == ["ok", "ok"]
    assert reply.usage_metadata and reply.usage_metadata.candidates_token_count == len(
        calls[0]["completion_ids"]
    )
    assert reply.usage_metadata.prompt_token_count == len(calls[0]["prompt_ids"])
    final = chunks[-1]
    assert final.usage_metadata and final.usage_metadata.candidates_token_count == len(
        calls[1]["completion_ids"]
    )
    assert final.candidates and final.candidates[0].finish_reason in (
        types.FinishReason.STOP,
        types.FinishReason.MAX_TOKENS,
    )
    assert len(calls[0]["completion_logprobs"]) == len(calls[0]["completion_ids"]) > 0


# -- property-based fuzzing ------------------------------------------------------------------

json_values = json_values_of(2**70)
part = st.fixed_dictionaries(
    {},
    optional={
        "text": st.text(max_size=30) | json_values,
        "thought": st.booleans() | json_values,
        "thoughtSignature": st.text(max_size=10),
        "functionCall": st.fixed_dictionaries(
            {"name": st.text(max_size=10) | json_values},
            optional={"args": json_values, "id": st.text(max_size=8)},
        ),
        "functionResponse": st.fixed_dictionaries(
            {}, optional={"name": st.text(max_size=10), "id": st.text(max_size=8), "response": json_values}
        ),
        "inlineData": json_values,
    },
)
content = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "model", "function", "system"]) | json_values,
        "parts": st.lists(part, max_size=3) | json_values,
    },
)
generation_config = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(-1, 3) | json_values,
        "topP": st.floats(-1, 2),
        "topK": json_values,
        "maxOutputTokens": st.integers(-5, 100_000) | json_values,
        "stopSequences": st.lists(st.text(max_size=5), max_size=3) | json_values,
        "candidateCount": st.integers(-1, 3),
        "responseMimeType": st.sampled_from(["application/json", "text/plain"]) | json_values,
        "responseSchema": json_values,
        "responseJsonSchema": json_values,
        "thinkingConfig": st.fixed_dictionaries({}, optional={"includeThoughts": json_values}) | json_values,
        "seed": st.integers(-(2**40), 2**40),
    },
)
declaration = st.fixed_dictionaries(
    {"name": st.text(max_size=8) | json_values},
    optional={"description": json_values, "parameters": json_values, "parametersJsonSchema": json_values},
)
tool = st.fixed_dictionaries(
    {},
    optional={
        "functionDeclarations": st.lists(declaration, max_size=2) | json_values,
        "googleSearch": json_values,
        "codeExecution": json_values,
    },
)
near_valid = st.fixed_dictionaries(
    {"contents": st.lists(content, min_size=1, max_size=4) | json_values},
    optional={
        "systemInstruction": content | st.text(max_size=20) | json_values,
        "tools": st.lists(tool, max_size=2) | json_values,
        "toolConfig": st.fixed_dictionaries({"functionCallingConfig": json_values}) | json_values,
        "generationConfig": generation_config | json_values,
        "safetySettings": json_values,
        "cachedContent": json_values,
    },
)
# Well-typed requests, so that many pass validation and reach the engine and the token memory.
objects = st.dictionaries(st.text(max_size=8), json_values, max_size=3)
text_part = st.fixed_dictionaries({"text": st.text(max_size=30)}, optional={"thought": st.booleans()})
call_part = st.fixed_dictionaries(
    {"functionCall": st.fixed_dictionaries({"name": st.text(min_size=1, max_size=10), "args": objects})},
    optional={"thoughtSignature": st.text(max_size=10)},
)
response_part = st.fixed_dictionaries(
    {"functionResponse": st.fixed_dictionaries({"name": st.text(max_size=10), "response": objects})}
)
typed_content = st.fixed_dictionaries(
    {"role": st.just("user"), "parts": st.lists(text_part | response_part, min_size=1, max_size=3)}
) | st.fixed_dictionaries(
    {"role": st.just("model"), "parts": st.lists(text_part | call_part, min_size=1, max_size=3)}
)
declarations = st.lists(
    st.fixed_dictionaries(
        {"name": st.text(min_size=1, max_size=8)},
        optional={"parameters": objects, "parametersJsonSchema": objects},
    ),
    max_size=2,
)
well_typed = st.fixed_dictionaries(
    {"contents": st.lists(typed_content, min_size=1, max_size=4)},
    optional={
        "systemInstruction": st.text(max_size=20),
        "tools": st.lists(
            st.fixed_dictionaries({"functionDeclarations": declarations}, optional={"googleSearch": objects}),
            max_size=2,
        ),
        "generationConfig": st.fixed_dictionaries(
            {},
            optional={
                "temperature": st.floats(0, 2),
                "topP": st.floats(0.01, 1),
                "maxOutputTokens": st.integers(1, 64),
                "stopSequences": st.lists(st.text(min_size=1, max_size=5), max_size=2),
                "responseMimeType": st.just("application/json"),
                "responseJsonSchema": objects,
                "thinkingConfig": st.fixed_dictionaries({"includeThoughts": st.booleans()}),
            },
        ),
    },
)
# json.dumps, not orjson: it also writes integers beyond 64 bits (and Infinity, which is no JSON).
bodies = (
    well_typed.map(json.dumps)
    | near_valid.map(json.dumps)
    | st.fixed_dictionaries({"generateContentRequest": well_typed | near_valid}).map(json.dumps)
    | json_values.map(json.dumps)
    | st.binary(max_size=200)
)


def check_answer(r: httpx.Response) -> None:
    assert r.status_code in (200, 400, 401, 403, 404, 429), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["status"] in GOOGLE_STATUSES
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["details"], list)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        chunks = sse_events(r)
    else:
        body = r.json()
        if "totalTokens" in body:
            assert isinstance(body["totalTokens"], int) and body["totalTokens"] > 0
            return
        if "models" in body or "supportedGenerationMethods" in body:
            return
        chunks = body if isinstance(body, list) else [body]
    assert chunks
    for c in chunks:
        candidate = c["candidates"][0]
        assert candidate["content"]["role"] == "model"
        assert all(p.get("text") != "" for p in candidate["content"]["parts"])
    assert chunks[-1]["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")
    assert chunks[-1]["usageMetadata"]["totalTokenCount"] > 0


@pytest.fixture(scope="module")
def fuzz_gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine = ScriptEngine(tiny_model_dir, Script("<think>\nhm\n</think>\n\nok " + TOOL_CALL))
    with (
        running_gateway(tiny_model_dir, tmp_path_factory.mktemp("gemini-fuzz"), engine, max_tokens=64) as g,
        httpx.Client(timeout=30) as client,  # one client: a new one per request costs ~80 ms of TLS setup
    ):
        g.rollout = new_rollout(g)  # type: ignore[attr-defined]
        g.http = client  # type: ignore[attr-defined]
        yield g
        assert client.get(g.url + "/health").status_code == 200


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=bodies,
    action=st.sampled_from(
        ["generateContent", "streamGenerateContent?alt=sse", "streamGenerateContent", "countTokens"]
    ),
)
def test_fuzzed_bodies(fuzz_gw: Any, body: str | bytes, action: str) -> None:
    ro = fuzz_gw.rollout
    r = fuzz_gw.http.post(
        f"{ro['base_url']}/v1beta/models/{CLI_MODEL}:{action}",
        content=body.encode() if isinstance(body, str) else body,
        headers=cli_headers(ro),
    )
    check_answer(r)


# No '/': httpx would resolve '..' segments into paths outside this dialect (a model named '..'
# alone takes .../v1beta/models/.. to .../v1beta, which the dialect owns).
model_names = st.text(alphabet="abcXYZ0129.-_:~ %", max_size=20)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    template=st.sampled_from(
        [
            "{base}/v1beta/models/{model}:generateContent",
            "{base}/v1beta/models/{model}:streamGenerateContent?alt=sse",
            "{base}/v1beta/models/{model}:countTokens",
            "{base}/v1beta/models/{model}",
            "{base}/v1beta/x{model}",
            "{base}/v1/models/{model}:generateContent",
            "{root}/r/ro_other/v1beta/models/{model}:generateContent",
        ]
    ),
    model=model_names,
    method=st.sampled_from(["GET", "POST", "PUT"]),
    key=st.sampled_from(["good", "query", "wrong", "none"]),
)
def test_fuzzed_paths_and_keys(fuzz_gw: Any, template: str, model: str, method: str, key: str) -> None:
    ro = fuzz_gw.rollout
    url = template.format(base=ro["base_url"], root=fuzz_gw.url, model=model)
    headers = {"content-type": "application/json"}
    if key == "good":
        headers["x-goog-api-key"] = ro["api_key"]
    elif key == "wrong":
        headers["x-goog-api-key"] = "nope"
    elif key == "query":
        url += ("&" if "?" in url else "?") + "key=" + ro["api_key"]
    body = b'{"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}'
    check_answer(fuzz_gw.http.request(method, url, content=body, headers=headers))
