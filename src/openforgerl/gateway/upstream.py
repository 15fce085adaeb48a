"""Upstreams: a rollout answered by an external model (a teacher) instead of the policy.

An upstream is configured when the gateway starts (`--upstream NAME=KIND:MODEL[@BASE_URL]`, its key
read from an environment variable, never sent through the API), and a rollout created with
`"upstream": NAME` sends every call there. Whatever dialect the harness speaks, the call's
`Conversation` is translated to the upstream's API (one translator per kind: OpenAI Chat
Completions, Anthropic Messages), sent with httpx, and the answer becomes the assistant `Message`
that the harness's dialect renders back (streamed to the harness as for the policy: the upstream is
asked without streaming). The record is text-level: messages and answer, no token ids.

Choices, and why:

- Base URLs follow each SDK's convention, so they can be copied from client configs: OpenAI's
  includes `/v1` (`https://api.openai.com/v1` + `/chat/completions`), Anthropic's does not
  (`https://api.anthropic.com` + `/v1/messages`).
- Sampling is the harness's, with the rollout's own `sampling` settings on top; the gateway-wide
  policy (temperature 1 for RL) is for the policy, not for a teacher. Anthropic gets temperature
  clamped to [0, 1], `top_p` only without a temperature (recent Claude models refuse both), and
  the upstream's `max_tokens` when the harness set none (the field is required there). OpenAI's
  own API gets `max_completion_tokens` (its reasoning models refuse `max_tokens`); other
  OpenAI-compatible servers get `max_tokens`, which all of them accept.
- Images go as each API takes them, so a vision-language teacher sees what the harness showed:
  Chat Completions `image_url` parts with data URLs, Anthropic base64 `image` blocks (a tool
  result's images inside its `tool_result`). Chat Completions takes images in user messages only,
  so the images of tool results (and of system messages) follow them in a user message of their own.
- Reasoning in the history is not sent back (Anthropic needs the signature it made; OpenAI takes
  none); tool calls without ids (Gemini's) get ids, and their results are paired by name or order.
- Errors keep their meaning for the harness: 429 and 5xx come back with the same status and
  `retry-after`, a timeout is a 504, an unreachable upstream a 502, a refused request a 400 with
  the upstream's message. The upstream refusing the gateway's own key (401/403) or not knowing the
  model (404) is the gateway's misconfiguration, not the harness's: a 502 that says so.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import urlparse

import httpx
import orjson

from openforgerl.conversation import Conversation, Message, SamplingRequest, ToolCall, parse_arguments
from openforgerl.gateway.config import DEFAULT_KEY_ENVS as DEFAULT_KEY_ENVS
from openforgerl.gateway.config import DEFAULT_URLS as DEFAULT_URLS
from openforgerl.gateway.config import KINDS as KINDS
from openforgerl.gateway.config import UpstreamKind as UpstreamKind
from openforgerl.gateway.config import UpstreamSpec as UpstreamSpec
from openforgerl.gateway.errors import ErrorKind, GatewayError, bad_request
from openforgerl.images import Image
from openforgerl.jsonutil import dumps
from openforgerl.rendering import PromptPlan, TokenMemory, message_images, message_key, tools_key
from openforgerl.sampling import derive_seed

ANTHROPIC_VERSION = "2023-06-01"


def parse_upstream(text: str, *, timeout: float = 600.0) -> UpstreamSpec:
    """`NAME=KIND:MODEL[@BASE_URL]`, e.g. `teacher=openai:gpt-4.1` or
    `claude=anthropic:claude-sonnet-4-5@https://api.anthropic.com`. The model may hold ':' and '@';
    the URL starts at the '@' before `http://` or `https://`."""
    name, eq, rest = text.partition("=")
    kind, colon, target = rest.partition(":")
    if not (eq and colon and name and target):
        raise ValueError(f"{text!r}: expected NAME=KIND:MODEL[@BASE_URL], e.g. teacher=openai:gpt-4.1")
    found = re.search(r"@(?=https?://)", target)
    model, url = (target[: found.start()], target[found.end() :]) if found else (target, "")
    if kind not in KINDS:
        raise ValueError(f"{text!r}: the kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return UpstreamSpec(name.strip(), kind, model, url, timeout=timeout)


def parse_key_env(text: str) -> tuple[str, str]:
    """`NAME=ENVVAR`: the environment variable holding upstream NAME's key."""
    name, eq, env = text.partition("=")
    if not (eq and name and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env)):
        raise ValueError(f"{text!r}: expected NAME=ENVVAR, e.g. teacher=MY_OPENAI_KEY")
    return name, env


