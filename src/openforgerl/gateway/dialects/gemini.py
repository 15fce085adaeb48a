"""Gemini (Generative Language API): wire models, and the translation to and from a `Conversation`.

Serves what Gemini CLI, pi's google dialect and the google-genai SDKs send:
`POST /v1beta/models/{model}:generateContent | :streamGenerateContent | :countTokens` (also under
`/v1`) and `GET /v1beta/models[/{model}]`. The model name comes from the path and is kept in the record.

Translation decisions:
- Echoed model turns: Gemini CLI adds a client-made `id` and a `thoughtSignature` to each
  functionCall. Both are ignored, so the echoed turn is the same Message with or without them.
  functionResponse ids are ignored too: Gemini pairs calls and responses by name and order.
- A functionResponse becomes a `tool` message: `response.output` when it is the only key (the shape
  Gemini CLI and pi send; a string verbatim, anything else as JSON), otherwise the JSON of `response`.
- Thought parts of model turns are reasoning. Reasoning is answered as a thought part only when
  `thinkingConfig.includeThoughts` asks for it, as the API does.
- Tools other than functionDeclarations (googleSearch, codeExecution, ...) cannot run here: they are
  skipped, and named in the `x-openforgerl-declined-tools` response header.
- Images are `inlineData` parts (base64; the declared mimeType is not trusted, the bytes say what
  they are), in user turns and in a functionResponse's own `parts` (a tool's screenshot). Images
  right after a functionResponse, before any text, belong to that tool message (Gemini CLI sends a
  tool's binary output so); otherwise a turn's images come before its text. `fileData` is refused
  unless its URI names an image uploaded to this gateway (`POST /v1/files`): the gateway fetches
  nothing. Images in model turns or the system instruction get a 400.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel
from starlette.requests import Request

from openforgerl import jsonutil
from openforgerl.conversation import Conversation, Message, SamplingRequest, Tool, ToolCall
from openforgerl.engines.parsers import Delta
from openforgerl.gateway import serving
from openforgerl.gateway.core import CallOutcome
from openforgerl.gateway.dialects import MAX_MESSAGES, MAX_TOOLS, Seed
from openforgerl.gateway.errors import GatewayError, bad_request, load_image
from openforgerl.gateway.streaming import message_deltas
from openforgerl.images import Image, digest_of_file_id, image_from_base64, image_from_file

NAME = "gemini"
DECLINED_TOOLS_HEADER = "x-openforgerl-declined-tools"
ACTIONS = ("generateContent", "streamGenerateContent", "countTokens")


class _Wire(BaseModel):
    # Unknown fields (safetySettings, cachedContent, labels, topK, ...) are accepted and ignored.
    # Google's JSON parser takes camelCase and snake_case names alike, and clients send both.
    model_config = ConfigDict(
        extra="ignore", alias_generator=to_camel, validate_by_name=True, validate_by_alias=True
    )


class FunctionCall(_Wire):
    name: str = Field(min_length=1)
    args: dict[str, Any] | None = None


class Blob(_Wire):
    mime_type: str | None = None  # not trusted: the type is read from the bytes
    data: str


class FileData(_Wire):
    mime_type: str | None = None
    file_uri: str


class MediaPart(_Wire):
    inline_data: Blob | None = None
    file_data: FileData | None = None


class FunctionResponse(_Wire):
    name: str = ""
    response: dict[str, Any] | None = None
    parts: list[MediaPart] | None = None  # multimodal function responses: the tool's images


class Part(MediaPart):
    text: str | None = None
    thought: bool = False
    function_call: FunctionCall | None = None
    function_response: FunctionResponse | None = None


class Content(_Wire):
    role: str | None = None
    parts: list[Part] = Field(default_factory=list)


class FunctionDeclaration(_Wire):
    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | None = None


class ToolEntry(_Wire):
    # Kept, not ignored: the other keys are the tool kinds this gateway declines.
    model_config = ConfigDict(extra="allow")

    function_declarations: list[FunctionDeclaration] | None = None


class FunctionCallingConfig(_Wire):
    mode: Literal["MODE_UNSPECIFIED", "AUTO", "ANY", "NONE", "VALIDATED"] = "MODE_UNSPECIFIED"
    allowed_function_names: list[str] | None = None


class ToolConfig(_Wire):
    function_calling_config: FunctionCallingConfig | None = None


class ThinkingConfig(_Wire):
    include_thoughts: bool = False


class GenerationConfig(_Wire):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_output_tokens: int | None = Field(default=None, ge=1, strict=True)  # not "10", not true
    stop_sequences: list[str] | None = None
    candidate_count: int = 1
    seed: Seed | None = None
    response_mime_type: str | None = None
    response_schema: dict[str, Any] | None = None
    response_json_schema: dict[str, Any] | None = None
    thinking_config: ThinkingConfig | None = None


class GenerateContentRequest(_Wire):
    contents: list[Content] = Field(default_factory=list, max_length=MAX_MESSAGES)
    system_instruction: Content | str | None = None
    tools: list[ToolEntry] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None


class CountTokensRequest(_Wire):
    contents: list[Content] = Field(default_factory=list, max_length=MAX_MESSAGES)
    generate_content_request: GenerateContentRequest | None = None


@dataclass(slots=True)
class Parsed:
    conv: Conversation
    include_thoughts: bool
    declined_tools: list[str]


_M = TypeVar("_M", bound=BaseModel)


def _validated(model: type[_M], body: bytes) -> _M:
    try:
        # orjson first: like the JS clients, it reads big integers as doubles, and it refuses lone
        # surrogates and NaN/infinity, which orjson.dumps (token memory) could not write back.
        data = jsonutil.loads(body)
    except ValueError as exc:
        raise bad_request(f"Invalid JSON payload received. {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        where = f" at '{loc}'" if loc else ""
        raise bad_request(f"Invalid JSON payload received{where}: {err['msg']}", param=loc or None) from exc


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Gemini's OpenAPI-style `Schema` as JSON Schema: its type names are upper case ("OBJECT")."""
    out = dict(schema)
    if isinstance(out.get("type"), str):
        out["type"] = out["type"].lower()
    if isinstance(out.get("properties"), dict):
        out["properties"] = {
            k: _json_schema(v) if isinstance(v, dict) else v for k, v in out["properties"].items()
        }
    if isinstance(out.get("items"), dict):
        out["items"] = _json_schema(out["items"])
    if isinstance(out.get("anyOf"), list):
        out["anyOf"] = [_json_schema(s) if isinstance(s, dict) else s for s in out["anyOf"]]
    return out


