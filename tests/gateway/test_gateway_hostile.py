"""A hostile or careless client: heavy requests do not stall others, bad input is a 400 in the
caller's dialect (never a 500 or a cut-off stream), and the admin API validates what it stores."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from openforgerl.gateway.dialects import MAX_MESSAGES
from openforgerl.gateway.workers import Workers
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway

USER = [{"role": "user", "content": "hi"}]


def nested(depth: int, leaf: str = '"x"') -> str:
    """A JSON object nested `depth` levels deep, as text (Python's own encoder would recurse)."""
    return '{"a":' * depth + leaf + "}" * depth


@pytest.fixture(scope="module")
def gw(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = ScriptEngine(tiny_model_dir)
    # A context far beyond the engine's, so a multi-megabyte prompt is really rendered and tokenised
    # (the heavy work under test) instead of refused by the size check up front.
    with running_gateway(
        tiny_model_dir, tmp_path_factory.mktemp("hostile"), engine, max_context=4_000_000
    ) as g:
        g.engine = engine  # type: ignore[attr-defined]
        yield g


def post(ro: dict[str, Any], path: str, body: bytes | dict[str, Any], **headers: str) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ints beyond 64 bits too
    auth = {"authorization": f"Bearer {ro['api_key']}", "content-type": "application/json", **headers}
    return httpx.post(ro["base_url"] + path, content=raw, headers=auth, timeout=120)


def health_latency(client: httpx.Client, url: str) -> float:
    t = time.perf_counter()
    assert client.get(url + "/health").status_code == 200
    return time.perf_counter() - t


def test_a_heavy_request_does_not_stall_the_others(gw: Any) -> None:
    client = httpx.Client(timeout=120)  # one kept-alive connection: the probe times the gateway alone
    idle = statistics.median(health_latency(client, gw.url) for _ in range(20))
    ro = new_rollout(gw)
    # ~3 MB of prompt: seconds of chat-template rendering and tokenising for the tiny tokenizer.
    heavy_body = {"model": "m", "messages": [{"role": "user", "content": "lorem ipsum dolor sit " * 140_000}]}
    done = threading.Event()
    answer: list[httpx.Response] = []
    took: list[float] = []

    def heavy() -> None:
        t = time.perf_counter()
        answer.append(post(ro, "/v1/chat/completions", heavy_body))
        took.append(time.perf_counter() - t)
        done.set()

    thread = threading.Thread(target=heavy)
    thread.start()
    time.sleep(0.3)  # the body is sent and being worked on
    during = []
    while not done.is_set() and len(during) < 40:
        during.append(health_latency(client, gw.url))
    thread.join()
    client.close()
    # Rendered and tokenised in full (the exact count), then refused: the engine takes 4096 tokens.
    assert "your messages resulted in 1400020 tokens" in answer[0].json()["error"]["message"]
    assert during, "the heavy request ended before /health was probed"
    # Ratios, not timings: on the event loop, /health waited for most of the heavy request (measured
    # with --work-threads 0: a median half its duration); off it, a few GIL switch intervals, a small
    # multiple of an idle /health and a small fraction of the heavy request.
    assert statistics.median(during) < max(50 * idle, took[0] / 10), (idle, took, during)


def test_too_many_messages_or_a_prompt_far_over_the_context_are_refused_up_front(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = ScriptEngine(tiny_model_dir)
    with running_gateway(tiny_model_dir, tmp_path, engine, max_context=2048) as gw:
        ro = new_rollout(gw)
        many = {"model": "m", "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}
        r = post(ro, "/v1/chat/completions", many)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        huge = {"model": "m", "messages": [{"role": "user", "content": "y" * 8_000_000}]}
        r = post(ro, "/v1/chat/completions", huge)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "maximum context length is 2048 tokens" in r.json()["error"]["message"]
        assert engine.prompts == []  # nothing reached the engine
        assert post(ro, "/v1/chat/completions", {"model": "m", "messages": USER}).status_code == 200


def test_a_count_far_over_the_context_is_refused_up_front_in_the_callers_dialect(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """count_tokens and countTokens share the generation routes' bound: a 10 MB prompt is a 400
    without a moment of rendering or tokenising on the workers every rollout shares."""
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir), max_context=2048) as gw:
        renderer, workers = gw.gateway.core.renderer, gw.gateway.core.workers
        rendered: list[int] = []
        real_render, real_run = renderer.render, workers.run
        monkeypatch.setattr(renderer, "render", lambda *a, **kw: rendered.append(1) or real_render(*a, **kw))
        shares: set[str] = set()
        monkeypatch.setattr(workers, "run", lambda *a, share: shares.add(share) or real_run(*a, share=share))
        huge = "y" * 10_000_000
        ro = new_rollout(gw)
        claude = anthropic.Anthropic(
            base_url=ro["base_url"], api_key=ro["api_key"], max_retries=0, timeout=120
        )
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": huge}])
        assert refused.value.status_code == 400
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "prompt is too long" in refused.value.message
        gemini = genai.Client(
            api_key=ro["api_key"], http_options=genai_types.HttpOptions(base_url=ro["base_url"])
        )
        with pytest.raises(genai_errors.ClientError) as too_long:
            gemini.models.count_tokens(model="m", contents=huge)
        assert too_long.value.code == 400 and too_long.value.status == "INVALID_ARGUMENT"
        assert "exceeds the maximum number of tokens allowed (2048)" in str(too_long.value.message)
        assert rendered == []
        # A prompt that fits is counted as before.
        assert claude.messages.count_tokens(model="m", messages=USER).input_tokens > 0  # type: ignore[arg-type]
        assert gemini.models.count_tokens(model="m", contents="hi").total_tokens
        assert rendered and shares == {ro["rollout_id"]}  # the work is the rollout's share


def _jobs(workers: Workers, shares: list[str], started: list[str], gate: threading.Event) -> list[Any]:
    """One job per share (named share + its number), each noting it started, then holding its thread
    until `gate` opens."""

    def job(name: str) -> str:
        started.append(name)
        gate.wait()
        return name

    return [asyncio.ensure_future(workers.run(job, f"{s}{i}", share=s)) for i, s in enumerate(shares)]


def test_one_rollout_cannot_hold_every_work_thread() -> None:
    """Rollout a's heavy jobs (held on a gate) take at most all threads but one: rollout b's call is
    served while they work, and a's others wait their turn."""

    async def main() -> None:
        workers = Workers(threads=2)
        started: list[str] = []
        gate = threading.Event()
        heavy = _jobs(workers, ["a", "a", "a"], started, gate)
        await asyncio.sleep(0)
        assert (workers.running, {s: len(q) for s, q in workers.waiting.items()}) == ({"a": 1}, {"a": 2})
        assert await workers.run(lambda: "b served", share="b") == "b served"  # a's jobs still hold
        assert not any(job.done() for job in heavy)
        gate.set()
        assert await asyncio.gather(*heavy) == ["a0", "a1", "a2"]
        assert sorted(started) == ["a0", "a1", "a2"] and workers.busy == 0 and not workers.served
        workers.close()

    asyncio.run(main())


def test_a_freed_work_thread_goes_to_the_rollout_waiting_longest_unserved() -> None:
    """One thread, rollout a's three jobs queued before b's one: b's goes second, not fourth."""

    async def main() -> None:
        workers = Workers(threads=1)
        started: list[str] = []
        gate = threading.Event()
        jobs = _jobs(workers, ["a", "a", "a"], started, gate)
        await asyncio.sleep(0)
        jobs += _jobs(workers, ["b"], started, gate)
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*jobs)
        assert started == ["a0", "b0", "a1", "a2"]
        workers.close()

    asyncio.run(main())


def test_a_job_cancelled_while_it_waits_gives_up_its_turn() -> None:
    async def main() -> None:
        workers = Workers(threads=1)
        started: list[str] = []
        gate = threading.Event()
        first, gone, last = _jobs(workers, ["a", "b", "c"], started, gate)
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.gather(first, last) == ["a0", "c2"]
        assert started == ["a0", "c2"] and gone.cancelled() and not workers.waiting and workers.busy == 0

    asyncio.run(main())


def test_seeds_beyond_64_bits_are_a_400_streamed_or_not(gw: Any) -> None:
    ro = new_rollout(gw)
    for seed in (2**64, -(2**63) - 1):
        for stream in (False, True):
            r = post(
                ro, "/v1/chat/completions", {"model": "m", "messages": USER, "seed": seed, "stream": stream}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    gemini = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"seed": 2**64}}
    r = post(ro, "/v1beta/models/m:generateContent", gemini)
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT", r.text
    ok = post(ro, "/v1/chat/completions", {"model": "m", "messages": USER, "seed": 2**64 - 1})
    assert ok.status_code == 200, ok.text


def test_a_failure_after_the_stream_began_ends_it_with_an_error_event(
    gw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openforgerl.gateway.dialects import openai_chat

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the translator")

    monkeypatch.setattr(openai_chat.ChunkWriter, "end", broken)
    ro = new_rollout(gw)
    r = post(ro, "/v1/chat/completions", {"model": "m", "messages": USER, "stream": True})
    assert r.status_code == 200  # the stream had begun
    last = [line for line in r.text.split("\n") if line.startswith("data: ")][-1]
    assert orjson.loads(last[6:])["error"]["type"] == "server_error"


def test_deep_structures_are_bounded(gw: Any) -> None:
    ro = new_rollout(gw)
    deep_args = nested(1000)
    echoed = {
        "model": "m",
        "messages": [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "@"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }
    raw = orjson.dumps(echoed).replace(b'"@"', orjson.dumps(deep_args))
    # Arguments too deep to read are kept as the text the harness sent (as for arguments that are
    # not JSON): the call goes on and the record holds them verbatim.
    r = post(ro, "/v1/chat/completions", raw)
    assert r.status_code == 200, r.text
    recorded = calls_of(gw, ro["rollout_id"])[-1]["messages_delta"]
    assert any(deep_args in str(m) for m in recorded)
    # Gemini's functionCall.args is an object in the body itself: too deep is the dialect's 400.
    gemini = (
        b'{"contents": [{"role": "user", "parts": [{"text": "hi"}]}, {"role": "model", "parts": '
        b'[{"functionCall": {"name": "f", "args": ' + nested(1000).encode() + b"}}]}]}"
    )
    r = post(ro, "/v1beta/models/m:generateContent", gemini)
    assert r.status_code == 400 and "nested deeper than" in r.json()["error"]["message"], r.text
    # Admin metadata, likewise.
    body = b'{"metadata": ' + nested(1000).encode() + b"}"
    r = httpx.post(gw.url + "/admin/rollouts", content=body, headers=gw.admin_headers, timeout=30)
    assert r.status_code == 400 and "nested deeper than" in r.json()["error"]["message"], r.text
    # A model writing such arguments gets a parse error on its call, not a crash.
    from openforgerl.engines.parsers import parse_completion

    parsed = parse_completion('<tool_call>{"name": "f", "arguments": ' + nested(300) + "}</tool_call>")
    assert parsed.tool_calls == [] and "deeper than" in parsed.errors[0]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": -5}, {"top_p": 5}, {"max_tokens": -1}, {"temperature": "hot"}, {"seed": 2**70}],
)
def test_admin_sampling_is_validated_when_the_rollout_is_made(gw: Any, sampling: dict[str, Any]) -> None:
    r = httpx.post(gw.url + "/admin/rollouts", json={"sampling": sampling}, headers=gw.admin_headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling", r.text
    assert list(sampling) == [k for k in sampling if k in r.json()["error"]["message"]]


def test_admin_offsets_and_weights(gw: Any, tmp_path: Path) -> None:
    r = httpx.get(gw.url + "/admin/rollouts", params={"offset": 2**70}, headers=gw.admin_headers)
    assert r.status_code == 400, r.text
    for path in (str(tmp_path / "missing"), ""):
        r = httpx.post(gw.url + "/admin/weights", json={"path": path}, headers=gw.admin_headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
    assert gw.engine.policy_version == 0  # nothing was loaded


def test_bodies_of_other_types_are_refused(gw: Any) -> None:
    ro = new_rollout(gw)
    body = orjson.dumps({"model": "m", "messages": USER})
    r = post(ro, "/v1/chat/completions", body, **{"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    r = post(ro, "/v1/messages", body, **{"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and r.json()["type"] == "error", r.text
    assert post(
        ro, "/v1/chat/completions", body, **{"content-type": "application/json; charset=utf-8"}
    ).is_success


def test_a_stream_over_http_1_0_is_not_chunked(gw: Any) -> None:
    ro = new_rollout(gw)
    body = orjson.dumps({"model": "m", "messages": USER, "stream": True})
    host, port = gw.url.removeprefix("http://").split(":")
    request = (
        f"POST /r/{ro['rollout_id']}/v1/chat/completions HTTP/1.0\r\nHost: {host}\r\n"
        f"Authorization: Bearer {ro['api_key']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        reply = b""
        while chunk := s.recv(65536):  # HTTP/1.0: the server closes when the answer is complete
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    headers = head.decode().lower()
    assert "transfer-encoding" not in headers and f"content-length: {len(payload)}" in headers, headers
    assert payload.rstrip().endswith(b"data: [DONE]")