def with_key_envs(specs: list[UpstreamSpec], key_envs: dict[str, str]) -> list[UpstreamSpec]:
    """The specs with their key variables set; a variable for an unknown upstream is an error."""
    names = {s.name for s in specs}
    if len(names) != len(specs):
        raise ValueError("two upstreams have the same name")
    unknown = set(key_envs) - names
    if unknown:
        raise ValueError(f"key variable for unknown upstream(s) {sorted(unknown)}; known: {sorted(names)}")
    return [replace(s, key_env=key_envs.get(s.name, s.key_env)) for s in specs]


# -- what one call sends and gets ------------------------------------------------------------------


def upstream_sampling(req: SamplingRequest, overrides: dict[str, Any], call: int = 0) -> dict[str, Any]:
    """The harness's sampling with the rollout's own settings on top (max_tokens is a cap; a seed
    gives call `call` of the rollout its own, as for the policy: SamplingPolicy)."""
    temperature = overrides.get("temperature")
    top_p = overrides.get("top_p")
    seed = overrides.get("seed")
    max_tokens = req.max_tokens
    cap = overrides.get("max_tokens")
    if cap is not None:
        max_tokens = min(max_tokens or cap, cap)
    return {
        "temperature": req.temperature if temperature is None else temperature,
        "top_p": req.top_p if top_p is None else top_p,
        "max_tokens": max_tokens,
        "stop": list(req.stop),
        "seed": req.seed if seed is None else derive_seed(seed, call),
    }


@dataclass(slots=True)
class UpstreamReply:
    message: Message
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_reason: str | None  # the stop sequence that ended the answer, when one did
    model: str  # as the upstream names it (a dated snapshot, often)
    prompt_tokens: int  # the upstream's own counts, in its tokenizer
    completion_tokens: int
    cached_tokens: int


def _with_ids(messages: list[Message]) -> list[Message]:
    """Copies in which every tool call has an id and every tool result names the call it answers
    (Gemini sends neither; both APIs need them)."""
    out: list[Message] = []
    pending: list[ToolCall] = []
    n = 0
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for c in m.tool_calls:
                if not c.id:
                    n += 1
                    c = ToolCall(c.name, c.arguments, f"call_{n}")
                calls.append(c)
            pending = list(calls)
            m = replace(m, tool_calls=calls)
        elif m.role == "tool" and not m.tool_call_id and pending:
            match = next((c for c in pending if m.name and c.name == m.name), pending[0])
            pending.remove(match)
            m = replace(m, tool_call_id=match.id)
        out.append(m)
    return out


