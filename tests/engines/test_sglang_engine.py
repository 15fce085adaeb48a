"""SGLangEngine against the FAKE SGLang server (openforgerl.testing.fake_sglang) over a real socket.

SGLang has no CPU build here; the fake speaks SGLang's native wire format and delegates generation to
a ScriptedEngine, so these tests pin the client's wire mapping, error mapping, weight updates and
cancellation. They are no evidence about SGLang's own sampling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest

from openforgerl.engines import base
from openforgerl.engines.base import (
    ContextLengthExceeded,
    Engine,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    SamplingParams,
    policy_version_end,
)
from openforgerl.engines.sglang import SGLangEngine, parse_generate_response
from openforgerl.testing.scripted_engine import Scripted, ScriptedEngine, ScriptRequest
from tests.engine_helpers import fake_server, free_port, until
from tests.engine_helpers import run_sglang as run

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


def test_wire_format_and_result_mapping() -> None:
    scripted = ScriptedEngine(script=[Scripted([5, 6, 7], logprobs=[-0.25, -1.5, -0.125])])
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, max_tokens=10, stop=("</s>",), stop_token_ids=(9,), seed=42
    )
    with fake_server(scripted) as s:

        async def go(eng: SGLangEngine) -> Any:
            return await eng.generate([1, 2, 3], sampling)

        result = run(go, s.url)
        sent = s.fake.requests[-1]
    assert sent == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 10,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": ["</s>"],
            "stop_token_ids": [9],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "sampling_seed": 42,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    # The fake decoded SGLang's wire format back into the same request.
    assert scripted.last_request is not None
    assert scripted.last_request.prompt_ids == [1, 2, 3]
    assert scripted.last_request.sampling == sampling
    assert isinstance(result, base.GenerateResult)
    assert result.completion_ids == [5, 6, 7]
    assert result.logprobs == [-0.25, -1.5, -0.125]
    assert result.finish_reason == "stop"
    assert result.stop_reason == 7  # SGLang's "matched" for a turn that ended on its last id
    assert result.policy_version == 0
    assert result.extra["weight_version"] == "0"


@pytest.mark.parametrize(
    ("sampling", "ids", "finish", "stop_reason"),
    [
        (SamplingParams(max_tokens=2), [5, 6], "length", None),
        (SamplingParams(max_tokens=10, stop_token_ids=(6,)), [5, 6], "stop", 6),
        (SamplingParams(max_tokens=10), [5, 6, 2], "stop", 2),  # EOS kept, and named
        (SamplingParams(max_tokens=10, stop=("c",)), [5, 6, 2], "stop", 2),  # EOS before the stop text
        (SamplingParams(max_tokens=10, stop=("b",)), [5, 6], "stop", "b"),
    ],
)
def test_finish_reasons(sampling: SamplingParams, ids: list[int], finish: str, stop_reason: object) -> None:
    letters = "?????ab"
    scripted = ScriptedEngine(
        completion=[5, 6, 2, 5], eos_token_id=2, decode=lambda t: "".join(letters[i] for i in t if i != 2)
    )
    with fake_server(scripted) as s:

        async def go(eng: SGLangEngine) -> Any:
            runs: list[list[int]] = []
            streamed = await eng.generate([1], sampling, on_tokens=lambda t: runs.append(list(t)))
            return await eng.generate([1], sampling), streamed, runs

        result, streamed, runs = run(go, s.url)
    assert isinstance(result, base.GenerateResult)
    assert (result.completion_ids, result.finish_reason, result.stop_reason) == (ids, finish, stop_reason)
    assert len(result.logprobs) == len(ids)
    assert streamed == result  # ids, logprobs, finish and stop reasons, version, extra
    assert [t for r in runs for t in r] == ids


def test_abort_finish() -> None:
    scripted = ScriptedEngine(script=[Scripted([5], finish_reason="abort")])
    with fake_server(scripted) as s:

        async def go(eng: SGLangEngine) -> Any:
            return await eng.generate([1], SamplingParams())

        result = run(go, s.url)
    assert isinstance(result, base.GenerateResult)
    assert (result.finish_reason, result.stop_reason) == ("abort", None)
    assert result.extra["abort_message"]


def test_trimmed_output_ids_still_give_the_sampled_ids() -> None:
    """Real SGLang drops a matched stop id from output_ids without no_stop_trim; not from the logprobs."""
    scripted = ScriptedEngine(completion=[5, 6, 2], eos_token_id=2)
    with fake_server(scripted) as s:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
        raw = httpx.post(f"{s.url}/generate", json=body, timeout=10)
    assert raw.json()["output_ids"] == [5, 6]
    result = parse_generate_response(raw.content, policy_version=3)
    assert result.completion_ids == [5, 6, 2]
    assert (result.finish_reason, result.stop_reason, result.policy_version) == ("stop", 2, 3)


def test_inconsistent_answer_is_an_error() -> None:
    body = b'{"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 7, null]]}}'
    with pytest.raises(EngineError, match="disagree"):
        parse_generate_response(body, 0)
    with pytest.raises(EngineError, match="unexpected"):
        parse_generate_response(b'{"text": "no meta"}', 0)


def test_server_down_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go() -> None:
        eng = SGLangEngine(url, start_timeout=1.0)
        try:
            with pytest.raises(EngineUnavailable, match="not healthy within"):
                await eng.start()
            with pytest.raises(EngineUnavailable, match="ClientConnectorError"):
                await eng.generate([1], SamplingParams())
            with pytest.raises(EngineUnavailable):
                await eng.load_weights("/nowhere")
        finally:
            await eng.close()

    asyncio.run(go())


def test_unhealthy_server_fails_start_clearly() -> None:
    with fake_server(ScriptedEngine()) as s:
        s.fake.healthy = False

        async def go() -> None:
            eng = SGLangEngine(s.url, start_timeout=1.0)
            try:
                with pytest.raises(EngineUnavailable, match=r"not healthy within .*HTTP 503"):
                    await eng.start()
            finally:
                await eng.close()

        asyncio.run(go())


def _raise(exc: BaseException) -> Callable[[ScriptRequest], Scripted]:
    def script(req: ScriptRequest) -> Scripted:
        raise exc

    return script


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("exc", "expected", "status"),
    [
        (EngineOverloaded("queue full", retry_after=2.5), EngineOverloaded, 429),
        (EngineUnavailable("warming up", retry_after=3.0), EngineUnavailable, 503),
        # A 500 is SGLang failing, not the request (SGLang refuses bad requests with 400): retry later.
        (RuntimeError("scheduler died"), EngineUnavailable, 500),
        (EngineError("bad request"), EngineError, 400),
    ],
)
def test_error_statuses(exc: BaseException, expected: type[EngineError], status: int, stream: bool) -> None:
    with fake_server(ScriptedEngine(script=_raise(exc))) as s:
        raw = httpx.post(f"{s.url}/generate", json={"input_ids": [1]}, timeout=10)
        assert raw.status_code == status

        async def go(eng: SGLangEngine) -> Any:
            with pytest.raises(expected) as info:
                await eng.generate([1], SamplingParams(), on_tokens=(lambda t: None) if stream else None)
            return info.value

        err = run(go, s.url)
    assert type(err) is expected
    if isinstance(exc, (EngineOverloaded, EngineUnavailable)):
        assert isinstance(err, (EngineOverloaded, EngineUnavailable))
        assert err.retry_after == exc.retry_after


def test_context_length() -> None:
    """SGLang refuses (400) rather than clamps; the engine maps the refusals and clamps like the built-in."""
    scripted = ScriptedEngine(completion=list(range(100, 120)))
    with fake_server(scripted, context_length=16) as s:

        async def go(eng: SGLangEngine) -> Any:
            with pytest.raises(ContextLengthExceeded) as too_long:
                await eng.generate(list(range(20)), SamplingParams(max_tokens=4))
            assert (too_long.value.prompt_tokens, too_long.value.max_context) == (20, 16)
            assert eng.max_context is None
            # prompt + max_new_tokens too long: learn the context length from the refusal, retry clamped.
            clamped = await eng.generate(list(range(10)), SamplingParams(max_tokens=10))
            assert eng.max_context == 16
            sent = [r["sampling_params"]["max_new_tokens"] for r in s.fake.requests[-2:]]
            assert sent == [10, 5]  # SGLang wants prompt + max_new_tokens < context length
            n_requests = len(s.fake.requests)
            with pytest.raises(ContextLengthExceeded):  # now refused locally, no round trip
                await eng.generate(list(range(15)), SamplingParams(max_tokens=1))
            assert len(s.fake.requests) == n_requests
            return clamped

        clamped = run(go, s.url)
    assert isinstance(clamped, base.GenerateResult)
    assert (len(clamped.completion_ids), clamped.finish_reason) == (5, "length")


def test_weight_update() -> None:
    def script(req: ScriptRequest) -> list[int]:
        return [1, 2, 3] if req.weights_path is None else [7, 8, 9]

    scripted = ScriptedEngine(script=script)
    with fake_server(scripted) as s:

        async def go(eng: SGLangEngine) -> Any:
            before = await eng.generate([1], SamplingParams())
            version = await eng.load_weights("/ckpt/step-1")
            after = await eng.generate([1], SamplingParams())
            return before, version, after, eng.policy_version

        before, version, after, policy_version = run(go, s.url)
        assert s.fake.weight_updates == ["/ckpt/step-1"]
    assert (before.completion_ids, before.policy_version) == ([1, 2, 3], 0)
    assert (version, policy_version) == (1, 1)
    assert (after.completion_ids, after.policy_version) == ([7, 8, 9], 1)
    assert "policy_version_end" not in before.extra | after.extra  # neither overlapped the update
    assert scripted.weights_path == "/ckpt/step-1"


def test_the_end_version_of_a_generation_that_overlapped_a_weight_update() -> None:
    """The rule the vLLM and SGLang engines share (versions and reloads in flight at a
    generation's start and end): None when nothing changed under it."""
    assert policy_version_end(3, 0, 3, 0) is None
    assert policy_version_end(3, 0, 4, 0) == 4  # an update started and finished meanwhile
    assert policy_version_end(3, 1, 4, 0) == 4  # one in flight at the start finished
    assert policy_version_end(3, 0, 3, 1) == 4  # one still in flight may have swapped already
    assert policy_version_end(3, 1, 4, 1) == 5


class _FailingLoads(ScriptedEngine):
    async def load_weights(self, path: str) -> int:
        raise EngineError(f"no weights in {path}")


def test_failed_weight_update_keeps_the_version() -> None:
    with fake_server(_FailingLoads()) as s:

        async def go(eng: SGLangEngine) -> Any:
            with pytest.raises(EngineError, match="no weights in /bad") as info:
                await eng.load_weights("/bad")
            return info.value, eng.policy_version

        err, version = run(go, s.url)
    assert not isinstance(err, EngineUnavailable)
    assert version == 0


def test_cancellation_aborts_the_server_side_generation() -> None:
    scripted = ScriptedEngine(latency_s=30.0)
    with fake_server(scripted) as s:

        async def go(eng: SGLangEngine) -> Any:
            task = asyncio.create_task(eng.generate([1], SamplingParams()))
            assert await until(lambda: scripted.calls == 1)  # the fake has handed it to the engine
            t0 = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: s.fake.aborted == 1)
            return time.monotonic() - t0

        elapsed = run(go, s.url)
        assert (s.fake.aborted, scripted.cancelled, s.fake.generated) == (1, 1, 0)
    assert isinstance(elapsed, float) and elapsed < 5


