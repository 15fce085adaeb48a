"""The HTTP engine: an Engine over an inference server reached by HTTP (vLLM, SGLang).

What every such server shares lives here: the client (bearer token, generous keep-alive pool, no
connection cap: the gateway bounds concurrency and the server batches whatever it gets), `start`
(wait for `GET /health`, then ask the server what it serves), the mapping of failures onto the engine
errors, the generation round trip (one JSON POST; cancelling the awaiting task closes the connection,
and both servers abort a request whose client left) and the policy version with its weight-update
scaffolding (one update at a time; a generation that overlapped one is marked with
`policy_version_end`). A subclass supplies only its wire format (`request_body`, `parse_response`),
what `start` asks it after `/health`, its 400 refusals and its weight-update call.

Errors: a refused or dropped connection, a timeout and any 5xx map to EngineUnavailable (vLLM answers
500 when its engine core has died and 503 while it is not ready; SGLang 500 when its scheduler died:
the request itself was valid, so retrying against a recovered server is right), 429 to
EngineOverloaded (both with the server's Retry-After), a 400 the subclass recognises (a prompt too
long) to its own error, anything else to EngineError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, TypedDict

import httpx
import orjson

from openforgerl.engines.base import (
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
    TokenSink,
    completion_room,
    policy_version_end,
)
from openforgerl.images import Image

_JSON = {"Content-Type": "application/json"}


def retry_after(response: httpx.Response, default: float = 1.0) -> float:
    """The response's Retry-After in seconds, else `default`."""
    value = response.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:  # an HTTP date: not worth parsing, the default is as good a hint
        return default


def error_message(response: httpx.Response) -> str:
    """The message of an error body: {"error": {"message": ...}}, {"error": ...}, {"message": ...} or
    {"detail": ...} (the shapes vLLM and SGLang answer with); else the body's text."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return body[key]
    return response.text[:500]


class HTTPEngineOptions(TypedDict, total=False):
    """The keyword arguments every HTTPEngine takes (documented there); subclasses pass them on."""

    api_key: str | None
    request_timeout: float
    start_timeout: float
    policy_version: int
    max_context: int | None
    client: httpx.AsyncClient | None


class HTTPEngine:
    """An Engine over an inference server's HTTP API; subclasses supply the wire format.

    Args:
        base_url: the server's root, e.g. "http://127.0.0.1:8000".
        api_key: sent as a bearer token when the server was started with `--api-key`.
        request_timeout: seconds one generation may take before the engine is deemed unavailable.
        start_timeout: seconds `start()` waits for `GET /health` to answer 200.
        policy_version: the version of the weights the server starts with.
        max_context: the server's context length (prompt + completion), None until known.
        client: an httpx.AsyncClient to use instead of one owned by the engine (it is not closed).
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
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.start_timeout = start_timeout
        self.max_context = max_context
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(request_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
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
                r = await self._client.get(self._url("/health"), timeout=5.0)
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
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
        if self._owns_client:
            await self._client.aclose()

    # -- HTTP -----------------------------------------------------------------------------
    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    async def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One HTTP call; transport failures (refused, reset, timed out) mean the server is unavailable."""
        try:
            return await self._client.request(method, self._url(path), **kw)
        except httpx.TransportError as e:  # refused, reset, timed out, broken protocol
            raise EngineUnavailable(f"{self.label} at {self.base_url}: {type(e).__name__}: {e}") from e

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One HTTP call with the server's error statuses mapped onto the engine errors."""
        r = await self._send(method, path, **kw)
        if r.status_code < 400:
            return r
        msg = f"{self.label} {method} {path} -> HTTP {r.status_code}: {error_message(r)}"
        if r.status_code == 429:
            raise EngineOverloaded(msg, retry_after=retry_after(r))
        if r.status_code >= 500:
            raise EngineUnavailable(msg, retry_after=retry_after(r))
        refused = self._bad_request(msg) if r.status_code == 400 else None
        raise refused or EngineError(msg)

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

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: Sequence[Image] = (),
        on_tokens: TokenSink | None = None,
    ) -> GenerateResult:
        version, reloading = self._version, self._reloading
        # Cancelling this await closes the connection; the server aborts a request whose client left.
        r = await self._post_generate(prompt_ids, sampling, images)
        result = self.parse_response(r.content, version)
        if (end := policy_version_end(version, reloading, self._version, self._reloading)) is not None:
            result.extra["policy_version_end"] = end
        return result

    async def _post_generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image]
    ) -> httpx.Response:
        body = self.request_body(prompt_ids, sampling, images)
        return await self._request("POST", self.generate_path, content=orjson.dumps(body), headers=_JSON)

    # -- weights --------------------------------------------------------------------------
    async def load_weights(self, path: str) -> int:
        """Load new weights from `path` (a directory on the server's filesystem); returns the new
        policy version. Updates run one at a time; a failed one keeps the version."""
        async with self._reload_lock:
            self._reloading += 1
            try:
                await self._update_weights(path)
                self._version += 1
                await self._after_update()
            finally:
                self._reloading -= 1
        return self._version

    async def _update_weights(self, path: str) -> None:
        """Have the server load the weights in `path`; raise an EngineError when it did not."""
        raise NotImplementedError

    async def _after_update(self) -> None:
        """What follows a successful update, at the new version (e.g. dropping stale KV)."""
