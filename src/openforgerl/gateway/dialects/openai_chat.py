"""OpenAI Chat Completions: wire models, and the translation to and from a `Conversation`."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request

from openforgerl.conversation import Conversation, Message, SamplingRequest, Tool, ToolCall, parse_arguments
from openforgerl.engines.parsers import Delta
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome, PreparedCall
from openforgerl.gateway.dialects import MAX_MESSAGES, MAX_TOOLS, Seed, validated
from openforgerl.gateway.errors import GatewayError, bad_request, load_image
from openforgerl.images import Image, image_from_data_url, image_from_file, image_from_url
from openforgerl.jsonutil import dumps

NAME = "openai"
Decode = Callable[[Sequence[int]], str]


class _Wire(BaseModel):
    # Harnesses send many fields this gateway has no use for; they are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Wire):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallWire(_Wire):
    id: str = ""
    type: str = "function"
    function: FunctionCall


class ImageURL(_Wire):
    url: str
    detail: str | None = None  # the model sees the image as sent, whatever the detail asked


class FileRef(_Wire):
    file_id: str | None = None
    file_data: str | None = None  # a data URL
    filename: str | None = None


class ContentPart(_Wire):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    file: FileRef | None = None


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class StreamOptions(_Wire):
    include_usage: bool = False


class ResponseFormat(_Wire):
    """OpenAI's three shapes; a json_schema one names its schema. Other keys go on to the engine."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and not self.json_schema:
            raise ValueError("a json_schema response_format needs its 'json_schema' object")
        return self


class ChatCompletionRequest(_Wire):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)  # not "10", not true
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Extension (as in vLLM): also return the prompt and completion token ids.
    return_token_ids: bool = False


def _image(part: ContentPart, files: Mapping[str, Image], where: str) -> Image:
    if part.type == "image_url":
        url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
        if not url:
            raise bad_request("An image_url part needs its 'image_url.url'.", param=f"{where}.image_url")
        return load_image(lambda: image_from_url(url, files), f"{where}.image_url.url")
    ref = part.file
    if ref is not None and ref.file_id:
        file_id = ref.file_id
        return load_image(lambda: image_from_file(file_id, files), f"{where}.file.file_id")
    if ref is not None and ref.file_data:
        data = ref.file_data
        return load_image(lambda: image_from_data_url(data), f"{where}.file.file_data")
    raise bad_request("A file part needs 'file.file_id' or 'file.file_data'.", param=f"{where}.file")


def _content(
    content: str | list[ContentPart] | None, files: Mapping[str, Image], where: str
) -> tuple[str, list[Image]]:
    """A message's text (its text parts joined) and its images, in the order sent."""
    if content is None or isinstance(content, str):
        return content or "", []
    texts: list[str] = []
    images: list[Image] = []
    for i, part in enumerate(content):
        if part.type in ("text", "input_text"):
            texts.append(part.text or "")
        elif part.type in ("image_url", "file"):
            images.append(_image(part, files, f"{where}.content.{i}"))
        else:
            raise bad_request(
                f"Content part type '{part.type}' is not supported by this gateway: send text, image_url "
                "or file (image) parts.",
                param=f"{where}.content.{i}.type",
            )
    return "".join(texts), images


def _invalid(exc: ValidationError) -> GatewayError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "json_invalid":
        return bad_request(f"The request body is not valid JSON: {err['msg']}")
    return bad_request(f"Invalid value for '{loc}': {err['msg']}", param=loc or None)


def parse_request(
    body: bytes, files: Mapping[str, Image] | None = None
) -> tuple[Conversation, ChatCompletionRequest]:
    """The body as a Conversation (and the validated wire request); GatewayError 400 if malformed."""
    req = validated(ChatCompletionRequest, body, _invalid)
    if req.n != 1:
        raise bad_request("Only n=1 is supported: send one request per sample.", param="n")
    messages = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        calls = [
            ToolCall(c.function.name, parse_arguments(c.function.arguments), c.id) for c in m.tool_calls or []
        ]
        text, images = _content(m.content, files or {}, f"messages.{i}")
        if images and role == "assistant":
            raise bad_request(
                "Images are not supported in assistant messages: a model's answer is text.",
                param=f"messages.{i}.content",
            )
        messages.append(
            Message(
                role=role,
                content=text,
                images=images,
                reasoning=m.reasoning_content or m.reasoning or "",
                tool_calls=calls,
                tool_call_id=m.tool_call_id or "",
                name=m.name or "",
            )
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    conv = Conversation(
        model=req.model,
        messages=messages,
        tools=[
            Tool(t.function.name, t.function.description or "", t.function.parameters or {})
            for t in req.tools or []
        ],
        tool_choice=req.tool_choice,
        response_format=req.response_format.model_dump(exclude_none=True) if req.response_format else None,
        sampling=SamplingRequest(
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            stop=stop,
            seed=req.seed,
        ),
        stream=req.stream,
        dialect=NAME,
    )
    return conv, req


def _tool_calls(message: Message) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {
                "name": c.name,
                "arguments": c.arguments if isinstance(c.arguments, str) else dumps(c.arguments).decode(),
            },
        }
        for c in message.tool_calls
    ]