def _arguments_json(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else dumps(arguments).decode()


def _schema(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of a structured-output request, in OpenAI's or Anthropic's spelling."""
    if response_format.get("type") != "json_schema":
        return None
    inner = response_format.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, dict) else response_format.get("schema")
    return schema if isinstance(schema, dict) else None


def _error_text(data: Any) -> tuple[str, str | None]:
    """The message and code of an error body in either API's shape (or the raw text)."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        code = err.get("code") if isinstance(err.get("code"), str) else None
        return str(err.get("message") or err.get("type") or err), code
    return str(data)[:500], None


class Translator(Protocol):
    """Conversation -> one upstream API's request, and its answer -> an `UpstreamReply`."""

    path: str

    def headers(self, key: str) -> dict[str, str]: ...

    def request(self, conv: Conversation, spec: UpstreamSpec, sampling: dict[str, Any]) -> dict[str, Any]: ...

    def reply(self, data: Any, spec: UpstreamSpec) -> UpstreamReply: ...


class OpenAIChatTranslator:
    """OpenAI Chat Completions (OpenAI, vLLM, SGLang, OpenRouter, DeepSeek, another gateway, ...)."""

    path = "/chat/completions"

    def headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}", "content-type": "application/json"}

    def request(self, conv: Conversation, spec: UpstreamSpec, sampling: dict[str, Any]) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        # Images of tool results and system messages, sent in a user message once those end (a user
        # message between a call's tool results would break the calls' pairing).
        held: list[Image] = []
        for m in _with_ids(conv.messages):
            if held and m.role != "tool":
                messages.append({"role": "user", "content": _openai_parts(held, "")})
                held = []
            if m.role == "assistant":
                out: dict[str, Any] = {"role": "assistant", "content": m.content or None}
                if m.tool_calls:
                    out["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": _arguments_json(c.arguments)},
                        }
                        for c in m.tool_calls
                    ]
                else:
                    out["content"] = m.content
                messages.append(out)
            elif m.role == "tool":
                messages.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
                held += m.images
            elif m.role == "user" and m.images:
                messages.append({"role": "user", "content": _openai_parts(m.images, m.content)})
            else:
                messages.append({"role": m.role, "content": m.content})
                held += m.images
        if held:
            messages.append({"role": "user", "content": _openai_parts(held, "")})
        body: dict[str, Any] = {"model": spec.model, "messages": messages}
        if conv.tools:
            # An empty description or schema is left out: OpenAI refuses `parameters: {}`.
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        **({"description": t.description} if t.description else {}),
                        **({"parameters": t.parameters} if t.parameters else {}),
                    },
                }
                for t in conv.tools
            ]
            if conv.tool_choice is not None:
                body["tool_choice"] = conv.tool_choice
        rf = conv.response_format
        if rf and rf.get("type") != "text":
            schema = _schema(rf)
            if schema is not None and "json_schema" not in rf:  # Anthropic's spelling
                rf = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            body["response_format"] = rf
        for name in ("temperature", "top_p", "seed"):
            if sampling[name] is not None:
                body[name] = sampling[name]
        if sampling["stop"]:
            body["stop"] = sampling["stop"]
        if sampling["max_tokens"] is not None:
            # OpenAI's reasoning models refuse max_tokens; other servers may not know its successor.
            official = (urlparse(spec.url).hostname or "").endswith("openai.com")
            body["max_completion_tokens" if official else "max_tokens"] = sampling["max_tokens"]
        return body

    def reply(self, data: Any, spec: UpstreamSpec) -> UpstreamReply:
        choice = data["choices"][0]
        wire = choice["message"]
        content = wire.get("content")
        if isinstance(content, list):  # some servers answer with content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        reasoning = wire.get("reasoning_content") or wire.get("reasoning") or ""
        calls = [
            ToolCall(
                c["function"]["name"],
                parse_arguments(c["function"].get("arguments") or ""),
                c.get("id") or f"call_{secrets.token_hex(12)}",
            )
            for c in wire.get("tool_calls") or []
        ]
        message = Message(
            "assistant",
            content if isinstance(content, str) else "",
            reasoning=reasoning if isinstance(reasoning, str) else "",
            tool_calls=calls,
        )
        finish = choice.get("finish_reason") or "stop"
        finish = finish if finish in ("stop", "length", "tool_calls") else "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return UpstreamReply(
            message=message,
            finish_reason=finish,
            stop_reason=None,
            model=str(data.get("model") or spec.model),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )


