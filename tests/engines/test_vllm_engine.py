"""VLLMEngine: wire and error mapping against a mock transport (default run), and against a REAL vLLM.

The tests marked `vllm` start a real vLLM server (CPU build, `.venv-vllm`, built by `make
.venv-vllm/.installed`) on the kit's tiny model and check, through the engine:
- completion_ids are the ids vLLM sampled: their logprobs equal a teacher-forced float32 forward of
  the same weights in this venv (tolerance LOGPROB_TOL);
- finish reasons: length, stop string, stop token id, EOS (the EOS id is in completion_ids);
- seeds reproduce, 8 concurrent requests, context-length handling, cancellation aborts the request;
- load_weights swaps in a different checkpoint (outputs and policy_version change) and back;
  a reload that changes a tied embedding serves the new LM head (the engine's `tied_head_view`);
- weight updates in place from the trainer: a GRPO step on completions sampled by vLLM, saved and
  pushed with `Trainer.push_weights`, after which vLLM's logprobs are the trainer's, and
  `openforge train --engine vllm:URL` for two steps and a resumed third (a second server, on an
  untied copy of the tiny model, so a reload can change the LM head).
Run them with `make test-vllm` (the default pytest run deselects the `vllm` marker).

The server runs with `--logprobs-mode processed_logprobs`, so logprobs are of logits / temperature
(base.GenerateResult's contract at top_p = 1); vLLM's default `raw_logprobs` ignores temperature.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from openforgerl.engines.base import (
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)
from openforgerl.engines.vllm import VLLMEngine

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAX_MODEL_LEN = 2048
# vLLM (CPU kernels) against transformers' eager float32 forward, measured max |diff| about 2e-5.
LOGPROB_TOL = 2e-3
SERVER_START_TIMEOUT_S = 240

vllm = pytest.mark.vllm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_engine(url: str, fn: Callable[[VLLMEngine], Awaitable[T]], **kw: Any) -> T:
    """Start a VLLMEngine on `url`, run `fn(engine)`, close it."""

    async def main() -> T:
        eng = VLLMEngine(url, start_timeout=10.0, **kw)
        try:
            await eng.start()
            return await fn(eng)
        finally:
            await eng.close()

    return asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# Default run: the engine against a scripted vLLM (an aiohttp server on the test's loop), no model.


@dataclass
class Seen:
    """A request the scripted vLLM received."""

    path: str
    params: dict[str, str]
    content: bytes
    headers: dict[str, str]


@dataclass
class Stream:
    """A streamed answer: `events` written one by one as they are (raw bytes), status 200."""

    events: list[bytes]


@dataclass
class Mock:
    """A scripted vLLM: `answers[path]` is (status, json body[, headers]), a Stream, or a callable
    of the Seen request returning (or awaiting) one of those."""

    answers: dict[str, Any]
    seen: list[Seen]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.path, dict(request.query), await request.read(), dict(request.headers))
        self.seen.append(seen)
        answer = self.answers.get(request.path)
        if callable(answer):
            answer = answer(seen)
        if inspect.isawaitable(answer):
            answer = await answer
        if answer is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        if isinstance(answer, Stream):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for event in answer.events:
                await response.write(event)
            await response.write_eof()
            return response
        status, body, headers = answer if len(answer) == 3 else (*answer, {})
        return web.json_response(body, status=status, headers=headers)


MODELS = (200, {"data": [{"id": "tiny", "max_model_len": 64}]})


def choice(ids: list[int], finish: str = "length", stop_reason: Any = None) -> tuple[int, dict[str, Any]]:
    body = {
        "choices": [
            {
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        ]
    }
    return 200, body


def mocked(answers: dict[str, Any], fn: Callable[[VLLMEngine], Awaitable[T]], **kw: Any) -> tuple[T, Mock]:
    mock = Mock({"/health": (200, {}), "/v1/models": MODELS, **answers}, [])

    async def main() -> T:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", mock.handle)
        async with TestServer(app, host="127.0.0.1") as server:
            eng = VLLMEngine(str(server.make_url("")), start_timeout=1.0, **kw)
            try:
                await eng.start()
                return await fn(eng)
            finally:
                await eng.close()

    return asyncio.run(main()), mock


def test_request_body_and_result_mapping() -> None:
    async def go(eng: VLLMEngine) -> GenerateResult:
        sampling = SamplingParams(0.7, 0.9, 500, ("\n\n",), (7,), 3)
        return await eng.generate([1, 2, 3], sampling)

    result, mock = mocked({"/v1/completions": choice([5, 6, 7], "stop", 7)}, go, api_key="k")
    assert {r.headers.get("Authorization") for r in mock.seen} == {"Bearer k"}
    sent = json.loads(mock.seen[-1].content)
    assert sent == {
        "model": "tiny",  # discovered from /v1/models
        "prompt": [1, 2, 3],
        "max_tokens": 61,  # clamped to max_model_len (64) - prompt (3)
        "temperature": 0.7,
        "top_p": 0.9,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "stop": ["\n\n"],
        "stop_token_ids": [7],
        "seed": 3,
    }
    assert (result.completion_ids, result.logprobs) == ([5, 6, 7], [-0.5] * 3)
    assert (result.finish_reason, result.stop_reason, result.policy_version) == ("stop", 7, 0)


@pytest.mark.parametrize(
    ("answer", "finish", "stop_reason"),
    [
        (choice([5, 9], "stop", None), "stop", 9),  # EOS: vLLM's stop_reason is null, the id is last
        (choice([5, 6], "stop", "ab"), "stop", "ab"),
        (choice([5, 6], "length"), "length", None),
        (choice([5], "abort"), "abort", None),
    ],
)
def test_finish_mapping(answer: Any, finish: str, stop_reason: Any) -> None:
    async def go(eng: VLLMEngine) -> GenerateResult:
        return await eng.generate([1], SamplingParams())

    result, _ = mocked({"/v1/completions": answer}, go)
    assert (result.finish_reason, result.stop_reason) == (finish, stop_reason)


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (429, {"error": {"message": "too many"}}, EngineOverloaded),
        (503, {"error": {"message": "not ready"}}, EngineUnavailable),
        (500, {"error": {"message": "EngineCore encountered an issue."}}, EngineUnavailable),
        (400, {"error": {"message": "Token id 99999 is out of vocabulary"}}, EngineError),
        (
            400,
            {
                "error": {
                    "message": "This model's maximum context length is 2048 tokens. However, your prompt "
                    "contains 2050 input tokens, which exceeds this limit even without any output tokens."
                }
            },
            ContextLengthExceeded,
        ),
        (200, {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]}, EngineError),
    ],
)
def test_error_mapping(status: int, body: dict[str, Any], expected: type[EngineError]) -> None:
    async def go(eng: VLLMEngine) -> EngineError:
        with pytest.raises(expected) as info:
            await eng.generate([1], SamplingParams())
        return info.value

    err, _ = mocked({"/v1/completions": (status, body, {"Retry-After": "4"})}, go, max_context=10**6)
    assert type(err) is expected
    if isinstance(err, (EngineOverloaded, EngineUnavailable)):
        assert err.retry_after == 4.0
    if isinstance(err, ContextLengthExceeded):
        assert (err.prompt_tokens, err.max_context) == (2050, 2048)


def event(ids: list[int], finish: str | None = None, stop_reason: Any = None) -> bytes:
    """One `/v1/completions` stream event in vLLM 0.32's shape (as its server writes it)."""
    lps = [-0.5] * len(ids)
    data = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "x" * len(ids),
                "logprobs": {
                    "text_offset": [0] * len(ids),
                    "token_logprobs": lps,
                    "tokens": ["x"] * len(ids),
                },
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": ids,
            }
        ],
    }
    return b"data: " + json.dumps(data).encode() + b"\n\n"