# The sessions of the finished loops are dropped unclosed (they cannot be closed from another loop).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_engine_used_from_two_event_loops() -> None:
    """The session belongs to the loop it was made on; another loop (a push from a fresh
    asyncio.run) gets its own."""
    with fake_server(ScriptedEngine(completion=[5, 6])) as s:
        eng = SGLangEngine(s.url, start_timeout=5.0)
        asyncio.run(eng.start())
        first = asyncio.run(eng.generate([1], SamplingParams()))
        second = asyncio.run(eng.generate([1], SamplingParams(), on_tokens=lambda t: None))
        asyncio.run(eng.close())
    assert first.completion_ids == second.completion_ids == [5, 6]


def test_concurrent_requests_get_their_own_answers() -> None:
    scripted = ScriptedEngine(script=lambda req: [t * 10 for t in req.prompt_ids], latency_s=0.05)
    with fake_server(scripted) as s:

        async def go(eng: SGLangEngine) -> Any:
            prompts = [[i, i + 1] for i in range(16)]
            results = await asyncio.gather(*(eng.generate(p, SamplingParams()) for p in prompts))
            return prompts, results

        prompts, results = run(go, s.url)
    for p, r in zip(prompts, results, strict=True):
        assert r.completion_ids == [t * 10 for t in p]


