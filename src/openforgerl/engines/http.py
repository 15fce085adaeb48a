"""The HTTP engine: an Engine over an inference server reached by HTTP (vLLM, SGLang).

What every such server shares lives here: the client (one pooled aiohttp session per engine, bearer
token, keep-alive, no connection cap: the gateway bounds concurrency and the server batches whatever
it gets; aiohttp rather than httpx because under 64 concurrent callers httpx's pool roughly doubled
the engine call's p99, benchmarks/engine_client.py), `start` (wait for `GET /health`, then ask the
server what it serves), the mapping of failures onto the engine errors, the generation round trip
(one JSON POST, or a server-sent-event stream when the caller passes `on_tokens`; cancelling the
awaiting task closes the connection, and both servers abort a request whose client left) and the
policy version with its weight-update scaffolding (one update at a time; a generation that overlapped
one is marked with `policy_version_end`). A subclass supplies only its wire format (`request_body`,
`parse_response`, `stream_parser`), what `start` asks it after `/health`, its 400 refusals and its
weight-update call.

Errors: a refused or dropped connection, a timeout and any 5xx map to EngineUnavailable (vLLM answers
500 when its engine core has died and 503 while it is not ready; SGLang 500 when its scheduler died:
the request itself was valid, so retrying against a recovered server is right), 429 to
EngineOverloaded (both with the server's Retry-After), a 400 the subclass recognises (a prompt too
long) to its own error, anything else to EngineError. In a stream: an error event maps by its `code`
the same way (vLLM sends {"error": {..., "code": 500}} when its engine fails mid-generation), a
malformed event is an EngineError, and a stream that ends before the generation finished (the server
died) is EngineUnavailable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypedDict, Unpack

import aiohttp
import orjson

from openforgerl.engines.base import (
    EngineBase,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerateResult,
    Generation,
    SamplingParams,
    TokenSink,
    completion_room,
    policy_version_end,
)
from openforgerl.images import Image

_JSON = {"Content-Type": "application/json"}
# Transport failures: refused, reset, dropped mid-body, timed out (aiohttp's timeouts are also
# asyncio.TimeoutError).
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


@dataclass(slots=True)
class Reply:
    """A whole HTTP answer (status, headers, body), read before the connection went back to the pool."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes
    reason_phrase: str = ""

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


def retry_after(response: Reply, default: float = 1.0) -> float:
    """The response's Retry-After in seconds, else `default`."""
    value = response.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:  # an HTTP date: not worth parsing, the default is as good a hint
        return default