USAGE = b'data: {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("events", "plain"),
    [
        ([event([5]), event([6, 7]), event([9], "stop"), DONE], choice([5, 6, 7, 9], "stop")),
        ([event([5]), event([6], "stop", "ab"), USAGE, DONE], choice([5, 6], "stop", "ab")),
        ([event([5]), event([], "length"), DONE], choice([5], "length")),
        ([event([5], "abort"), DONE], choice([5], "abort")),
    ],
)
def test_a_stream_gives_the_plain_answers_result(events: list[bytes], plain: Any) -> None:
    async def go(eng: VLLMEngine) -> tuple[GenerateResult, GenerateResult, list[list[int]]]:
        runs: list[list[int]] = []
        streamed = await eng.generate([1], SamplingParams(), on_tokens=lambda t: runs.append(list(t)))
        return streamed, await eng.generate([1], SamplingParams()), runs

    def answer(seen: Seen) -> Any:
        return Stream(events) if json.loads(seen.content).get("stream") else plain

    (streamed, result, runs), mock = mocked({"/v1/completions": answer}, go)
    assert streamed == result
    assert [t for r in runs for t in r] == result.completion_ids and [] not in runs
    stream_body, plain_body = (json.loads(r.content) for r in mock.seen[-2:])
    assert stream_body == {**plain_body, "stream": True}


@pytest.mark.parametrize(
    ("events", "expected", "match"),
    [
        # vLLM's error event when its engine fails mid-generation: a server failure, retry later.
        (
            [
                event([5]),
                b'data: {"error": {"message": "Internal server error", "type": '
                b'"InternalServerError", "param": null, "code": 500}}\n\n',
                DONE,
            ],
            EngineUnavailable,
            "Internal server error",
        ),
        ([event([5]), b"data: {not json\n\n", DONE], EngineError, "malformed"),
        ([event([5]), b'data: {"choices": [{"token_ids": [6]}]}\n\n', DONE], EngineError, "1 token ids"),
        ([event([5]), DONE], EngineUnavailable, "ended before"),  # no finish: the server gave up
        ([event([5]), b'data: {"choi'], EngineUnavailable, "inside an event"),  # cut mid-event
    ],
)
def test_stream_failures(events: list[bytes], expected: type[EngineError], match: str) -> None:
    async def go(eng: VLLMEngine) -> tuple[EngineError, list[list[int]]]:
        runs: list[list[int]] = []
        with pytest.raises(expected, match=match) as info:
            await eng.generate([1], SamplingParams(), on_tokens=lambda t: runs.append(list(t)))
        return info.value, runs

    (err, runs), _ = mocked({"/v1/completions": Stream(events)}, go)
    assert type(err) is expected and runs == [[5]]


def test_a_refused_stream_maps_like_a_refused_request() -> None:
    async def go(eng: VLLMEngine) -> EngineError:
        with pytest.raises(EngineOverloaded) as info:
            await eng.generate([1], SamplingParams(), on_tokens=lambda t: None)
        return info.value

    too_many = (429, {"error": {"message": "too many"}}, {"Retry-After": "4"})
    err, _ = mocked({"/v1/completions": too_many}, go)
    assert err.retry_after == 4.0 and "too many" in str(err)


def test_a_given_client_session_is_used_and_left_open() -> None:
    """`client=`: the caller's aiohttp session (its own settings) plus the bearer token; not closed."""
    mock = Mock({"/health": (200, {}), "/v1/models": MODELS, "/v1/completions": choice([5])}, [])

    async def main() -> tuple[GenerateResult, bool]:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", mock.handle)
        async with (
            TestServer(app, host="127.0.0.1") as server,
            aiohttp.ClientSession(headers={"X-Test": "given"}) as session,
        ):
            eng = VLLMEngine(str(server.make_url("")), client=session, api_key="k", start_timeout=1.0)
            await eng.start()
            result = await eng.generate([1], SamplingParams())
            await eng.close()
            return result, session.closed

    result, closed = asyncio.run(main())
    assert result.completion_ids == [5] and not closed
    sent = mock.seen[-1].headers
    assert (sent.get("X-Test"), sent.get("Authorization")) == ("given", "Bearer k")


def test_prompt_without_room_is_refused_locally() -> None:
    async def go(eng: VLLMEngine) -> None:
        with pytest.raises(ContextLengthExceeded):
            await eng.generate(list(range(64)), SamplingParams())

    _, mock = mocked({}, go)
    assert [r.path for r in mock.seen] == ["/health", "/v1/models"]