# Streaming (`on_tokens`): SGLang's event stream, cumulative (its default) or incremental.


@pytest.mark.parametrize("incremental", [False, True])
def test_streamed_generation_equals_the_plain_one(incremental: bool) -> None:
    lps = [-0.25, -1.5, -0.125, -2.0, -0.5]
    scripted = ScriptedEngine(script=[Scripted([5, 6, 7, 8, 9], logprobs=lps)] * 2)
    sampling = SamplingParams(temperature=0.7, max_tokens=10, stop_token_ids=(9,), seed=1)
    with fake_server(scripted, incremental_streaming_output=incremental) as s:

        async def go(eng: SGLangEngine) -> Any:
            runs: list[list[int]] = []
            streamed = await eng.generate([1, 2], sampling, on_tokens=lambda t: runs.append(list(t)))
            return await eng.generate([1, 2], sampling), streamed, runs

        plain, streamed, runs = run(go, s.url)
        stream_body, plain_body = s.fake.requests  # streamed first
    assert stream_body == {**plain_body, "stream": True}
    assert streamed == plain
    assert (streamed.completion_ids, streamed.logprobs, streamed.stop_reason) == ([5, 6, 7, 8, 9], lps, 9)
    assert runs == [[5], [6], [7], [8], [9]]  # one run per event, in order


