"""A FAKE SGLang server: SGLang's native HTTP wire format in front of any Engine (tests only).

SGLang has no CPU build on this project's machines, so `SGLangEngine` is tested against this fake.
It is not SGLang and samples nothing itself: `/generate` hands the request to the Engine it wraps
(a ScriptedEngine, or the built-in transformers engine for real tokens) and answers in SGLang's shape:

    POST /generate {"input_ids": [...], "sampling_params": {...}, "return_logprob": true,
                    "image_data": [data URL, ...] (optional)}
      -> {"text": ..., "output_ids": [...],
          "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", "matched"|"length"|
                        "message": ...}, "prompt_tokens", "completion_tokens", "cached_tokens",
                        "output_token_logprobs": [[logprob, id, null], ...], "weight_version"}}
    POST /generate {..., "stream": true}
      -> text/event-stream, one `data: {...}` event per sampled id in the same shape, then
         `data: [DONE]`. Like SGLang by default each event holds everything so far (`output_ids` and
         `output_token_logprobs` cumulative, `meta_info.completion_tokens` the count so far, `text` so
         far); with `incremental_streaming_output=True` (SGLang's `--incremental-streaming-output`)
         only the new part. `finish_reason` is null until the last event.
    GET  /health, GET /get_model_info, POST /update_weights_from_disk {"model_path": ...}

The wrapped engine generates the whole answer first; the stream then sends it one id per event
(`stream_delay_s` apart). Tests steer a stream through the state: `hold_after` pauses it after that
many ids until `resume` is set, `die_after` drops the connection after that many ids (a server that
died), and a stream the client leaves counts as aborted.

Like SGLang it trims a matched stop token from `output_ids` (and a stop string from the text) unless
`no_stop_trim` is set, keeps logprob entries untrimmed, answers refused requests with 400
{"error": {"message": ...}}, and aborts the generation when the client disconnects. Engine errors
become: EngineOverloaded -> 429 (what SGLang's router sends), EngineUnavailable -> 503, other
EngineErrors -> 400; any other exception is a 500, as from SGLang's own server.

Every request body is kept in `app.state.fake.requests` so tests can check the wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from openforgerl.engines.base import (
    Engine,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)
from openforgerl.images import Image, ImageError, image_from_data_url


@dataclass
class FakeSGLangState:
    """What the fake server saw and did; toggle `healthy` to make `/health` answer 503."""

    healthy: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)
    generated: int = 0
    aborted: int = 0  # generations cancelled because the client went away
    weight_updates: list[str] = field(default_factory=list)
    # Streams: pause after `hold_after` ids until `resume` is set; drop the connection after `die_after`.
    hold_after: int | None = None
    resume: threading.Event = field(default_factory=threading.Event)
    die_after: int | None = None
    streamed: int = 0  # ids sent in stream events, all streams together


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, int)):
        return [value]
    return list(value)


def fake_sglang_app(
    engine: Engine,
    *,
    model_path: str = "fake-sglang-model",
    context_length: int = 4096,
    decode: Callable[[Sequence[int]], str] | None = None,
    manage_engine: bool = True,
    incremental_streaming_output: bool = False,
    stream_delay_s: float = 0.0,
) -> Starlette:
    """A Starlette app that fakes SGLang's native API over `engine`.

    Args:
        engine: the Engine that does the generating.
        model_path: what `/get_model_info` reports.
        context_length: prompts and prompt + max_new_tokens beyond this are refused with SGLang's 400s.
        decode: ids -> text for the `text` field (empty text without it).
        manage_engine: start the engine on startup and close it on shutdown.
        incremental_streaming_output: stream only the new part in each event (SGLang's
            `--incremental-streaming-output`); by default each event holds everything so far.
        stream_delay_s: seconds between stream events.
    """
    fake = _FakeSGLang(
        engine, model_path, context_length, decode, incremental_streaming_output, stream_delay_s
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            await engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.close()

    app = Starlette(
        routes=[
            Route("/health", fake.health, methods=["GET"]),
            Route("/get_model_info", fake.get_model_info, methods=["GET"]),
            Route("/generate", fake.generate, methods=["POST", "PUT"]),
            Route("/update_weights_from_disk", fake.update_weights_from_disk, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.state.fake = fake.state
    return app


@dataclass
class _FakeSGLang:
    """The fake server's endpoints over one engine (`fake_sglang_app`'s arguments)."""

    engine: Engine
    model_path: str
    context_length: int
    decode: Callable[[Sequence[int]], str] | None
    incremental_streaming_output: bool
    stream_delay_s: float
    state: FakeSGLangState = field(default_factory=FakeSGLangState)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.state.healthy else 503)

    async def get_model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": str(self.engine.policy_version),
                "fake": True,
            }
        )

    def _too_long(self, prompt: list[int], max_new: int) -> JSONResponse | None:
        """SGLang's refusals of a prompt past the context, in its own wording (clients recognise it)."""
        context_length = self.context_length
        if len(prompt) >= context_length:
            return _error(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({context_length} tokens).",
                400,
            )
        if len(prompt) + max_new >= context_length:  # SGLang's own test: it does not clamp
            return _error(
                f"Requested token count exceeds the model's maximum context length of {context_length} "
                f"tokens. You requested a total of {len(prompt) + max_new} tokens: {len(prompt)} tokens "
                f"from the input messages and {max_new} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit.",
                400,
            )
        return None

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.state.requests.append(body)
        prompt = body.get("input_ids")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return _error("the fake SGLang server needs input_ids (a list of ints)", 400)
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        refused = self._too_long(prompt, max_new)
        if refused is not None:
            return refused
        try:
            images = [image_from_data_url(u) for u in _as_list(body.get("image_data"))]
        except ImageError as e:
            return _error(f"image_data: {e}", 400)
        sampling = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            max_tokens=max_new,
            stop=tuple(_as_list(sp.get("stop"))),
            stop_token_ids=tuple(int(t) for t in _as_list(sp.get("stop_token_ids"))),
            seed=sp.get("sampling_seed"),
        )
        try:
            result = await _generate_unless_disconnected(
                request, self.engine, prompt, sampling, images, self.state
            )
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it; the connection is gone
        except EngineOverloaded as e:
            return _error(str(e), 429, {"Retry-After": f"{e.retry_after:g}"})
        except EngineUnavailable as e:
            return _error(str(e), 503, {"Retry-After": f"{e.retry_after:g}"})
        except EngineError as e:
            return _error(str(e), 400)
        self.state.generated += 1
        answer = _sglang_answer(body, prompt, result, self.decode, max_new)
        if body.get("stream"):
            events = _stream_events(answer, result, self.decode, self.incremental_streaming_output)
            return StreamingResponse(
                _send_events(events, self.state, self.stream_delay_s), media_type="text/event-stream"
            )
        return JSONResponse(answer)

    async def update_weights_from_disk(self, request: Request) -> Response:
        body = await request.json()
        path = body.get("model_path")
        if not isinstance(path, str):
            return JSONResponse(
                {"success": False, "message": "model_path is required", "num_paused_requests": 0}, 400
            )
        try:
            version = await self.engine.load_weights(path)
        except EngineError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, 400)
        self.state.weight_updates.append(path)
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to update model weights (fake SGLang, version {version}).",
                "num_paused_requests": 0,
            }
        )