def test_server_down_and_start_timeout() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def go() -> None:
        eng = VLLMEngine(url, model="tiny", max_context=100, start_timeout=1.0)
        try:
            with pytest.raises(EngineUnavailable, match="not healthy within 1 s"):
                await eng.start()
            with pytest.raises(EngineUnavailable, match="ClientConnectorError"):
                await eng.generate([1], SamplingParams())
        finally:
            await eng.close()

    asyncio.run(go())


def test_load_weights_calls(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    resets = iter([(200, {"success": False}), (200, {"success": True})])

    async def go(eng: VLLMEngine) -> int:
        return await eng.load_weights(str(tmp_path))

    answers = {"/collective_rpc": (200, {"results": [None]}), "/reset_prefix_cache": lambda r: next(resets)}
    version, mock = mocked(answers, go)
    assert version == 1
    calls = [(r.path, r.params.get("reset_running_requests")) for r in mock.seen[2:]]
    assert calls == [("/collective_rpc", None)] + [("/reset_prefix_cache", "true")] * 2
    assert json.loads(mock.seen[2].content) == {
        "method": "reload_weights",
        "kwargs": {"weights_path": str(tmp_path)},
    }


def test_a_generation_that_ends_during_the_cache_reset_ends_on_the_updates_version(tmp_path: Path) -> None:
    """The weights are swapped before the prefix cache is reset: a generation that ends during the
    reset ended on the update's version, not one past it (CI once saw 12 for an update to 11)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    resetting, generated = asyncio.Event(), asyncio.Event()

    async def completion(seen: Seen) -> tuple[int, dict[str, Any]]:
        await resetting.wait()
        return choice([5])

    async def reset(seen: Seen) -> tuple[int, dict[str, Any]]:
        resetting.set()
        await generated.wait()
        return 200, {"success": True}

    async def go(eng: VLLMEngine) -> tuple[GenerateResult, int]:
        generation = asyncio.create_task(eng.generate([1], SamplingParams(max_tokens=1)))
        reload = asyncio.create_task(eng.load_weights(str(tmp_path)))
        result = await generation
        generated.set()
        return result, await reload

    answers = {
        "/v1/completions": completion,
        "/collective_rpc": (200, {"results": [None]}),
        "/reset_prefix_cache": reset,
    }
    (result, version), _ = mocked(answers, go)
    assert version == 1
    assert (result.policy_version, result.extra.get("policy_version_end")) == (0, 1)


def test_tied_head_view(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The reload view of a tied checkpoint: the checkpoint's files plus the embedding's bytes under
    the name lm_head.weight; None where it is not needed or cannot work."""
    import torch
    from safetensors.torch import load_file, save_file

    from openforgerl.engines.vllm import tied_head_view

    view = tied_head_view(tiny_model_dir)
    assert view is not None
    try:
        assert {p.name for p in tiny_model_dir.iterdir()} < {p.name for p in view.iterdir()}
        [head_file] = [p for p in view.glob("*.safetensors") if not p.is_symlink()]
        head = load_file(head_file)
        embedding = load_file(tiny_model_dir / "model.safetensors")["model.embed_tokens.weight"]
        assert list(head) == ["lm_head.weight"] and torch.equal(head["lm_head.weight"], embedding)
    finally:
        shutil.rmtree(view)
    # A sharded checkpoint: the index names the new file too (vLLM loads only what the index names).
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tiny_model_dir / "config.json", sharded)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    view = tied_head_view(sharded)
    assert view is not None
    try:
        weight_map = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
        assert weight_map == {**index["weight_map"], "lm_head.weight": weight_map["lm_head.weight"]}
        sharded_head = load_file(view / weight_map["lm_head.weight"])["lm_head.weight"]
        assert torch.equal(sharded_head, tensors["model.embed_tokens.weight"])
    finally:
        shutil.rmtree(view)
    # Not needed: untied, or the head already named; cannot work: no weights it can read.
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert tied_head_view(sharded) is None
    named = tmp_path / "named"
    named.mkdir()
    shutil.copy(tiny_model_dir / "config.json", named)
    save_file(
        {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
        str(named / "m.safetensors"),
    )
    assert tied_head_view(named) is None
    (named / "m.safetensors").write_bytes(b"not a safetensors file")
    assert tied_head_view(named) is None
    assert tied_head_view(tmp_path / "missing") is None


def test_load_weights_failures(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")

    async def no_dev_mode(eng: VLLMEngine) -> None:
        with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
            await eng.load_weights(str(tmp_path))
        assert eng.policy_version == 0

    mocked({}, no_dev_mode)

    async def failed(eng: VLLMEngine) -> None:
        with pytest.raises(EngineError, match="failed to reload") as info:
            await eng.load_weights(str(tmp_path))
        assert not isinstance(info.value, EngineUnavailable)
        assert eng.policy_version == 0

    mocked({"/collective_rpc": (500, {"error": {"message": "Worker failed"}})}, failed)

    empty = tmp_path / "empty"
    empty.mkdir()

    async def checked_locally(eng: VLLMEngine) -> None:
        with pytest.raises(EngineError, match="holds no"):
            await eng.load_weights(str(empty))
        with pytest.raises(EngineError, match="not a directory"):
            await eng.load_weights(str(tmp_path / "missing"))

    _, mock = mocked({}, checked_locally, check_weights_path=True)
    assert "/collective_rpc" not in [r.path for r in mock.seen]


# ---------------------------------------------------------------------------------------------
# The real vLLM server.


@dataclass
class Server:
    url: str
    model_dir: Path
    log: Path
    ready_s: float


@pytest.fixture(scope="session")
def work_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """Scratch space of our own: pytest's basetemp can be pruned by other pytest sessions meanwhile.
    When a test failed, the servers' logs are printed before it goes: a server that died under a
    test says why only there."""
    path = Path(tempfile.mkdtemp(prefix="openforgerl-vllm-test-"))
    try:
        yield path
    finally:
        if request.session.testsfailed:
            for log in sorted(path.glob("*.log")):
                tail = log.read_text(errors="replace")[-6000:]
                print(f"\n--- {log.name} (its end) ---\n{tail}", file=sys.__stderr__, flush=True)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, work_dir: Path) -> Iterator[Server]:
    """A real vLLM OpenAI server on a free port, started from `.venv-vllm`, killed at the end."""
    with serve_vllm(tiny_model_dir, work_dir / "server.log") as server:
        yield server


@contextlib.contextmanager
def serve_vllm(model_dir: Path, log: Path, max_model_len: int = MAX_MODEL_LEN) -> Iterator[Server]:
    """A real vLLM OpenAI server for `model_dir` (served as "tiny") on a free port, killed on exit."""
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm: run `make test-vllm` (it builds the vLLM venv)")
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
        "VLLM_SERVER_DEV_MODE": "1",  # serves /collective_rpc (weight reload) and /reset_prefix_cache
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    cmd = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",  # 35 s to ready instead of about 2 min of compiling
        "--logprobs-mode",
        "processed_logprobs",
    ]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        # Its own session, so the whole tree (API server, engine core, workers) can be killed.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode} while starting:\n{log.read_text()[-3000:]}")
            if time.monotonic() - t0 > SERVER_START_TIMEOUT_S:
                pytest.fail(f"vLLM not ready in {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        print(f"\nvLLM server ready in {ready_s:.1f} s (log: {log})")
        yield Server(url, model_dir, log, ready_s)
    finally:
        _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class Teacher:
    """Teacher-forced float32 logprobs of given completions, from the same weights in this venv."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}

    def model(self, path: Path) -> Any:
        if path not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            self._models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return self._models[path]

    def logprobs(
        self, path: Path, prompt: list[int], completion: list[int], temperature: float
    ) -> list[float]:
        return forced_logprobs(self.model(path), prompt, completion, temperature)

    def check(self, path: Path, prompt: list[int], r: GenerateResult, temperature: float) -> float:
        """Assert the recorded logprobs are the model's for the recorded ids; the max difference."""
        assert len(r.logprobs) == len(r.completion_ids) > 0
        want = self.logprobs(path, prompt, r.completion_ids, temperature)
        diff = max(abs(a - b) for a, b in zip(r.logprobs, want, strict=True))
        assert diff < LOGPROB_TOL, (diff, r.completion_ids)
        return diff


def forced_logprobs(
    model: Any, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """Teacher-forced logprobs of `completion` after `prompt` under `model`, at `temperature`."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    lp = torch.log_softmax(scaled, dim=-1)
    return [float(x) for x in lp.gather(1, torch.tensor(completion)[:, None])[:, 0]]


@pytest.fixture(scope="session")
def teacher() -> Teacher:
    return Teacher()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def prompt(tokenizer: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def eos_ids(model_dir: Path) -> list[int]:
    """The ids vLLM stops on by itself: the tokenizer's EOS first, then generation_config's others."""
    from transformers import AutoTokenizer

    tok_eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    gen = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id", [])
    gen = gen if isinstance(gen, list) else [gen]
    return [tok_eos, *[e for e in gen if e != tok_eos]]


async def plain_and_streamed(eng: VLLMEngine, prompt: list[int], sampling: SamplingParams) -> GenerateResult:
    """Generate `sampling` (seeded or greedy) streamed, then plainly: the streamed result must be the
    plain one exactly (ids, logprobs, finish and stop reasons, version), its runs the ids in order."""
    runs: list[list[int]] = []
    streamed = await eng.generate(prompt, sampling, on_tokens=lambda t: runs.append(list(t)))
    plain = await eng.generate(prompt, sampling)
    assert streamed == plain
    assert [t for r in runs for t in r] == plain.completion_ids
    assert len(runs) > 1 or len(plain.completion_ids) == 1  # vLLM sends one step per event
    return plain


@vllm
def test_sampled_ids_and_logprobs(vllm_server: Server, teacher: Teacher, prompt: list[int]) -> None:
    async def go(eng: VLLMEngine) -> list[tuple[float, GenerateResult]]:
        assert (eng.model, eng.max_context) == ("tiny", MAX_MODEL_LEN)
        out = []
        for temperature, seed in ((1.0, 1), (0.7, 2), (1.3, 3)):
            sampling = SamplingParams(temperature=temperature, max_tokens=48, seed=seed)
            out.append((temperature, await plain_and_streamed(eng, prompt, sampling)))
        return out

    diffs = []
    for temperature, r in run_engine(vllm_server.url, go):
        assert r.policy_version == 0 and len(r.completion_ids) > 0
        diffs.append(teacher.check(vllm_server.model_dir, prompt, r, temperature))
    print(f"max |vLLM logprob - teacher-forced logprob| = {max(diffs):.2e}")


@vllm
def test_greedy_matches_the_teacher(vllm_server: Server, teacher: Teacher, prompt: list[int]) -> None:
    import torch

    async def go(eng: VLLMEngine) -> GenerateResult:
        return await eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))

    r = run_engine(vllm_server.url, go)
    model = teacher.model(vllm_server.model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(len(r.completion_ids)):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert r.completion_ids == ids[len(prompt) :]
    assert r.finish_reason == "length"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@vllm
def test_an_engine_that_starts_its_own_server_serves_reloads_and_stops_it(
    tiny_model_dir: Path, work_dir: Path, teacher: Teacher, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--engine vllm`: the engine starts a vLLM server on loopback from the environment that holds
    vLLM, with what RL needs of it (logprobs of logits / T, weights reloadable), and its close
    stops the server's whole process tree; a server that dies while starting is said at once."""
    from openforgerl.engines import make_engine
    from openforgerl.engines.vllm_server import LocalVLLMEngine

    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm: run `make test-vllm` (it builds the vLLM venv)")
    monkeypatch.setenv("OPENFORGE_VLLM_PYTHON", str(VLLM_PYTHON))
    monkeypatch.setenv("OPENFORGE_VLLM_ARGS", f"--enforce-eager --max-model-len {MAX_MODEL_LEN}")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = make_engine("vllm", str(tiny_model_dir), policy_version=0)
    assert isinstance(engine, LocalVLLMEngine)

    async def go() -> tuple[GenerateResult, int, int | None]:
        await engine.start()
        try:
            pid = engine.server_pid
            version = await engine.load_weights(str(tiny_model_dir))
            result = await engine.generate(prompt, SamplingParams(temperature=0.7, max_tokens=16, seed=5))
            return result, version, pid
        finally:
            await engine.close()

    result, version, pid = asyncio.run(go())
    assert version == 1 and result.policy_version == 1 and len(result.completion_ids) > 0
    teacher.check(tiny_model_dir, prompt, result, 0.7)  # processed logprobs, at the trainer's T
    assert pid is not None and engine.server_pid is None
    deadline = time.monotonic() + 30  # the killed processes are reaped by init meanwhile
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(pid), "the server's process group outlived the engine"

    monkeypatch.setenv("OPENFORGE_VLLM_ARGS", "--no-such-vllm-option")
    broken = make_engine("vllm", str(tiny_model_dir))

    async def start_broken() -> None:
        try:
            await broken.start()
        finally:
            await broken.close()

    with pytest.raises(EngineUnavailable, match="exited with"):  # said as it exits, not at the timeout
        asyncio.run(start_broken())


@vllm
def test_length_stop_string_and_stop_token(vllm_server: Server, tokenizer: Any, prompt: list[int]) -> None:
    eos = set(eos_ids(vllm_server.model_dir))

    async def go(eng: VLLMEngine) -> None:
        ref = await plain_and_streamed(eng, prompt, SamplingParams(max_tokens=40, seed=11))
        assert ref.finish_reason == "length" and not eos & set(ref.completion_ids), "pick another seed"
        ids = ref.completion_ids

        short = await plain_and_streamed(eng, prompt, SamplingParams(max_tokens=5, seed=11))
        assert (short.completion_ids, short.finish_reason, short.stop_reason) == (ids[:5], "length", None)

        # A stop token id: generation ends on it, and it is kept as the last id.
        k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
        r = await plain_and_streamed(
            eng, prompt, SamplingParams(max_tokens=40, seed=11, stop_token_ids=(ids[k],))
        )
        assert (r.completion_ids, r.finish_reason, r.stop_reason) == (ids[: k + 1], "stop", ids[k])

        # A stop string: ids keep the whole token that completed it (only the text would be cut).
        for k in range(3, len(ids)):
            piece = tokenizer.decode([ids[k]]).strip()
            stop = piece[:2]
            if len(stop) == 2 and stop.isascii() and stop.isalnum():
                if stop not in tokenizer.decode(ids[:k]) and stop in tokenizer.decode(ids[: k + 1]):
                    break
        else:
            pytest.fail("no usable stop string in the reference completion")
        r = await plain_and_streamed(eng, prompt, SamplingParams(max_tokens=40, seed=11, stop=(stop,)))
        assert (r.completion_ids, r.finish_reason, r.stop_reason) == (ids[: k + 1], "stop", stop)

    run_engine(vllm_server.url, go)


@vllm
def test_seed_reproducibility(vllm_server: Server, prompt: list[int]) -> None:
    async def go(eng: VLLMEngine) -> list[GenerateResult]:
        return [await eng.generate(prompt, SamplingParams(max_tokens=32, seed=s)) for s in (5, 5, 6)]

    a, b, c = run_engine(vllm_server.url, go)
    assert (a.completion_ids, a.logprobs) == (b.completion_ids, b.logprobs)
    assert a.completion_ids != c.completion_ids


@vllm
def test_eight_concurrent_requests(vllm_server: Server, teacher: Teacher, prompt: list[int]) -> None:
    async def go(eng: VLLMEngine) -> tuple[list[GenerateResult], list[GenerateResult], float]:
        sampling = [SamplingParams(max_tokens=64, seed=100 + i) for i in range(8)]
        t0 = time.monotonic()
        together = await asyncio.gather(*(eng.generate(prompt, s) for s in sampling))
        elapsed = time.monotonic() - t0
        alone = [await eng.generate(prompt, s) for s in sampling[:2]]
        return list(together), alone, elapsed

    together, alone, elapsed = run_engine(vllm_server.url, go)
    tokens = sum(len(r.completion_ids) for r in together)
    print(f"8 concurrent requests: {tokens} tokens in {elapsed:.2f} s")
    assert len({tuple(r.completion_ids) for r in together}) == 8
    for r in together:
        teacher.check(vllm_server.model_dir, prompt, r, 1.0)
    # Seeded sampling does not depend on what else is in the batch.
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in together[:2]]


@vllm
def test_context_length(vllm_server: Server) -> None:
    async def go(eng: VLLMEngine) -> GenerateResult:
        with pytest.raises(ContextLengthExceeded):  # refused by the engine itself
            await eng.generate([5] * MAX_MODEL_LEN, SamplingParams())
        return await eng.generate([5] * (MAX_MODEL_LEN - 3), SamplingParams(max_tokens=100, seed=1))

    clamped = run_engine(vllm_server.url, go)
    assert len(clamped.completion_ids) <= 3

    async def server_side(eng: VLLMEngine) -> None:
        with pytest.raises(ContextLengthExceeded) as info:  # refused by vLLM, mapped by the engine
            await eng.generate([5] * (MAX_MODEL_LEN + 2), SamplingParams(max_tokens=1))
        assert (info.value.prompt_tokens, info.value.max_context) == (MAX_MODEL_LEN + 2, MAX_MODEL_LEN)

    run_engine(vllm_server.url, server_side, max_context=10 * MAX_MODEL_LEN)


def vllm_metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"vLLM reports no {name}")