def test_streamed_tokens_arrive_before_the_generation_ends() -> None:
    """The fake holds its stream after two ids until the test has seen them: a client that waited for
    the whole answer would never deliver them (and the test would time out)."""
    scripted = ScriptedEngine(completion=[5, 6, 7, 8])
    with fake_server(scripted) as s:
        s.fake.hold_after = 2

        async def go(eng: SGLangEngine) -> Any:
            runs: list[list[int]] = []
            task = asyncio.create_task(
                eng.generate([1], SamplingParams(), on_tokens=lambda t: runs.append(list(t)))
            )
            assert await until(lambda: len(runs) == 2, within_s=20)
            early = (list(runs), task.done(), s.fake.streamed)
            s.fake.resume.set()
            return early, await task, runs

        (early_runs, done_early, sent_early), result, runs = run(go, s.url)
    assert (early_runs, done_early, sent_early) == ([[5], [6]], False, 2)
    assert runs == [[5], [6], [7], [8]] and result.completion_ids == [5, 6, 7, 8]


def test_cancelling_a_stream_aborts_it() -> None:
    scripted = ScriptedEngine(completion=[5, 6, 7, 8])
    with fake_server(scripted) as s:
        s.fake.hold_after = 1

        async def go(eng: SGLangEngine) -> Any:
            runs: list[list[int]] = []
            task = asyncio.create_task(
                eng.generate([1], SamplingParams(), on_tokens=lambda t: runs.append(list(t)))
            )
            assert await until(lambda: runs == [[5]], within_s=20)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await until(lambda: s.fake.aborted == 1, within_s=20)  # the server saw the client leave
            return runs

        runs = run(go, s.url)
        assert (s.fake.aborted, s.fake.streamed) == (1, 1)
    assert runs == [[5]]


