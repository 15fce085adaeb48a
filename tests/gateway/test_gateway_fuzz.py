"""Property-based fuzzing of request bodies and headers: every answer is a well-formed error or a
valid completion, and the gateway keeps serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway_helpers import ScriptEngine, new_rollout, running_gateway
from tests.strategies import json_values as json_values_of

json_values = json_values_of()
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bogus", 3, None])
content = (
    st.none()
    | st.text(max_size=60)
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "weird"]), "text": st.text(max_size=20)}
        ),
        max_size=3,
    )
)
tool_call = st.fixed_dictionaries(
    {
        "id": st.text(max_size=8),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.text(max_size=10), "arguments": st.text(max_size=30) | json_values}
        ),
    }
)
message = st.fixed_dictionaries(
    {"role": roles, "content": content},
    optional={
        "tool_calls": st.lists(tool_call, max_size=2),
        "tool_call_id": st.text(max_size=8),
        "name": json_values,
    },
)
near_valid = st.fixed_dictionaries(
    {"model": st.text(max_size=20) | json_values, "messages": st.lists(message, max_size=4) | json_values},
    optional={
        "stream": st.booleans() | json_values,
        "temperature": st.floats(-1, 3) | json_values,
        "top_p": st.floats(-1, 2),
        "max_tokens": st.integers(-5, 100_000) | json_values,
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | json_values,
        "tools": st.lists(
            st.fixed_dictionaries({"type": st.just("function"), "function": json_values}), max_size=2
        ),
        "tool_choice": json_values,
        "n": st.integers(-2, 3),
        "stream_options": json_values,
        "logprobs": st.booleans(),
    },
)
bodies = near_valid.map(orjson.dumps) | json_values.map(orjson.dumps) | st.binary(max_size=200)
# h11 (the client) refuses header values with surrounding whitespace; the server never sees those.
header_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip)


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path_factory.mktemp("fuzz"), engine, max_tokens=8) as g:
        g.rollout = new_rollout(g)  # type: ignore[attr-defined]
        yield g


def check_answer(r: httpx.Response) -> None:
    assert r.status_code in (200, 400, 401, 403, 404, 405, 413, 415, 422, 429), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert orjson.loads(e)["object"] == "chat.completion.chunk"
    else:
        body = r.json()
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_fuzzed_bodies(gw: Any, body: bytes) -> None:
    ro = gw.rollout
    r = httpx.post(
        ro["base_url"] + "/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {ro['api_key']}", "content-type": "application/json"},
        timeout=30,
    )
    check_answer(r)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    auth=header_text,
    extra=st.dictionaries(
        st.sampled_from(
            ["x-api-key", "x-goog-api-key", "content-type", "content-length", "accept", "x-stainless-os"]
        ),
        header_text,
        max_size=3,
    ),
    path=st.sampled_from(
        ["/v1/chat/completions", "/v1/models", "/v1/x", "/admin/rollouts", "/r/ro_x/v1/chat/completions"]
    ),
    method=st.sampled_from(["GET", "POST", "PUT"]),
)
def test_fuzzed_headers_and_paths(gw: Any, auth: str, extra: dict[str, str], path: str, method: str) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    headers = {"authorization": auth, **extra}
    headers.pop("content-length", None)  # a lying length is the client library's business, not ours
    r = httpx.request(method, gw.url + path, content=body, headers=headers, timeout=30)
    check_answer(r)
    assert httpx.get(gw.url + "/health").status_code == 200


# -- the admin API -------------------------------------------------------------------------------
sampling_values = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5) | json_values
)
admin_bodies = st.fixed_dictionaries(
    {},
    optional={
        "run_id": st.text(max_size=10) | json_values,
        "task_id": st.text(max_size=10) | json_values,
        "metadata": json_values,
        "sampling": st.dictionaries(
            st.sampled_from(["temperature", "top_p", "max_tokens", "max_context", "seed", "bogus"]),
            sampling_values,
            max_size=3,
        )
        | json_values,
        "upstream": st.text(max_size=5) | json_values,
    },
)


def big_int_json(value: Any) -> bytes:
    """orjson refuses integers beyond 64 bits; the standard library writes them."""
    return json.dumps(value, allow_nan=True).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=admin_bodies)
def test_fuzzed_admin_rollouts_are_made_valid_or_refused(gw: Any, body: dict[str, Any]) -> None:
    """A rollout the admin API accepts serves its calls: nothing invalid is stored to fail later."""
    r = httpx.post(
        gw.url + "/admin/rollouts", content=big_int_json(body), headers=gw.admin_headers, timeout=30
    )
    assert r.status_code in (201, 400), r.text
    if r.status_code == 400:
        assert isinstance(r.json()["error"]["message"], str)
        return
    ro = r.json()
    chat = httpx.post(
        ro["base_url"] + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {ro['api_key']}"},
        timeout=30,
    )
    check_answer(chat)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    query=st.dictionaries(
        st.sampled_from(["limit", "offset", "status", "run_id"]),
        st.integers(-(2**80), 2**80).map(str) | st.text(max_size=8),
        max_size=3,
    ),
    finish=st.fixed_dictionaries(
        {},
        optional={
            "reward": sampling_values,
            "status": st.sampled_from(["open", "closed", "failed", "cancelled", "odd"]) | json_values,
            "details": json_values,
        },
    ),
    action=st.sampled_from(["reward", "close", "faults"]),
)
def test_fuzzed_admin_queries_and_finishes(
    gw: Any, query: dict[str, str], finish: dict[str, Any], action: str
) -> None:
    r = httpx.get(gw.url + "/admin/rollouts", params=query, headers=gw.admin_headers, timeout=30)
    assert r.status_code in (200, 400), r.text
    ro = new_rollout(gw)
    body = {"errors": finish.get("details")} if action == "faults" else finish
    r = httpx.post(
        f"{gw.url}/admin/rollouts/{ro['rollout_id']}/{action}",
        content=big_int_json(body),
        headers=gw.admin_headers,
        timeout=30,
    )
    assert r.status_code in (200, 400, 409), r.text


# -- deep structures -----------------------------------------------------------------------------
def nested_json(depth: int, kind: str) -> str:
    return ("[" * depth + "1" + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    depth=st.integers(1, 1500),
    kind=st.sampled_from(["list", "object"]),
    where=st.sampled_from(["content", "arguments", "arguments_object", "parameters", "schema", "metadata"]),
)
def test_fuzzed_deep_structures_never_crash(gw: Any, depth: int, kind: str, where: str) -> None:
    """However deep a structure from outside is nested, the answer is a completion or a 400."""
    deep = nested_json(depth, kind)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "@DEEP@"}}
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if where == "content":
        body["messages"][0]["content"] = "@DEEP@"
    elif where.startswith("arguments"):
        body["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    elif where == "parameters":
        body["tools"] = [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": "@DEEP@"}}}
        ]
    elif where == "schema":
        schema = {"name": "s", "schema": {"type": "object", "x": "@DEEP@"}}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    raw = orjson.dumps(body)
    # As a JSON string (OpenAI's tool-call arguments) or as the JSON value itself.
    inner = orjson.dumps(deep) if where == "arguments" else deep.encode()
    raw = raw.replace(b'"@DEEP@"', inner)
    if where == "metadata":
        admin = b'{"metadata": ' + deep.encode() + b"}"
        r = httpx.post(gw.url + "/admin/rollouts", content=admin, headers=gw.admin_headers, timeout=30)
        assert r.status_code in (201, 400), r.text
        return
    ro = gw.rollout
    r = httpx.post(
        ro["base_url"] + "/v1/chat/completions",
        content=raw,
        headers={"authorization": f"Bearer {ro['api_key']}", "content-type": "application/json"},
        timeout=60,
    )
    check_answer(r)