@vllm
def test_cancellation_aborts_the_request(vllm_server: Server, prompt: list[int]) -> None:
    url = vllm_server.url
    max_tokens = MAX_MODEL_LEN - len(prompt)  # seconds of generating, with ignore_eos

    def generated() -> float:
        return vllm_metric(url, "vllm:generation_tokens_total")

    async def go(eng: VLLMEngine) -> tuple[float, float]:
        before = await asyncio.to_thread(generated)
        task = asyncio.create_task(eng.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=1)))
        # vLLM's counters may only move when a request ends, so they cannot say "it is generating";
        # on an idle machine the tiny model samples about 2,000 tokens in about a second: cancel early.
        await asyncio.sleep(0.2)
        assert not task.done(), "the request finished before it could be cancelled"
        task.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        while await asyncio.to_thread(vllm_metric, url, "vllm:num_requests_running") != 0:
            assert time.monotonic() - t0 < 5, "vLLM kept the cancelled request running"
            await asyncio.sleep(0.05)
        freed_s = time.monotonic() - t0
        stopped_at = await asyncio.to_thread(generated)
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(generated) == stopped_at, "vLLM kept generating"
        return freed_s, stopped_at - before

    # ignore_eos: the generation would run its full length unless aborted. On a loaded machine the
    # test's own loop can wake late, after vLLM already finished (~1 s of work): that attempt cannot
    # tell, so it is tried again; every attempt must still free the request and stop generating.
    for _ in range(3):
        freed_s, tokens = run_engine(url, go, extra_body={"ignore_eos": True})
        if tokens < max_tokens:
            break
    assert tokens < max_tokens
    print(f"vLLM freed the cancelled request {freed_s:.2f} s after the cancel, after {tokens:.0f} tokens")