def _refuse_media(part: Part, where: str, place: str) -> None:
    if part.inline_data is not None or part.file_data is not None:
        raise bad_request(f"Images are not supported in {place}.", param=where)


def _image(part: MediaPart, files: Mapping[str, Image], where: str) -> Image | None:
    """The part's image, or None for a part that holds none."""
    if part.inline_data is not None:
        data = part.inline_data.data
        return load_image(lambda: image_from_base64(data), f"{where}.inlineData.data")
    if part.file_data is not None:
        uri = part.file_data.file_uri
        if digest_of_file_id(uri) is None:
            raise bad_request(
                f"fileData URI {uri[:100]!r} is not a file of this gateway, which fetches nothing: send "
                "the image as inlineData, or upload it (POST /v1/files) and give its file id.",
                param=f"{where}.fileData.fileUri",
            )
        return load_image(lambda: image_from_file(uri, files), f"{where}.fileData.fileUri")
    return None


def _tool_output(response: FunctionResponse) -> str:
    data = response.response or {}
    if list(data) == ["output"]:
        output = data["output"]
        return output if isinstance(output, str) else orjson.dumps(output).decode()
    return orjson.dumps(data).decode()


def _messages(content: Content, files: Mapping[str, Image], where: str) -> list[Message]:
    if not content.parts:
        raise bad_request(f"* GenerateContentRequest.{where}.parts: contents.parts must not be empty.", where)
    if content.role == "model":
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for j, part in enumerate(content.parts):
            _refuse_media(part, f"{where}.parts.{j}", "model turns")
            if part.function_response is not None:
                raise bad_request("A functionResponse belongs in a user turn.", f"{where}.parts.{j}")
            if part.function_call is not None:
                calls.append(ToolCall(part.function_call.name, part.function_call.args or {}))
            elif part.text is not None:
                (reasoning if part.thought else text).append(part.text)
        return [Message("assistant", "".join(text), "".join(reasoning), calls)]
    if content.role not in (None, "user", "function"):  # "function": the old role of function responses
        raise bad_request("Please use a valid role: user, model.", f"{where}.role")
    out: list[Message] = []
    pending: list[str] = []
    images: list[Image] = []
    for j, part in enumerate(content.parts):
        at = f"{where}.parts.{j}"
        if part.function_call is not None:
            raise bad_request("A functionCall belongs in a model turn.", at)
        image = _image(part, files, at)
        if image is not None:
            if out and out[-1].role == "tool" and not pending and not images:
                out[-1].images.append(image)  # the output of the function response just before
            else:
                images.append(image)
        elif part.function_response is not None:
            if pending or images:
                out.append(Message("user", "".join(pending), images=images))
                pending, images = [], []
            response = part.function_response
            shown = [
                im
                for k, media in enumerate(response.parts or [])
                if (im := _image(media, files, f"{at}.functionResponse.parts.{k}")) is not None
            ]
            out.append(Message("tool", _tool_output(response), name=response.name, images=shown))
        elif part.text is not None:
            pending.append(part.text)
    if pending or images or not out:
        out.append(Message("user", "".join(pending), images=images))
    return out


