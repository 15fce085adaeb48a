"""Bad input and failures get a clear error in the OpenAI shape, and the gateway goes on."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture()
def gw(tiny_model_dir: Path, tmp_path: Path) -> Any:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(
        tiny_model_dir, tmp_path, engine, max_context=256, max_body=20_000, max_inflight=4
    ) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g


def chat(gw: Any, rollout: dict[str, Any], body: Any, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {rollout['api_key']}", **kw.pop("headers", {})}
    url = rollout["base_url"] + "/v1/chat/completions"
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers=headers, timeout=30, **kw)
    return httpx.post(url, json=body, headers=headers, timeout=30, **kw)


def test_malformed_json_and_schema(gw: Any) -> None:
    ro = new_rollout(gw)
    assert "not valid JSON" in assert_openai_error(chat(gw, ro, b"{not json"), 400)["message"]
    assert assert_openai_error(chat(gw, ro, {"model": "m"}), 400)["param"] == "messages"
    err = assert_openai_error(
        chat(gw, ro, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}), 400
    )
    assert err["param"] == "messages.0.role"
    err = assert_openai_error(
        chat(gw, ro, {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}), 400
    )
    assert err["param"] == "temperature"
    assert_openai_error(
        chat(gw, ro, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}), 400
    )
    assert_openai_error(chat(gw, ro, [1, 2, 3]), 400)
    for fmt in ({"type": "yaml"}, {"type": "json_schema"}, "json"):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": fmt}
        assert assert_openai_error(chat(gw, ro, body), 400)["param"].startswith("response_format")
    # Token counts are integers, not their spelling ("10") nor a boolean (true is not 1).
    for field in ("max_tokens", "max_completion_tokens"):
        for value in ("10", True, 2.5):
            body = {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
            assert assert_openai_error(chat(gw, ro, body), 400)["param"] == field


def test_keys(gw: Any) -> None:
    ro = new_rollout(gw)
    url = ro["base_url"] + "/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert_openai_error(httpx.post(url, json=body), 401, "invalid_api_key")
    assert_openai_error(
        httpx.post(url, json=body, headers={"authorization": "Bearer nope"}), 401, "invalid_api_key"
    )
    # Other dialects' key headers are accepted too.
    assert httpx.post(url, json=body, headers={"x-api-key": ro["api_key"]}, timeout=30).status_code == 200
    assert (
        httpx.post(url, json=body, headers={"x-goog-api-key": ro["api_key"]}, timeout=30).status_code == 200
    )
    # The plain /v1 path (no rollout prefix) finds the rollout by its key alone.
    r = httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={"x-api-key": ro["api_key"]}, timeout=30
    )
    assert r.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=ro["base_url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in OpenAI(base_url=ro["base_url"] + "/v1", api_key=ro["api_key"]).models.list()]


def test_body_too_large(gw: Any) -> None:
    ro = new_rollout(gw)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 30_000}]}
    assert_openai_error(chat(gw, ro, big), 413)


def test_context_length_exceeded_in_the_words_clients_know(gw: Any) -> None:
    ro = new_rollout(gw)
    client = OpenAI(base_url=ro["base_url"] + "/v1", api_key=ro["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 2000}])
    assert info.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in info.value.message


def test_engine_down_is_503_with_retry_after(gw: Any) -> None:
    ro = new_rollout(gw)
    gw.engine.down = True
    r = chat(gw, ro, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 503)
    assert r.headers["retry-after"] == "2"
    gw.engine.down = False
    assert chat(gw, ro, {"model": "m", "messages": [{"role": "user", "content": "x"}]}).status_code == 200
    statuses = [c["status"] for c in calls_of(gw, ro["rollout_id"])]
    assert statuses == ["error", "ok"]


def test_overload_is_429_with_retry_after(gw: Any) -> None:
    gw.engine.delay = 1.0
    rollouts = [new_rollout(gw) for _ in range(10)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(
                *[
                    client.post(
                        ro["base_url"] + "/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                        headers={"authorization": f"Bearer {ro['api_key']}"},
                    )
                    for ro in rollouts
                ]
            )

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 4 and 429 in codes
    for r in responses:
        if r.status_code == 429:
            assert_openai_error(r, 429)
            assert int(r.headers["retry-after"]) >= 1


def test_client_disconnect_mid_stream_aborts_and_is_recorded(gw: Any) -> None:
    gw.engine.delay = 30.0
    ro = new_rollout(gw)
    with httpx.stream(
        "POST",
        ro["base_url"] + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
        headers={"authorization": f"Bearer {ro['api_key']}"},
        timeout=30,
    ) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not gw.engine.cancelled:
        time.sleep(0.05)
    assert gw.engine.cancelled == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not calls_of(gw, ro["rollout_id"]):
        time.sleep(0.05)
    [call] = calls_of(gw, ro["rollout_id"])
    assert call["status"] == "aborted" and call["finish_reason"] == "abort"


def test_a_bug_is_a_500_in_the_dialect_that_says_the_connection_closes(gw: Any) -> None:
    ro = new_rollout(gw)

    def bug(prompt: list[int]) -> str:
        raise ZeroDivisionError("a bug")

    gw.engine.script = bug
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(timeout=30) as client:  # one kept-alive connection
        headers = {"authorization": f"Bearer {ro['api_key']}"}
        r = client.post(ro["base_url"] + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
        assert r.headers["connection"] == "close"
        gw.engine.script = lambda prompt: "fine"
        # The client opens a new connection for the next request instead of reusing a dead one.
        r = client.post(ro["base_url"] + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200


def test_unknown_routes_and_admin_validation(gw: Any) -> None:
    ro = new_rollout(gw)
    assert_openai_error(httpx.post(ro["base_url"] + "/v1/completely/unknown", json={}), 404)
    h = gw.admin_headers
    assert_openai_error(httpx.get(gw.url + "/admin/rollouts?limit=abc", headers=h), 400)
    assert_openai_error(httpx.get(gw.url + "/admin/rollouts?limit=0", headers=h), 400)
    assert_openai_error(httpx.get(gw.url + "/admin/rollouts/ro_missing/calls", headers=h), 404)
    assert_openai_error(httpx.post(gw.url + "/admin/rollouts", content=b"[", headers=h), 400)
    assert_openai_error(
        httpx.post(gw.url + "/admin/rollouts", json={"sampling": {"warp": 9}}, headers=h), 400
    )
    close = f"{gw.url}/admin/rollouts/{ro['rollout_id']}/close"
    assert_openai_error(httpx.post(close, json={"reward": "high"}, headers=h), 400)
    assert_openai_error(httpx.post(close, json={"status": "exploded"}, headers=h), 400)
    # A reward on a closed rollout is recorded, but the rollout is not reopened (its key stays dead).
    reward = f"{gw.url}/admin/rollouts/{ro['rollout_id']}/reward"
    assert httpx.post(close, json={"reward": 0.0}, headers=h).status_code == 200
    assert_openai_error(httpx.post(reward, json={"reward": 1.0, "status": "open"}, headers=h), 409)
    r = httpx.post(reward, json={"reward": 1.0}, headers=h)
    assert r.status_code == 200 and r.json()["status"] == "closed" and r.json()["reward"] == 1.0
    assert_openai_error(chat(gw, ro, {"model": "m", "messages": [{"role": "user", "content": "x"}]}), 403)
    assert_openai_error(httpx.post(gw.url + "/admin/rollouts", json={}), 401)
    # The admin token never in the URL (query strings end up in access logs); rollout keys may be
    # (Gemini's ?key=).
    token = gw.gateway.admin_token
    assert_openai_error(httpx.get(f"{gw.url}/admin/rollouts?key={token}"), 401)
    assert httpx.get(f"{gw.url}/admin/rollouts", headers=h).status_code == 200


def test_injected_faults_are_answered_once_each(gw: Any) -> None:
    ro = new_rollout(gw)
    faults = f"{gw.url}/admin/rollouts/{ro['rollout_id']}/faults"
    assert_openai_error(httpx.post(faults, json={"errors": [418]}, headers=gw.admin_headers), 400)
    assert httpx.post(faults, json={"errors": [429, 500]}, headers=gw.admin_headers).status_code == 200
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    r = chat(gw, ro, body)
    assert_openai_error(r, 429)
    assert r.headers["retry-after"] == "1"
    assert_openai_error(chat(gw, ro, body), 500)
    assert chat(gw, ro, body).status_code == 200
    # The OpenAI SDK's own retry loop gets through an injected 429.
    httpx.post(faults, json={"errors": [429]}, headers=gw.admin_headers)
    client = OpenAI(base_url=ro["base_url"] + "/v1", api_key=ro["api_key"], max_retries=2)
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]).choices


class _ServerLikeEngine(ScriptEngine):
    """Starts as a server engine does (a vLLM CPU build compiles its graphs first): slower than the
    gateway's own start, within a deadline of its own."""

    def __init__(self, model_dir: Path, start_s: float, start_timeout: float) -> None:
        super().__init__(model_dir)
        self.start_s, self.start_timeout = start_s, start_timeout
        self.started = False

    async def start(self) -> None:
        await asyncio.sleep(self.start_s)
        await super().start()
        self.started = True


def test_the_gateway_waits_as_long_as_its_engine_may_take_to_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in a learning run: a vLLM server starting on a slow machine (its own deadline 900 s)
    outlasted the gateway's fixed 120 s wait, and the evaluation failed with "the gateway did not
    start". The gateway's wait is now its own start plus the engine's deadline, and still bounded."""
    from openforgerl.gateway import server

    monkeypatch.setattr(server, "GATEWAY_START_S", 0.3)
    slow = _ServerLikeEngine(tiny_model_dir, start_s=1.0, start_timeout=30.0)
    with running_gateway(tiny_model_dir, tmp_path / "slow", slow) as g:
        assert slow.started
        assert new_rollout(g)["rollout_id"]
    hung = _ServerLikeEngine(tiny_model_dir, start_s=30.0, start_timeout=0.5)
    with pytest.raises(RuntimeError, match="did not start within 1 s"):
        with running_gateway(tiny_model_dir, tmp_path / "hung", hung):
            pass