def test_a_server_dying_mid_stream_is_unavailable() -> None:
    with fake_server(ScriptedEngine(completion=[5, 6, 7, 8])) as s:
        s.fake.die_after = 2

        async def go(eng: SGLangEngine) -> Any:
            runs: list[list[int]] = []
            with pytest.raises(EngineUnavailable):
                await eng.generate([1], SamplingParams(), on_tokens=lambda t: runs.append(list(t)))
            s.fake.die_after = None
            again = await eng.generate([1], SamplingParams(), on_tokens=lambda t: None)  # the pool recovers
            return runs, again

        runs, again = run(go, s.url)
    assert runs == [[5], [6]]
    assert again.completion_ids == [5, 6, 7, 8]


def test_generate_stream_parser() -> None:
    from openforgerl.engines.sglang import GenerateStream

    def event(ids: list[int], total: int, finish: Any = None) -> dict[str, Any]:
        entries = [[-1.0, t, None] for t in ids]
        meta = {"output_token_logprobs": entries, "completion_tokens": total, "finish_reason": finish}
        return {"output_ids": ids, "meta_info": meta}

    cumulative = GenerateStream(0)
    assert [cumulative.feed(event([5], 1)), cumulative.feed(event([5, 6], 2))] == [[5], [6]]
    assert cumulative.feed(event([5, 6], 2)) == []  # nothing new
    with pytest.raises(EngineUnavailable, match="ended before"):
        cumulative.result()
    assert cumulative.feed(event([5, 6, 7], 3, {"type": "length", "length": 3})) == [7]
    assert cumulative.result().completion_ids == [5, 6, 7]
    incremental = GenerateStream(0)
    got = [incremental.feed(event(ids, n)) for ids, n in (([5], 1), ([6, 7], 3), ([8], 4))]
    assert got == [[5], [6, 7], [8]] and incremental.output_ids == [5, 6, 7, 8]
    with pytest.raises(EngineError, match="unexpected stream event"):
        incremental.feed({"text": "no meta"})


# ScriptedEngine on its own (it also drives the gateway benchmark).


def test_scripted_engine_default_completion_and_errors() -> None:
    async def go() -> None:
        eng = ScriptedEngine(completion=[4, 5, 6], logprob=-2.0)
        assert isinstance(eng, Engine)
        r = await eng.generate([1], SamplingParams(max_tokens=8))
        assert (r.completion_ids, r.logprobs, r.finish_reason, r.stop_reason) == (
            [4, 5, 6],
            [-2.0] * 3,
            "stop",
            None,
        )
        r.completion_ids.append(99)  # results never alias the engine's own list
        again = await eng.generate([1], SamplingParams(max_tokens=2))
        assert (again.completion_ids, again.finish_reason) == ([4, 5], "length")
        assert await eng.load_weights("/w") == 1 and eng.policy_version == 1

        listed = ScriptedEngine(script=[[1], EngineOverloaded("busy")])
        assert (await listed.generate([0], SamplingParams())).completion_ids == [1]
        with pytest.raises(EngineOverloaded):
            await listed.generate([0], SamplingParams())
        with pytest.raises(EngineError, match="ran out"):
            await listed.generate([0], SamplingParams())

    asyncio.run(go())
