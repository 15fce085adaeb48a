"""A ZERO-LATENCY FAKE inference engine for the gateway-overhead benchmark (not a model: it samples nothing).

It answers at once, always with the same completion (a `read_file` tool call, about 25 tokens):

- `POST /v1/completions` in vLLM's shape for token-id prompts (what OpenForgeRL's `vllm:URL` engine
  sends): `choices[0].token_ids`, `choices[0].logprobs.token_logprobs`, `finish_reason`,
  `prompt_token_ids` (the prompt echoed back, as vLLM does with `return_token_ids`). With
  `"stream": true`, as vLLM 0.32 streams it: one SSE event per token (`choices[0].token_ids` holding
  that token, its `logprobs.token_logprobs`, `finish_reason` null until the last event,
  `prompt_token_ids` on the first), a usage event when `stream_options.include_usage`, then
  `data: [DONE]`.
- `POST /v1/chat/completions`, OpenAI's shape, streaming (one SSE event per completion token, sent one
  by one as an engine would) or not: for the direct baseline and for LiteLLM.
- `GET /v1/models` (with a large `max_model_len`), `GET /health`.

It parses every request body, as a real server must, and nothing else. Raw ASGI on uvicorn (uvloop,
httptools), one process.

`--token-delay-ms D` makes it decode at a known pace instead: each completion token takes D ms, so
a stream's first token comes D ms after the request and a plain answer n * D ms after it (n tokens,
both endpoints); `GET /stats` reports D and n, for a time-to-first-token measured against one decode
step. The default, 0, answers at once as before.

    python benchmarks/fake_engine.py --port 9000 --completion-ids '[1, 2, 3]' [--token-delay-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import uvicorn

from workload import FAKE_ARGUMENTS, FAKE_COMPLETION_TEXT, FAKE_MODEL, FAKE_TOOL

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class FakeEngine:
    def __init__(
        self, completion_ids: list[int], stream_chunks: int, max_model_len: int, token_delay_ms: float = 0.0
    ) -> None:
        self.completion_ids = completion_ids
        self.token_delay_s = token_delay_ms / 1000
        self.logprobs = [-0.25] * len(completion_ids)
        self.stream_chunks = max(1, stream_chunks)
        self.max_model_len = max_model_len
        self.requests = 0
        args = orjson.dumps(FAKE_ARGUMENTS).decode()
        self.arguments = args
        # The arguments split into pieces: one SSE event per completion token, about.
        n = max(1, self.stream_chunks - 1)
        step = max(1, -(-len(args) // n))
        self.argument_pieces = [args[i : i + step] for i in range(0, len(args), step)]
        # The completion text split over the completion's tokens, for the streamed /v1/completions.
        n_ids = max(1, len(completion_ids))
        step = max(1, -(-len(FAKE_COMPLETION_TEXT) // n_ids))
        pieces = [FAKE_COMPLETION_TEXT[i : i + step] for i in range(0, len(FAKE_COMPLETION_TEXT), step)]
        self.text_pieces = (pieces + [""] * n_ids)[:n_ids]

    async def decode(self, tokens: int) -> None:
        """The time `tokens` decode steps take (none by default)."""
        if self.token_delay_s and tokens:
            await asyncio.sleep(self.token_delay_s * tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        self.requests += 1
        if method == "POST":
            body = await _read_body(receive)
            try:
                data = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError:
                await _json(
                    send, 400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}}
                )
                return
            if path == "/v1/completions":
                await self.completions(send, data)
                return
            if path == "/v1/chat/completions":
                await self.chat(send, data, len(body))
                return
        elif path == "/health":
            await _json(send, 200, {})
            return
        elif path == "/v1/models":
            await _json(
                send,
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": FAKE_MODEL,
                            "object": "model",
                            "owned_by": "fake",
                            "max_model_len": self.max_model_len,
                        }
                    ],
                },
            )
            return
        elif path == "/stats":
            stats = {
                "requests": self.requests,
                "token_delay_ms": self.token_delay_s * 1000,
                "completion_tokens": len(self.completion_ids),
            }
            await _json(send, 200, stats)
            return
        await _json(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})

    async def completions(self, send: Send, data: dict[str, Any]) -> None:
        prompt = data.get("prompt")
        prompt_ids = prompt if isinstance(prompt, list) else []
        ids = self.completion_ids
        if data.get("stream"):
            await self.completions_stream(send, data, prompt_ids)
            return
        await self.decode(len(ids))
        await _json(
            send,
            200,
            {
                "id": f"cmpl-fake-{self.requests}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": data.get("model", FAKE_MODEL),
                "choices": [
                    {
                        "index": 0,
                        "text": FAKE_COMPLETION_TEXT,
                        "logprobs": {"token_logprobs": self.logprobs, "tokens": None, "top_logprobs": None},
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "token_ids": ids,
                        "prompt_token_ids": prompt_ids,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt_ids) + len(ids),
                },
            },
        )

    async def completions_stream(self, send: Send, data: dict[str, Any], prompt_ids: list[Any]) -> None:
        """vLLM 0.32's stream of a token-id prompt with `return_token_ids`: one event per token."""
        cid, created, model = f"cmpl-fake-{self.requests}", int(time.time()), data.get("model", FAKE_MODEL)
        ids = self.completion_ids
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for i, (token, lp) in enumerate(zip(ids, self.logprobs, strict=True)):
            await self.decode(1)
            last = i == len(ids) - 1
            choice = {
                "index": 0,
                "text": self.text_pieces[i],
                "logprobs": {
                    "text_offset": [0],
                    "token_logprobs": [lp],
                    "tokens": [self.text_pieces[i]],
                    "top_logprobs": None,
                },
                "finish_reason": "stop" if last else None,
                "stop_reason": None,
                "prompt_token_ids": None if i else prompt_ids,
                "token_ids": [token],
            }
            chunk = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
        tail = b""
        options = data.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt_ids) + len(ids),
            }
            tail = _event(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            )
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})

    async def chat(self, send: Send, data: dict[str, Any], body_len: int) -> None:
        model = str(data.get("model", FAKE_MODEL))
        created = int(time.time())
        cid = f"chatcmpl-fake-{self.requests}"
        call_id = f"call_fake{self.requests:08d}"
        usage = {
            "prompt_tokens": body_len // 4,
            "completion_tokens": len(self.completion_ids),
            "total_tokens": body_len // 4 + len(self.completion_ids),
        }
        if not data.get("stream"):
            await self.decode(len(self.completion_ids))
            await _json(
                send,
                200,
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": None,
                                "tool_calls": [
                                    {
                                        "id": call_id,
                                        "type": "function",
                                        "function": {"name": FAKE_TOOL, "arguments": self.arguments},
                                    }
                                ],
                            },
                            "finish_reason": "tool_calls",
                            "logprobs": None,
                        }
                    ],
                    "usage": usage,
                },
            )
            return

        def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
            chunk = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await emit(event({"role": "assistant", "content": None}))
        await self.decode(1)  # the tool call's name: the first token
        await emit(
            event(
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": FAKE_TOOL, "arguments": ""},
                        }
                    ]
                }
            )
        )
        # The other tokens' decode steps spread over the argument pieces.
        steps = max(0, len(self.completion_ids) - 1)
        for i, piece in enumerate(self.argument_pieces):
            share = steps * (i + 1) // len(self.argument_pieces) - steps * i // len(self.argument_pieces)
            await self.decode(share)
            await emit(event({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        tail = event({}, "tool_calls")
        options = data.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            usage_chunk = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            tail += b"data: " + orjson.dumps(usage_chunk) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _json(send: Send, status: int, content: Any) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS})
    await send({"type": "http.response.body", "body": orjson.dumps(content)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--completion-ids",
        required=True,
        help="JSON list: the token ids of FAKE_COMPLETION_TEXT plus the turn-end id (for /v1/completions).",
    )
    ap.add_argument(
        "--stream-chunks",
        type=int,
        default=0,
        help="SSE events carrying the completion on /v1/chat/completions (default: one per token).",
    )
    ap.add_argument("--max-model-len", type=int, default=1 << 20)
    ap.add_argument(
        "--token-delay-ms",
        type=float,
        default=0.0,
        help="ms each completion token takes to decode (default 0: answer at once); GET /stats reports it",
    )
    args = ap.parse_args()
    ids = [int(i) for i in orjson.loads(args.completion_ids)]
    app = FakeEngine(ids, args.stream_chunks or len(ids), args.max_model_len, args.token_delay_ms)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        backlog=4096,
        timeout_keep_alive=300,
    )


if __name__ == "__main__":
    main()