@vllm
def test_cancelling_a_stream_aborts_the_request(vllm_server: Server, prompt: list[int]) -> None:
    """Tokens come while vLLM still generates (the first run is in hand long before the 2,000-token
    generation could end), and cancelling then closes the stream and frees the request."""
    url = vllm_server.url
    max_tokens = MAX_MODEL_LEN - len(prompt)

    def generated() -> float:
        return vllm_metric(url, "vllm:generation_tokens_total")

    async def go(eng: VLLMEngine) -> tuple[list[list[int]], float]:
        before = await asyncio.to_thread(generated)
        runs: list[list[int]] = []
        first = asyncio.Event()

        def sink(ids: Sequence[int]) -> None:
            runs.append(list(ids))
            first.set()

        sampling = SamplingParams(max_tokens=max_tokens, seed=1)
        task = asyncio.create_task(eng.generate(prompt, sampling, on_tokens=sink))
        # No sleep to guess at: cancel as soon as the first tokens are in.
        await asyncio.wait({task, asyncio.create_task(first.wait())}, return_when=asyncio.FIRST_COMPLETED)
        assert runs and not task.done(), "the request ended before its first tokens were handed on"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        t0 = time.monotonic()
        while await asyncio.to_thread(vllm_metric, url, "vllm:num_requests_running") != 0:
            assert time.monotonic() - t0 < 5, "vLLM kept the cancelled request running"
            await asyncio.sleep(0.05)
        stopped_at = await asyncio.to_thread(generated)
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(generated) == stopped_at, "vLLM kept generating"
        return runs, stopped_at - before

    runs, tokens = run_engine(url, go, extra_body={"ignore_eos": True})
    assert runs and tokens < max_tokens
    print(
        f"stream cancelled after {sum(map(len, runs))} streamed ids; vLLM stopped after {tokens:.0f} tokens"
    )