class _ClientGone(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (when the client leaves).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _generate_unless_disconnected(
    request: Request,
    engine: Engine,
    prompt: list[int],
    sampling: SamplingParams,
    images: list[Image],
    state: FakeSGLangState,
) -> GenerateResult:
    """Run the generation, cancelling it if the client disconnects first (as SGLang aborts it)."""
    gen = asyncio.ensure_future(engine.generate(prompt, sampling, images))
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({gen, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if gen.done():
        return gen.result()
    gen.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await gen
    state.aborted += 1
    raise _ClientGone


def _stream_events(
    answer: dict[str, Any],
    result: GenerateResult,
    decode: Callable[[Sequence[int]], str] | None,
    incremental: bool,
) -> list[dict[str, Any]]:
    """`answer` as SGLang streams it: one event per sampled id, cumulative or incremental."""
    meta = answer["meta_info"]
    ids, out_ids, entries = result.completion_ids, answer["output_ids"], meta.get("output_token_logprobs")
    events = []
    for k in range(1, len(ids) + 1):
        start = k - 1 if incremental else 0
        last = k == len(ids)
        event_meta = {
            **meta,
            "finish_reason": meta["finish_reason"] if last else None,
            "completion_tokens": k,
        }
        if entries is not None:
            event_meta["output_token_logprobs"] = entries[start:k]
        text = answer["text"] if last and not incremental else (decode(ids[start:k]) if decode else "")
        events.append({"text": text, "output_ids": out_ids[start:k], "meta_info": event_meta})
    if not ids:
        events.append(answer)
    return events


async def _send_events(
    events: list[dict[str, Any]], state: FakeSGLangState, delay_s: float
) -> AsyncIterator[bytes]:
    try:
        for n, event in enumerate(events):
            if n and delay_s:
                await asyncio.sleep(delay_s)
            if state.hold_after is not None and n == state.hold_after:
                # Polled: the test sets it from another thread; a cancelled stream must not leave a
                # thread blocked in wait().
                while not state.resume.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            if state.die_after is not None and n == state.die_after:
                raise RuntimeError("the fake SGLang server died mid-stream")
            yield b"data: " + orjson.dumps(event) + b"\n\n"
            state.streamed += 1
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        state.aborted += 1  # Starlette cancels the stream when the client disconnects
        raise


def _sglang_answer(
    body: dict[str, Any],
    prompt: list[int],
    result: GenerateResult,
    decode: Callable[[Sequence[int]], str] | None,
    max_new: int,
) -> dict[str, Any]:
    sp = body.get("sampling_params") or {}
    ids = list(result.completion_ids)
    if result.finish_reason == "length":
        finish: dict[str, Any] = {"type": "length", "length": max_new}
    elif result.finish_reason == "abort":
        finish = {"type": "abort", "message": "aborted by the engine"}
    else:
        # SGLang names the EOS / stop id / stop string matched; an engine that gave no reason
        # stopped on its EOS, the last id.
        matched = result.stop_reason if result.stop_reason is not None else (ids[-1] if ids else None)
        finish = {"type": "stop", "matched": matched}
    output_ids = ids
    text = decode(ids) if decode is not None else ""
    if not sp.get("no_stop_trim", False) and finish["type"] == "stop":
        matched = finish["matched"]
        if isinstance(matched, int) and ids and ids[-1] == matched:
            output_ids = ids[:-1]
            text = decode(output_ids) if decode is not None else ""
        elif isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": str(result.policy_version),
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, ids, strict=True)]
    return {"text": text, "output_ids": output_ids, "meta_info": meta}