def _usage(out: CallOutcome) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def _fingerprint(out: CallOutcome) -> str:
    return f"policy-v{out.policy_version}" if out.policy_version >= 0 else "upstream"


def _logprobs(out: CallOutcome, decode: Decode) -> dict[str, Any]:
    return {
        "content": [
            {"token": decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(out.completion_ids, out.logprobs, strict=True)
        ]
    }


def response_body(out: CallOutcome, req: ChatCompletionRequest, decode: Decode) -> bytes:
    message: dict[str, Any] = {"role": "assistant", "content": out.message.content or None}
    if out.message.reasoning:
        message["reasoning_content"] = out.message.reasoning
    if out.message.tool_calls:
        message["tool_calls"] = _tool_calls(out.message)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": out.finish_reason,
        "logprobs": _logprobs(out, decode) if req.logprobs else None,
    }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{out.call_id}-{secrets.token_hex(6)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": _fingerprint(out),
        "choices": [choice],
        "usage": _usage(out),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = out.prompt_ids
        choice["token_ids"] = out.completion_ids
    return dumps(body)


class ChunkWriter:
    """A chat completion's chunks as its answer streams: one per delta, then the finish chunk, the
    usage chunk when asked for, and [DONE]. Logprobs (and the `return_token_ids` extension) come
    with the finish chunk, where all of them are known."""

    def __init__(self, req: ChatCompletionRequest, chunk_id: str, decode: Decode, version: int) -> None:
        self.req, self.chunk_id, self.decode = req, chunk_id, decode
        self.created = int(time.time())
        # The version that began the answer (the final chunk names the one the record holds).
        self.fingerprint = f"policy-v{version}" if version >= 0 else "upstream"
        self.calls = 0

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        body = {
            "id": self.chunk_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
        }
        return b"data: " + dumps(body) + b"\n\n"

    def delta(self, d: Delta) -> bytes:
        if d.reasoning:
            return self.chunk({"reasoning_content": d.reasoning})
        if d.content:
            return self.chunk({"content": d.content})
        if d.tool_call is not None:
            self.calls += 1
            (call,) = _tool_calls(Message("assistant", tool_calls=[d.tool_call]))
            return self.chunk({"tool_calls": [{"index": self.calls - 1, **call}]})
        return b""

    def end(self, out: CallOutcome) -> bytes:
        self.fingerprint = _fingerprint(out)
        extra: dict[str, Any] = {}
        if self.req.logprobs:
            extra["logprobs"] = _logprobs(out, self.decode)
        if self.req.return_token_ids:
            extra["token_ids"] = out.completion_ids
        events = [self.chunk({}, out.finish_reason, **extra)]
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            usage = {
                "id": self.chunk_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.req.model,
                "choices": [],
                "usage": _usage(out),
            }
            events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return b"".join(events)


def role_chunk(chunk_id: str, model: str) -> bytes:
    body = {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }
    return b"data: " + dumps(body) + b"\n\n"


_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "too_large": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "rate_limit": "rate_limit_error",
    "unavailable": "server_error",
    "internal": "server_error",
}


def error_body(err: GatewayError) -> bytes:
    return orjson.dumps(
        {"error": {"message": err.message, "type": _TYPES[err.kind], "param": err.param, "code": err.code}}
    )


def stream_error(err: GatewayError) -> bytes:
    """An error after the stream began: an SSE event the OpenAI SDK raises as an APIError."""
    return b"data: " + error_body(err) + b"\n\n"


class ChatExchange(serving.Exchange):
    """One chat completion request: its answer as a body or as chunks."""

    def __init__(self, conv: Conversation, req: ChatCompletionRequest, host: serving.Host) -> None:
        self.conv, self.req, self.host, self.decode = conv, req, host, host.decode
        self.chunk_id = f"chatcmpl-{secrets.token_hex(12)}"

    def body(self, out: CallOutcome) -> bytes:
        return response_body(out, self.req, self.decode)

    def stream_start(self, call: PreparedCall) -> bytes:
        version = -1 if call.session.upstream else self.host.policy_version
        self.writer = ChunkWriter(self.req, self.chunk_id, self.decode, version)
        return role_chunk(self.chunk_id, self.req.model)

    def stream_delta(self, delta: Delta) -> bytes:
        return self.writer.delta(delta)

    def stream_end(self, out: CallOutcome) -> bytes:
        return self.writer.end(out)

    def stream_error(self, err: GatewayError) -> bytes:
        return stream_error(err)


class OpenAIChat(serving.JSONErrors):
    """`POST /v1/chat/completions` and `GET /v1/models`; the fallback for paths no dialect owns."""

    name = NAME
    error_body = staticmethod(error_body)

    def routes(self, host: serving.Host) -> list[serving.RouteSpec]:
        def parse(body: bytes, files: Mapping[str, Image], _: serving.Incoming) -> ChatExchange:
            return ChatExchange(*parse_request(body, files), host)

        async def models(request: Request) -> dict[str, Any]:
            await host.session(request)
            model = {"id": "policy", "object": "model", "created": 0, "owned_by": "openforgerl"}
            return {"object": "list", "data": [model]}

        return [serving.CallRoute("/v1/chat/completions", parse), serving.InfoRoute("/v1/models", models)]