def eos_prone_checkpoint(src: Path, dst: Path, eos_id: int, prompt: list[int]) -> float:
    """A clearly different checkpoint whose model often ends its turn with `eos_id`; that probability.

    Only body weights change (the embedding is tied to the LM head, which vLLM's CPU backend does not
    reload): the last layer's v_proj bias adds a constant to the residual stream pointing the final
    hidden state at the EOS embedding, and the final norm's scale sharpens the logits until
    P(eos_id | prompt) is about 0.35 under a teacher-forced forward.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    cfg = model.config
    attn = model.model.layers[-1].self_attn
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    ids = torch.tensor([prompt])
    with torch.no_grad():
        norm = model.model.norm.weight
        target = model.get_input_embeddings().weight[eos_id] / norm
        # Attention adds o_proj(v_bias repeated over the query heads sharing each kv head) everywhere.
        repeat = torch.zeros(n_heads * hd, n_kv * hd)
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            repeat[h * hd : (h + 1) * hd, kv * hd : (kv + 1) * hd] = torch.eye(hd)
        bias = torch.linalg.lstsq(attn.o_proj.weight @ repeat, target[:, None]).solution[:, 0]
        attn.v_proj.bias += 100.0 * bias / bias.norm()  # dominates the residual stream
        base_norm = norm.clone()

        def p_eos(scale: float) -> float:
            norm.copy_(base_norm * scale)
            return float(torch.softmax(model(ids).logits[0, -1], -1)[eos_id])

        lo, hi = 1.0, 2.0
        while p_eos(hi) < 0.35 and hi < 1e4:
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if p_eos(mid) < 0.35 else (lo, mid)
        p = p_eos(hi)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, dst / f.name)
    return p


@vllm
def test_load_weights_and_eos(
    vllm_server: Server, teacher: Teacher, prompt: list[int], work_dir: Path
) -> None:
    base_dir = vllm_server.model_dir
    eos = eos_ids(base_dir)[0]  # the tokenizer's EOS (vLLM reports stop_reason null for it)
    new_dir = work_dir / "eos-prone"
    new_dir.mkdir()
    p_eos = eos_prone_checkpoint(base_dir, new_dir, eos, prompt)
    assert 0.2 < p_eos < 0.6
    greedy = SamplingParams(temperature=0.0, max_tokens=8)

    async def go(eng: VLLMEngine) -> dict[str, Any]:
        out: dict[str, Any] = {"before": await eng.generate(prompt, greedy)}
        t0 = time.monotonic()
        out["version"] = await eng.load_weights(str(new_dir))
        out["reload_s"] = time.monotonic() - t0
        out["greedy"] = await plain_and_streamed(eng, prompt, greedy)  # stops on EOS, streamed too
        samples = [SamplingParams(max_tokens=64, seed=s) for s in range(16)]
        out["sampled"] = await asyncio.gather(*(eng.generate(prompt, s) for s in samples))
        out["streamed"] = [await plain_and_streamed(eng, prompt, s) for s in samples[:4]]
        out["restored"] = await eng.load_weights(str(base_dir))
        out["after"] = await eng.generate(prompt, greedy)
        return out

    out = run_engine(vllm_server.url, go)
    print(f"reload_weights + reset_prefix_cache took {out['reload_s']:.2f} s")
    assert out["version"] == 1 and out["greedy"].policy_version == 1
    # The new weights answer differently: EOS is the most likely first token.
    assert out["greedy"].completion_ids == [eos] != out["before"].completion_ids
    assert (out["greedy"].finish_reason, out["greedy"].stop_reason) == ("stop", eos)
    teacher.check(new_dir, prompt, out["greedy"], 1.0)
    # Sampled turns end on EOS; it is in completion_ids, with its logprob, and is the stop_reason.
    ended = [r for r in out["sampled"] if r.finish_reason == "stop"]
    assert len(ended) >= 8, [r.finish_reason for r in out["sampled"]]
    for r in ended:
        assert r.completion_ids[-1] == eos == r.stop_reason
        assert eos not in r.completion_ids[:-1]
        teacher.check(new_dir, prompt, r, 1.0)
    for r in out["sampled"]:
        if r.finish_reason == "length":
            teacher.check(new_dir, prompt, r, 1.0)
    assert any(r.finish_reason == "stop" for r in out["streamed"])  # an EOS stop went through a stream
    # Back to the original weights: the original greedy answer again, with the prefix cache reset.
    assert out["restored"] == 2 and out["after"].policy_version == 2
    assert out["after"].completion_ids == out["before"].completion_ids
    teacher.check(base_dir, prompt, out["after"], 1.0)


@vllm
def test_reload_of_a_tied_embedding(
    vllm_server: Server, teacher: Teacher, prompt: list[int], work_dir: Path
) -> None:
    """vLLM 0.32's CPU backend keeps a tied LM head's packed copy over a plain reload_weights; the
    engine reloads a tied checkpoint through a view that names the head's tensor (`tied_head_view`),
    so the new head is served. The plain reload is pinned in tests/engines/test_real_model_vllm.py."""
    import torch
    from transformers import AutoModelForCausalLM

    base_dir = vllm_server.model_dir
    new_dir = work_dir / "new-embedding"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    embedding: Any = model.get_input_embeddings()
    with torch.no_grad():
        embedding.weight.mul_(3.0)  # sharper logits everywhere (tied head)
    model.save_pretrained(new_dir)

    async def go(eng: VLLMEngine) -> GenerateResult:
        await eng.load_weights(str(new_dir))
        try:
            return await eng.generate(prompt, SamplingParams(max_tokens=16, seed=4))
        finally:
            await eng.load_weights(str(base_dir))

    r = run_engine(vllm_server.url, go)
    teacher.check(new_dir, prompt, r, 1.0)


@vllm
def test_reload_during_generation_is_flagged(vllm_server: Server, prompt: list[int]) -> None:
    async def go(eng: VLLMEngine) -> tuple[GenerateResult, int]:
        task = asyncio.create_task(eng.generate(prompt, SamplingParams(max_tokens=1500, seed=1)))
        # Reload while it generates: the task runs to its first request and the reload starts at
        # once. A fixed wait raced the generation: an idle CPU sampled this tiny model's 1,500
        # tokens before 50 ms were up, and the reload came after it (a CI run, 2026-12-07).
        await asyncio.sleep(0)
        version = await eng.load_weights(str(vllm_server.model_dir))  # same weights, new version
        return await task, version

    r, version = run_engine(vllm_server.url, go, extra_body={"ignore_eos": True}, policy_version=10)
    assert version == 11
    # 11 whether the reload finished before the generation did or was still in flight (on a busy
    # machine it can take longer than the 1,500 tokens): either way the weights may have changed.
    assert (r.policy_version, r.extra.get("policy_version_end")) == (10, 11)
    assert len(r.completion_ids) == 1500


@vllm
def test_bad_weights_path_is_refused_before_it_reaches_vllm(vllm_server: Server, work_dir: Path) -> None:
    """vLLM 0.32 shuts down when asked to reload from a path without weights; the engine checks first."""

    async def go(eng: VLLMEngine) -> None:
        with pytest.raises(EngineError, match="holds no"):
            await eng.load_weights(str(work_dir))  # it holds only the server's log
        assert eng.policy_version == 0

    run_engine(vllm_server.url, go)
    assert httpx.get(f"{vllm_server.url}/health", timeout=5).status_code == 200


# ---------------------------------------------------------------------------------------------
# Weight updates in place from the trainer, on a second server: an untied copy of the tiny model
# (the path without the engine's tied-head view; tests/engines/test_real_model_vllm.py pushes into a
# tied one).

# vLLM's float32 CPU kernels against the trainer's float32 forward (measured max |diff| about 2e-5).
PUSH_TOL = 1e-3


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir: Path, work_dir: Path) -> Path:
    """The tiny model with an LM head of its own (tie_word_embeddings False), equal to the embedding."""
    import torch
    from transformers import AutoModelForCausalLM

    dst = work_dir / "untied"
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(dst)
    for f in tiny_model_dir.iterdir():  # tokenizer, chat template
        if not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is False
    return dst


@pytest.fixture(scope="module")
def untied_server(untied_model_dir: Path, work_dir: Path) -> Iterator[Server]:
    with serve_vllm(untied_model_dir, work_dir / "server-untied.log") as server:
        yield server


def _sample(prompt: list[int], r: GenerateResult, rollout_id: str) -> Any:
    from openforgerl.rollouts.trajectory import NO_VERSION, Sample

    n = len(r.completion_ids)
    return Sample(
        rollout_id=rollout_id,
        reward=0.0,
        branch_id=0,
        branch_reason="",
        input_ids=prompt + r.completion_ids,
        loss_mask=[0] * len(prompt) + [1] * n,
        logprobs=[0.0] * len(prompt) + r.logprobs,
        policy_versions=[NO_VERSION] * len(prompt) + [r.policy_version] * n,
    )


@vllm
def test_a_trainer_step_pushed_into_vllm_gives_the_trainers_logprobs(
    untied_server: Server, tokenizer: Any, prompt: list[int], work_dir: Path
) -> None:
    """One GRPO step of the embedded trainer on completions vLLM sampled, saved and pushed in place:
    vLLM's logprobs for a fixed prompt are then the trainer's, and both versions went up by one."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from openforgerl.rl.trainer import Rollout, Trainer, TrainerConfig

    base = untied_server.model_dir
    other = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Read a.txt and b.txt."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    trainer = Trainer(base, TrainerConfig(lr=5e-3), group_size=2)
    checkpoint = work_dir / "grpo-step"

    async def go(eng: VLLMEngine) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # The server's weights are whatever earlier tests left: load the base, as `openforge train`
        # does, from one version back, so the engine's version is the trainer's (0).
        assert await eng.load_weights(str(base)) == trainer.policy_version == 0
        behaviour = [
            (p, await eng.generate(p, SamplingParams(temperature=1.0, max_tokens=24, seed=seed)))
            for p in (prompt, other)
            for seed in (1, 2)
        ]
        # Groups of two per prompt with a toy reward (the first sample wins): advantages of +-1.
        rollouts = [
            Rollout(f"prompt{k // 2}", 1.0 - k % 2, [_sample(p, r, f"r{k}")])
            for k, (p, r) in enumerate(behaviour)
        ]
        metrics = trainer.train_step(rollouts)
        trainer.save(checkpoint, metrics=metrics)
        out["metrics"], out["behaviour"] = metrics, behaviour
        t0 = time.monotonic()
        out["version"] = await trainer.push_weights(eng, checkpoint)
        out["push_s"] = time.monotonic() - t0
        out["after"] = await eng.generate(prompt, SamplingParams(temperature=1.0, max_tokens=32, seed=9))
        return out

    out = run_engine(untied_server.url, go, policy_version=-1)
    metrics, after = out["metrics"], out["after"]
    assert all(r.policy_version == 0 for _, r in out["behaviour"])
    assert metrics["updated"] is True and metrics["samples"] == 4
    # The behaviour logprobs (vLLM's) were the trainer's own before the step: IS weights of 1.
    assert metrics["is_weight_min"] == pytest.approx(1.0, abs=PUSH_TOL)
    assert metrics["is_weight_max"] == pytest.approx(1.0, abs=PUSH_TOL)
    # Versions: one up on both sides, and the calls after the push carry the new one.
    assert trainer.policy_version == 1 == out["version"] == after.policy_version
    assert json.loads((checkpoint / "trainer_state.json").read_text())["policy_version"] == 1

    ids = after.completion_ids
    recomputed = trainer.policy.sample_logprobs([_sample(prompt, after, "fixed")])[0][len(prompt) :]
    diff = max(abs(a - b) for a, b in zip(after.logprobs, recomputed, strict=True))
    # Not vacuous: the old weights, or the new ones with the old LM head (what a stale head would
    # serve), score these tokens far off.
    base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    old = forced_logprobs(base_model, prompt, ids)
    stale_head = copy.deepcopy(trainer.policy.model).eval()
    with torch.no_grad():
        stale_head.lm_head.weight.copy_(base_model.lm_head.weight)
    stale = forced_logprobs(stale_head, prompt, ids)
    old_diff = max(abs(a - b) for a, b in zip(after.logprobs, old, strict=True))
    stale_diff = max(abs(a - b) for a, b in zip(after.logprobs, stale, strict=True))
    print(
        f"after a pushed step, {len(ids)} tokens: max |vLLM - trainer| = {diff:.2e}; against the old "
        f"weights {old_diff:.2e}, against an old LM head {stale_diff:.2e}; push {out['push_s']:.2f} s"
    )
    assert diff < PUSH_TOL, (diff, ids)
    assert old_diff > 20 * PUSH_TOL and stale_diff > 20 * PUSH_TOL