def _system_text(instruction: Content | str | None) -> str:
    if instruction is None or isinstance(instruction, str):
        return instruction or ""
    for j, part in enumerate(instruction.parts):
        _refuse_media(part, f"systemInstruction.parts.{j}", "the system instruction")
    return "".join(p.text or "" for p in instruction.parts)


def _tool_choice(config: ToolConfig | None) -> str | dict[str, Any] | None:
    calling = config.function_calling_config if config is not None else None
    if calling is None or calling.mode == "MODE_UNSPECIFIED":
        return None
    names = calling.allowed_function_names or []
    if calling.mode == "ANY" and len(names) == 1:
        return {"type": "function", "function": {"name": names[0]}}
    return {"AUTO": "auto", "VALIDATED": "auto", "ANY": "required", "NONE": "none"}[calling.mode]


def _response_format(gen: GenerationConfig) -> dict[str, Any] | None:
    """Structured output, in the OpenAI shape the other dialects record."""
    schema = gen.response_json_schema
    if schema is None and gen.response_schema is not None:
        schema = _json_schema(gen.response_schema)
    if schema is not None:
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    if gen.response_mime_type == "application/json":
        return {"type": "json_object"}
    return None


def to_conversation(
    req: GenerateContentRequest, model: str, stream: bool, files: Mapping[str, Image] | None = None
) -> Parsed:
    if not req.contents:
        raise bad_request("* GenerateContentRequest.contents: contents is not specified", "contents")
    messages: list[Message] = []
    system = _system_text(req.system_instruction)
    if system:
        messages.append(Message("system", system))
    for i, content in enumerate(req.contents):
        messages += _messages(content, files or {}, f"contents.{i}")
    tools: list[Tool] = []
    declined: list[str] = []
    for entry in req.tools or []:
        declined += list(entry.model_extra or {})
        for f in entry.function_declarations or []:
            params = f.parameters_json_schema
            if params is None:
                params = _json_schema(f.parameters or {})
            tools.append(Tool(f.name, f.description, params))
    gen = req.generation_config or GenerationConfig()
    if gen.candidate_count != 1:
        raise bad_request(
            "Only candidateCount=1 is supported: send one request per sample.",
            "generationConfig.candidateCount",
        )
    conv = Conversation(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(req.tool_config),
        response_format=_response_format(gen),
        sampling=SamplingRequest(
            temperature=gen.temperature,
            top_p=gen.top_p,
            max_tokens=gen.max_output_tokens,
            stop=list(gen.stop_sequences or []),
            seed=gen.seed,
        ),
        stream=stream,
        dialect=NAME,
    )
    thinking = gen.thinking_config
    return Parsed(conv, thinking is not None and thinking.include_thoughts, declined)