class AnthropicTranslator:
    """Anthropic Messages (Anthropic's API, or anything that speaks it)."""

    path = "/v1/messages"

    def headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION, "content-type": "application/json"}

    def request(self, conv: Conversation, spec: UpstreamSpec, sampling: dict[str, Any]) -> dict[str, Any]:
        messages = _with_ids(conv.messages)
        system: list[str] = []
        system_images: list[Image] = []
        while messages and messages[0].role == "system":
            first = messages.pop(0)
            system.append(first.content)
            system_images += first.images
        turns: list[dict[str, Any]] = []

        def add(role: str, blocks: list[dict[str, Any]]) -> None:
            if not blocks:
                return
            if turns and turns[-1]["role"] == role:  # the API wants user and assistant in turn
                turns[-1]["content"] += blocks
            else:
                turns.append({"role": role, "content": blocks})

        for m in messages:
            if m.role == "assistant":
                blocks: list[dict[str, Any]] = []
                if m.content.strip():  # the API refuses empty text blocks
                    blocks.append({"type": "text", "text": m.content})
                for c in m.tool_calls:
                    args = c.arguments if isinstance(c.arguments, dict) else {"arguments": c.arguments}
                    blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
                add("assistant", blocks)
            elif m.role == "tool":
                result: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id}
                if m.images:
                    result["content"] = _anthropic_blocks(m.images, m.content)
                elif m.content:
                    result["content"] = m.content
                add("user", [result])
            else:  # user, or a system message within the conversation (no such role there)
                add("user", _anthropic_blocks(m.images, m.content))
        if system_images:  # the system prompt is text only there: its images open the conversation
            if turns and turns[0]["role"] == "user":
                turns[0]["content"][:0] = _anthropic_blocks(system_images, "")
            else:
                turns.insert(0, {"role": "user", "content": _anthropic_blocks(system_images, "")})
        for turn in turns:  # tool results open their turn, before any text
            if turn["role"] == "user":
                turn["content"].sort(key=lambda b: b["type"] != "tool_result")
        body: dict[str, Any] = {
            "model": spec.model,
            "messages": turns,
            "max_tokens": sampling["max_tokens"] or spec.max_tokens,
        }
        if system:
            body["system"] = "\n\n".join(system)
        if conv.tools:
            body["tools"] = [
                {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "input_schema": t.parameters or {"type": "object", "properties": {}},
                }
                for t in conv.tools
            ]
            choice = _anthropic_tool_choice(conv.tool_choice)
            if choice is not None:
                body["tool_choice"] = choice
        schema = _schema(conv.response_format or {})
        if schema is not None:
            body["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
        if sampling["temperature"] is not None:
            body["temperature"] = min(max(float(sampling["temperature"]), 0.0), 1.0)
        elif sampling["top_p"] is not None:
            body["top_p"] = sampling["top_p"]
        if sampling["stop"]:
            body["stop_sequences"] = sampling["stop"]
        return body

    def reply(self, data: Any, spec: UpstreamSpec) -> UpstreamReply:
        texts, reasoning, calls = [], [], []
        for block in data["content"]:
            if block.get("type") == "text":
                texts.append(block["text"])
            elif block.get("type") == "thinking":
                reasoning.append(block.get("thinking", ""))
            elif block.get("type") == "tool_use":
                calls.append(ToolCall(block["name"], parse_arguments(block.get("input") or {}), block["id"]))
        stop = data.get("stop_reason")
        finish = {"max_tokens": "length", "model_context_window_exceeded": "length", "tool_use": "tool_calls"}
        usage = data.get("usage") or {}
        cached = int(usage.get("cache_read_input_tokens") or 0)
        return UpstreamReply(
            message=Message(
                "assistant",
                "\n".join(texts),
                reasoning="\n".join(r for r in reasoning if r),
                tool_calls=calls,
            ),
            finish_reason=finish.get(stop, "tool_calls" if calls else "stop"),
            stop_reason=data.get("stop_sequence") if stop == "stop_sequence" else None,
            model=str(data.get("model") or spec.model),
            prompt_tokens=int(usage.get("input_tokens") or 0)
            + cached
            + int(usage.get("cache_creation_input_tokens") or 0),
            completion_tokens=int(usage.get("output_tokens") or 0),
            cached_tokens=cached,
        )


def _openai_parts(images: list[Image], text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": im.data_url()}} for im in images
    ]
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def _anthropic_blocks(images: list[Image], text: str) -> list[dict[str, Any]]:
    """Image blocks, then the text (never an empty text block: the API refuses those)."""
    blocks: list[dict[str, Any]] = [
        {"type": "image", "source": {"type": "base64", "media_type": im.media_type, "data": im.b64()}}
        for im in images
    ]
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks


def _anthropic_tool_choice(choice: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The recorded (OpenAI-spelled) tool choice in Anthropic's spelling."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        return {"type": "tool", "name": name} if name else None
    return {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}.get(choice or "")


TRANSLATORS: dict[UpstreamKind, Translator] = {
    "openai": OpenAIChatTranslator(),
    "anthropic": AnthropicTranslator(),
}


# -- the client ------------------------------------------------------------------------------------


def _retry_after(headers: httpx.Headers) -> float | None:
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(0.0, float(value) / scale)
            except ValueError:
                continue  # an HTTP date: rare enough to leave to the harness's own back-off
    return None


@dataclass
class Upstream:
    """One configured upstream and its HTTP client (made on first use, in the serving loop)."""

    spec: UpstreamSpec
    translator: Translator = field(init=False)
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.translator = TRANSLATORS[self.spec.kind]

    @property
    def engine_name(self) -> str:
        """What the record's `engine` says: text-level calls answered by this kind of upstream."""
        return f"upstream:{self.spec.kind}"

    def request(
        self, conv: Conversation, overrides: dict[str, Any], call: int = 0
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The body to send and the record of what it asks for (the call's `sampling_used`)."""
        sampling = upstream_sampling(conv.sampling, overrides, call)
        body = self.translator.request(conv, self.spec, sampling)
        sent = {k: v for k, v in body.items() if k not in ("messages", "tools", "system")}
        return body, {"upstream": self.spec.name, "url": self.spec.url, **sent}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.spec.timeout, connect=min(30.0, self.spec.timeout)),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
        return self._client

    async def send(self, body: dict[str, Any]) -> UpstreamReply:
        """POST the body; the answer, or a GatewayError that means to the harness what the
        upstream's error meant."""
        spec = self.spec
        key = os.environ.get(spec.env, "")
        if not key:
            raise GatewayError(
                500,
                f"The gateway has no key for upstream '{spec.name}': ${spec.env} is not set in its "
                "environment.",
                kind="internal",
            )
        url = spec.url + self.translator.path
        try:
            r = await self._http().post(url, content=dumps(body), headers=self.translator.headers(key))
        except httpx.TimeoutException as exc:
            raise GatewayError(
                504,
                f"Upstream '{spec.name}' did not answer within {spec.timeout:g}s ({type(exc).__name__}).",
                kind="unavailable",
                retry_after=1,
            ) from exc
        except httpx.HTTPError as exc:
            raise GatewayError(
                502,
                f"Upstream '{spec.name}' at {url} cannot be reached: {exc!r}",
                kind="unavailable",
                retry_after=1,
            ) from exc
        if r.status_code != 200:
            raise self._status_error(r)
        try:
            return self.translator.reply(orjson.loads(r.content), spec)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
            raise GatewayError(
                502,
                f"Upstream '{spec.name}' answered with a body this gateway cannot read ({exc!r}): "
                f"{r.text[:300]}",
                kind="internal",
            ) from exc

    def _status_error(self, r: httpx.Response) -> GatewayError:
        try:
            data: Any = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            data = r.text
        text, code = _error_text(data)
        status, retry_after = r.status_code, _retry_after(r.headers)
        where = f"Upstream '{self.spec.name}' ({self.spec.model})"
        if status == 429:
            return GatewayError(
                429, f"{where} is rate limited: {text}", kind="rate_limit", code=code, retry_after=retry_after
            )
        if status >= 500:
            kind: ErrorKind = "unavailable" if status in (502, 503, 504, 529) else "internal"
            return GatewayError(
                status, f"{where} failed ({status}): {text}", kind=kind, code=code, retry_after=retry_after
            )
        if status == 413:
            return GatewayError(413, f"{where} refused the request as too large: {text}", kind="too_large")
        if status in (400, 422):
            return bad_request(f"{where} refused the request: {text}", code=code)
        if status in (401, 403):
            text = f"refused the gateway's key (${self.spec.env}): {text}"
        elif status == 404:
            text = f"does not know the model or endpoint (check the model and URL {self.spec.url}): {text}"
        else:
            text = f"answered {status}: {text}"
        return GatewayError(502, f"{where} {text}", kind="internal")

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


# -- branches without tokens -----------------------------------------------------------------------


@dataclass
class TextMemory(TokenMemory):
    """Token memory's branch bookkeeping without tokens, for the calls an upstream answers: a call
    extends the branch whose messages, and the answer recorded for them, it starts with (compared as
    token memory compares them: tool-call ids, reasoning and surrounding whitespace ignored). Its
    plans have no prompt ids; `first_new_message` tells the record which messages are new."""

    def plan(self, messages: Any, tools: Any) -> PromptPlan:
        keys = [message_key(m) for m in messages]
        tkey = tools_key(tools)
        best = self.longest_tip(keys, tkey)
        return PromptPlan(
            prompt_ids=[],
            prompt_text="",
            keys=keys,
            tools_key=tkey,
            parent=best,
            prefix_len=0,
            first_new_message=len(best.keys) if best is not None else 0,
            miss_reason="" if best is not None else self._explain_miss(keys, tkey),
            images=message_images(messages),
        )