def _call_versions(gateway_db: Path) -> dict[str, set[int]]:
    """The policy versions of every recorded call, by runner run id (RUN-stepN)."""
    import sqlite3

    with sqlite3.connect(gateway_db) as db:
        rows = db.execute(
            "SELECT r.run_id, c.policy_version FROM calls c JOIN rollouts r ON r.id = c.rollout_id"
        ).fetchall()
    out: dict[str, set[int]] = {}
    for run_id, version in rows:
        out.setdefault(run_id, set()).add(version)
    return out


@vllm
def test_openforge_train_against_vllm_and_resume(untied_server: Server, work_dir: Path) -> None:
    """`openforge train --engine vllm:URL`: two steps, then --resume to a third. Each step's calls carry
    the version of the weights pushed after the step before, the resumed run's included (it pushes
    its last checkpoint first), and the run folder is given relative (the server gets absolute paths)."""
    import sys

    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "openforgerl.cli", "train", "--out", "train-run"]
    first = [
        *["--engine", f"vllm:{untied_server.url}", "--model", str(untied_server.model_dir)],
        *["--steps", "2", "--group", "2", "--batch-tasks", "1", "--lr", "1e-3"],
        # A random model never earns a reward: train on the (all-zero) groups anyway, so versions advance.
        *["--max-tokens", "12", "--max-turns", "2", "--concurrency", "2", "--keep-zero-variance"],
    ]
    t0 = time.monotonic()
    for extra in (first, ["--resume", "--steps", "3"]):
        done = subprocess.run(
            argv + extra, cwd=work_dir, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
    seconds = time.monotonic() - t0
    run = work_dir / "train-run"
    assert "3 steps, policy version 3" in done.stdout
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["policy_version"]) for m in logged] == [(1, 1), (2, 2), (3, 3)]
    assert json.loads((run / "run.json").read_text())["engine"] == f"vllm:{untied_server.url}"
    # Step k's calls came from the weights of step k - 1 (version 0: the starting model, pushed first).
    assert _call_versions(run / "gateway.db") == {f"train-run-step{k}": {k - 1} for k in (1, 2, 3)}
    pushes = [m["time/push"] for m in logged]
    print(f"openforge train --engine vllm: 3 steps (2 + 1 resumed) in {seconds:.1f} s; pushes {pushes}")