def parse_request(body: bytes, model: str, stream: bool, files: Mapping[str, Image] | None = None) -> Parsed:
    """A generateContent body as a Conversation; GatewayError 400 if malformed."""
    return to_conversation(_validated(GenerateContentRequest, body), model, stream, files)


def parse_count_tokens(body: bytes, model: str, files: Mapping[str, Image] | None = None) -> Conversation:
    """A countTokens body: bare `contents`, or a whole `generateContentRequest`."""
    req = _validated(CountTokensRequest, body)
    full = req.generate_content_request or GenerateContentRequest(contents=req.contents)
    return to_conversation(full, model, False, files).conv


def _parts(message: Message, include_thoughts: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if include_thoughts and message.reasoning:
        parts.append({"text": message.reasoning, "thought": True})
    if message.content:  # never an empty text part: Gemini CLI drops such a chunk as invalid
        parts.append({"text": message.content})
    parts += [{"functionCall": {"id": c.id, "name": c.name, "args": c.arguments}} for c in message.tool_calls]
    return parts


def _response(parts: list[dict[str, Any]], model: str, response_id: str, final: CallOutcome | None) -> bytes:
    """One GenerateContentResponse; `final` (the outcome) adds finishReason and usage."""
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    body: dict[str, Any] = {"candidates": [candidate], "modelVersion": model, "responseId": response_id}
    if final is not None:
        candidate["finishReason"] = "MAX_TOKENS" if final.finish_reason == "length" else "STOP"
        body["usageMetadata"] = {
            "promptTokenCount": final.prompt_tokens,
            "candidatesTokenCount": final.completion_tokens,
            "totalTokenCount": final.prompt_tokens + final.completion_tokens,
            "cachedContentTokenCount": final.cached_tokens,
        }
    return orjson.dumps(body)


_STATUS = {
    "invalid_request": "INVALID_ARGUMENT",
    "context_length": "INVALID_ARGUMENT",
    "too_large": "INVALID_ARGUMENT",
    "authentication": "UNAUTHENTICATED",
    "permission": "PERMISSION_DENIED",
    "not_found": "NOT_FOUND",
    "rate_limit": "RESOURCE_EXHAUSTED",
    "unavailable": "UNAVAILABLE",
    "internal": "INTERNAL",
}


def _http_status(err: GatewayError) -> int:
    # The API refuses an oversized payload with 400 INVALID_ARGUMENT, not 413.
    return 400 if err.kind == "too_large" else err.status


def error_body(err: GatewayError) -> bytes:
    message = err.message
    tokens, limit = err.details.get("prompt_tokens"), err.details.get("max_context")
    if err.kind == "context_length" and tokens is not None and limit is not None:
        # Gemini's own words, which clients match on.
        message = f"The input token count ({tokens}) exceeds the maximum number of tokens allowed ({limit})."
    details: list[dict[str, Any]] = []
    if err.param:
        details.append(
            {
                "@type": "type.googleapis.com/google.rpc.BadRequest",
                "fieldViolations": [{"field": err.param, "description": message}],
            }
        )
    if err.retry_after is not None:
        # Gemini CLI ignores retry-after but reads this.
        details.append(
            {
                "@type": "type.googleapis.com/google.rpc.RetryInfo",
                "retryDelay": f"{max(1, round(err.retry_after))}s",
            }
        )
    status = _http_status(err)
    return orjson.dumps(
        {"error": {"code": status, "message": message, "status": _STATUS[err.kind], "details": details}}
    )


def stream_error(err: GatewayError) -> bytes:
    """An error after the stream began: a bare error object, which both google-genai SDKs raise as
    an API error with its code (a `data:` event would reach the JS SDK as an empty response)."""
    return error_body(err) + b"\n"


class GeminiExchange(serving.Exchange):
    """One generateContent or streamGenerateContent request: SSE with `?alt=sse`; else one body
    (without alt=sse, the API streams one JSON array, which is sent whole)."""

    # Blank lines, not comments: the google-genai Python SDK parses every line that is not `data:`
    # as JSON, so a comment breaks its stream (the JS SDK skips both).
    keepalive = b"\r\n\r\n"

    def __init__(self, parsed: Parsed, sse: bool) -> None:
        self.parsed, self.conv, self.sse = parsed, parsed.conv, sse
        self.id = f"ofr-{secrets.token_hex(12)}"

    @property
    def streams(self) -> bool:
        return self.sse

    @property
    def headers(self) -> Mapping[str, str]:
        declined = self.parsed.declined_tools
        return {DECLINED_TOOLS_HEADER: ", ".join(quote(k, safe="") for k in declined)} if declined else {}

    def _chunk(self, parts: list[dict[str, Any]], final: CallOutcome | None = None) -> bytes:
        return _response(parts, self.conv.model, self.id, final)

    def _parts(self, delta: Delta) -> list[dict[str, Any]]:
        return _parts(
            Message(
                "assistant", delta.content, delta.reasoning, [delta.tool_call] if delta.tool_call else []
            ),
            self.parsed.include_thoughts,
        )

    def body(self, out: CallOutcome) -> bytes:
        if not self.conv.stream:
            return self._chunk(_parts(out.message, self.parsed.include_thoughts), out)
        # Without alt=sse the API streams one JSON array, sent whole here: the chunks a stream has.
        chunks = [self._chunk(p) for d in message_deltas(out.message) if (p := self._parts(d))]
        return b"[" + b",\r\n".join([*chunks, self._chunk([], out)]) + b"]"

    def stream_delta(self, delta: Delta) -> bytes:
        """One part a chunk, as the API streams them (clients concatenate the parts)."""
        parts = self._parts(delta)
        return b"data: " + self._chunk(parts) + b"\r\n\r\n" if parts else b""

    def stream_end(self, out: CallOutcome) -> bytes:
        """finishReason and usage, on a chunk of their own (clients read a finish reason from any)."""
        return b"data: " + self._chunk([], out) + b"\r\n\r\n"

    def stream_error(self, err: GatewayError) -> bytes:
        return stream_error(err)


class Gemini(serving.JSONErrors):
    """The Generative Language API's model routes, under /v1beta and /v1."""

    name = NAME
    owned = re.compile(r"(?:/r/[^/]+)?/(?:v1beta(?:/|$)|v1/models/.*:)")
    error_body = staticmethod(error_body)

    def error_status(self, err: GatewayError) -> int:
        return _http_status(err)

    def routes(self, host: serving.Host) -> list[serving.RouteSpec]:
        def generate(streaming: bool) -> serving.Parse[serving.Exchange]:
            def parse(body: bytes, files: Mapping[str, Image], at: serving.Incoming) -> serving.Exchange:
                parsed = parse_request(body, at.path_params["model"], streaming, files)
                return GeminiExchange(parsed, streaming and at.query_params.get("alt") == "sse")

            return parse

        def count(body: bytes, files: Mapping[str, Image], at: serving.Incoming) -> Conversation:
            return parse_count_tokens(body, at.path_params["model"], files)

        async def model_info(request: Request, name: str) -> dict[str, Any]:
            session = await host.session(request)
            return {
                "name": f"models/{name}",
                "version": f"policy-v{host.policy_version}",
                "displayName": name,
                "inputTokenLimit": host.max_context,
                "outputTokenLimit": session.policy.max_tokens,
                "supportedGenerationMethods": list(ACTIONS),
            }

        async def list_models(request: Request) -> dict[str, Any]:
            return {"models": [await model_info(request, "policy")]}

        async def get_model(request: Request) -> dict[str, Any]:
            model = request.path_params["model"]
            if ":" in model:  # an action asked for with GET
                raise GatewayError(404, f"Unknown endpoint GET {request.url.path}.", kind="not_found")
            return await model_info(request, model)

        routes: list[serving.RouteSpec] = []
        for version in ("/v1beta", "/v1"):
            path = f"{version}/models/{{model:path}}:"
            routes += [
                serving.CallRoute(path + "generateContent", generate(streaming=False)),
                serving.CallRoute(path + "streamGenerateContent", generate(streaming=True)),
                serving.CountRoute(path + "countTokens", count, lambda tokens: {"totalTokens": tokens}),
            ]
        routes.append(serving.InfoRoute("/v1beta/models", list_models))
        routes.append(serving.InfoRoute("/v1beta/models/{model:path}", get_model))
        return routes