def error_message(response: Reply) -> str:
    """The message of an error body: {"error": {"message": ...}}, {"error": ...}, {"message": ...} or
    {"detail": ...} (the shapes vLLM and SGLang answer with); else the body's text."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:500] or response.reason_phrase
    return _message_of(body) or response.text[:500]


def _message_of(body: Any) -> str | None:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return body[key]
    return None


class StreamParser(Protocol):
    """One server's stream events (each a decoded JSON object) folded into one GenerateResult."""

    def feed(self, event: dict[str, Any]) -> Sequence[int]:
        """Take one event; the ids it newly sampled (possibly none)."""
        ...

    def result(self) -> GenerateResult:
        """The GenerateResult of the whole stream, exactly as the non-streamed answer's; raises
        EngineUnavailable when the stream ended before the generation finished."""
        ...


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent-event body (events end with a blank line, "\\n\\n", as
    both servers write them), one per event. Split by hand: an event can be far longer than aiohttp's
    line limit (SGLang resends every logprob so far in each event by default)."""
    buf = bytearray()
    scanned = 0  # where to resume looking for the blank line: a long event arrives in many chunks
    async for chunk in content.iter_any():
        buf += chunk
        while (end := buf.find(b"\n\n", scanned)) >= 0:
            event = bytes(buf[:end])
            del buf[: end + 2]
            scanned = 0
            data = b"\n".join(
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            )
            if data:
                yield data
        scanned = max(0, len(buf) - 1)
    if buf.strip():
        raise aiohttp.ClientPayloadError("the event stream ended inside an event")


class CallOptions(TypedDict, total=False):
    """What one HTTP call to the server may carry besides its method and path."""

    json: Any  # a body sent as JSON
    data: bytes  # a body already encoded (JSON)
    params: Mapping[str, str]  # the query
    timeout_s: float  # the call's own timeout (default: the engine's)


class HTTPEngineOptions(TypedDict, total=False):
    """The keyword arguments every HTTPEngine takes (documented there); subclasses pass them on."""

    api_key: str | None
    request_timeout: float
    start_timeout: float
    policy_version: int
    max_context: int | None
    client: aiohttp.ClientSession | None


class HTTPEngine(EngineBase):
    """An Engine over an inference server's HTTP API; subclasses supply the wire format.

    Args:
        base_url: the server's root, e.g. "http://127.0.0.1:8000".
        api_key: sent as a bearer token when the server was started with `--api-key`.
        request_timeout: seconds the server may stay silent (no byte of the answer, or of the next
            stream event) before the engine is deemed unavailable.
        start_timeout: seconds `start()` waits for `GET /health` to answer 200.
        policy_version: the version of the weights the server starts with.
        max_context: the server's context length (prompt + completion), None until known.
        client: an aiohttp.ClientSession to use instead of one owned by the engine (it is not closed,
            and its own headers and timeouts apply; the bearer token is still sent).
    """

    name: str
    label: str  # the server's name in messages
    generate_path: str  # where `generate` POSTs `request_body`
    supports_response_format = False

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        request_timeout: float = 600.0,
        start_timeout: float = 240.0,
        policy_version: int = 0,
        max_context: int | None = None,
        client: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.start_timeout = start_timeout
        self.max_context = max_context
        self.request_timeout = request_timeout
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._given_client = client
        # Made on first use: an aiohttp session belongs to the event loop it was made on.
        self._client: aiohttp.ClientSession | None = client
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._version = policy_version
        self._reloading = 0  # updates in flight: a generation overlapping one is marked in `extra`
        self._reload_lock = asyncio.Lock()

    @property
    def policy_version(self) -> int:
        return self._version

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Wait until the server answers `/health`, then learn what it serves (`_on_healthy`)."""
        deadline = time.monotonic() + self.start_timeout
        last = "no answer yet"
        while True:
            try:
                r = await self._send("GET", "/health", timeout_s=5.0)
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
            except EngineUnavailable as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise EngineUnavailable(
                    f"{self.label} server at {self.base_url} was not healthy within "
                    f"{self.start_timeout:.0f} s (last: {last}); is it running, and has it finished "
                    "loading the model?"
                )
            await asyncio.sleep(0.5)
        await self._on_healthy()

    async def _on_healthy(self) -> None:
        """What `start` asks the server once it is healthy (the served model, its context length)."""

    async def close(self) -> None:
        client, self._client = self._client, self._given_client
        # A session made on another (finished) loop cannot be closed from this one: dropped.
        if client not in (None, self._given_client) and self._client_loop is asyncio.get_running_loop():
            await client.close()

    # -- HTTP -----------------------------------------------------------------------------
    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _session(self) -> aiohttp.ClientSession:
        """The engine's pooled session, made on the running loop the first time it is needed (and
        again if the engine is used from another loop: a session's connections belong to one)."""
        loop = asyncio.get_running_loop()
        stale = self._client is not self._given_client and self._client_loop is not loop
        if self._client is None or self._client.closed or stale:
            self._client_loop = loop
            self._client = aiohttp.ClientSession(
                # limit=0: no cap (the gateway bounds concurrency); idle connections kept a while.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=self.request_timeout),
                headers=self._auth,
            )
        return self._client

    def _options(self, timeout_s: float | None) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if timeout_s is not None:
            options["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        if self._auth and self._client is self._given_client:
            options["headers"] = self._auth  # a given session does not carry our token
        return options

    def _unavailable(self, e: BaseException) -> EngineUnavailable:
        return EngineUnavailable(f"{self.label} at {self.base_url}: {type(e).__name__}: {e}")

    async def _send(self, method: str, path: str, **call: Unpack[CallOptions]) -> Reply:
        """One HTTP call, its answer read whole; transport failures (refused, reset, timed out) mean
        the server is unavailable. Cancelling it closes the connection (aiohttp does not pool a
        connection whose answer was not read to the end)."""
        json, data, params = call.get("json"), call.get("data"), call.get("params")
        options = self._options(call.get("timeout_s"))
        if data is not None:
            options["headers"] = {**options.get("headers", {}), **_JSON}
        try:
            async with self._session().request(
                method, self._url(path), json=json, data=data, params=params, **options
            ) as r:
                return Reply(r.status, r.headers, await r.read(), r.reason or "")
        except _TRANSPORT_ERRORS as e:
            raise self._unavailable(e) from e

    async def _request(self, method: str, path: str, **call: Unpack[CallOptions]) -> Reply:
        """One HTTP call with the server's error statuses mapped onto the engine errors."""
        r = await self._send(method, path, **call)
        if r.status_code < 400:
            return r
        msg = f"{self.label} {method} {path} -> HTTP {r.status_code}: {error_message(r)}"
        self._raise_status(r.status_code, msg, retry_after(r))

    def _raise_status(self, status: int, message: str, retry: float = 1.0) -> NoReturn:
        """Raise the engine error for an error status (of an answer, or of a stream's error event)."""
        if status == 429:
            raise EngineOverloaded(message, retry_after=retry)
        if status >= 500:
            raise EngineUnavailable(message, retry_after=retry)
        refused = self._bad_request(message) if status == 400 else None
        raise refused or EngineError(message)

    def _bad_request(self, message: str) -> EngineError | None:
        """The error for a 400 this server's messages name (e.g. a prompt too long), else None."""
        return None

    # -- generation -----------------------------------------------------------------------
    def _room(self, prompt_ids: list[int], max_tokens: int, reserve: int = 0) -> int:
        """`max_tokens` clamped to the room the prompt leaves in the context, when it is known
        (`reserve`: tokens the server keeps free besides); ContextLengthExceeded when none is left."""
        if self.max_context is None:
            return max_tokens
        return completion_room(len(prompt_ids), max_tokens, self.max_context, reserve)

    def request_body(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> dict[str, Any]:
        """The body `generate` POSTs to `generate_path`."""
        raise NotImplementedError

    def parse_response(self, content: bytes, policy_version: int) -> GenerateResult:
        """The GenerateResult of the server's answer to `request_body`."""
        raise NotImplementedError

    def stream_parser(self, policy_version: int) -> StreamParser:
        """A parser for the events of the server's answer to `request_body` with `"stream": true`."""
        raise NotImplementedError

    async def _before_generate(self) -> None:
        """What a server needs before a request is sent (vLLM: its model's name)."""

    async def _generate(self, call: Generation) -> GenerateResult:
        await self._before_generate()
        version, reloading = self._version, self._reloading
        # Cancelling this await closes the connection; the server aborts a request whose client left.
        result = await self._post_generate(call, version)
        if (end := policy_version_end(version, reloading, self._version, self._reloading)) is not None:
            result.extra["policy_version_end"] = end
        return result

    async def _post_generate(self, call: Generation, version: int) -> GenerateResult:
        """One generation request: a plain POST (cheaper) unless the caller wants the tokens as they come."""
        body = self.request_body(call.prompt_ids, call.sampling, call.images)
        if call.on_tokens is None:
            r = await self._request("POST", self.generate_path, data=orjson.dumps(body))
            return self.parse_response(r.content, version)
        body["stream"] = True
        return await self._stream(orjson.dumps(body), call.on_tokens, self.stream_parser(version))

    async def _stream(self, body: bytes, on_tokens: TokenSink, parser: StreamParser) -> GenerateResult:
        """POST a streaming request and fold its events into a GenerateResult, handing each event's
        new ids to `on_tokens` as it arrives."""
        path = self.generate_path
        options = self._options(None)
        options["headers"] = {**options.get("headers", {}), **_JSON}
        try:
            async with self._session().post(self._url(path), data=body, **options) as r:
                try:
                    if r.status >= 400:
                        answer = Reply(r.status, r.headers, await r.read(), r.reason or "")
                        msg = f"{self.label} POST {path} -> HTTP {r.status}: {error_message(answer)}"
                        self._raise_status(r.status, msg, retry_after(answer))
                    async for data in sse_data(r.content):
                        if data == b"[DONE]":
                            continue  # the body ends after it: read to the end, so the connection is pooled
                        event = self._event(data)
                        if "error" in event:
                            self._stream_error(event)
                        if ids := parser.feed(event):
                            on_tokens(ids)
                except BaseException:
                    r.close()  # drop the connection (never pooled half-read): the server aborts
                    raise
        except _TRANSPORT_ERRORS as e:
            raise self._unavailable(e) from e
        return parser.result()

    def _event(self, data: bytes) -> dict[str, Any]:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            event = None
        if not isinstance(event, dict):
            raise EngineError(f"{self.label} sent a malformed stream event: {data[:300]!r}")
        return event

    def _stream_error(self, event: dict[str, Any]) -> None:
        """Raise the engine error for an error event ({"error": {"message", "code"?}}): by its code
        when it has one, else a refusal."""
        err = event["error"]
        code = err.get("code") if isinstance(err, dict) else None
        msg = f"{self.label} POST {self.generate_path} stream error: {_message_of(event) or err}"
        self._raise_status(code if isinstance(code, int) and code >= 400 else 400, msg)

    # -- weights --------------------------------------------------------------------------
    async def load_weights(self, path: str) -> int:
        """Load new weights from `path` (a directory on the server's filesystem); returns the new
        policy version. Updates run one at a time; a failed one keeps the version."""
        async with self._reload_lock:
            self._reloading += 1
            try:
                await self._update_weights(path)
                try:
                    await self._after_update()
                finally:
                    # The weights changed, whether or not the clean-up worked. The bump and the end of
                    # the reload happen together (no await between them): a generation that ends
                    # between them would count the update twice (`policy_version_end`).
                    self._version += 1
            finally:
                self._reloading -= 1
        return self._version

    async def _update_weights(self, path: str) -> None:
        """Have the server load the weights in `path`; raise an EngineError when it did not."""
        raise NotImplementedError

    async def _after_update(self) -> None:
        """What follows a successful update, before its version counts (e.g. dropping stale KV)."""
