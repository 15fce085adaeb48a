"""A remote SGLang server (its native HTTP API) as an Engine.

Generation goes through SGLang's native `POST /generate` with `input_ids`, so the server never
re-tokenizes, and `return_logprob: true` returns `meta_info.output_token_logprobs` as
`[[logprob, token_id, text_or_null], ...]`, one entry per sampled id. The ids recorded are the ids in
those entries: SGLang trims a matched stop token (EOS or `stop_token_ids`) from `output_ids` unless
`no_stop_trim` is set, but never from the logprob entries; this engine sets `no_stop_trim` and checks
that `output_ids` agrees.

`meta_info.finish_reason` is {"type": "stop", "matched": id_or_string} (EOS, a stop token id or a stop
string), {"type": "length", "length": n} or {"type": "abort", "message": ...}.

Logprobs: by SGLang's sampler code, `output_token_logprobs` are log_softmax(logits / temperature)
before top-k / top-p filtering, which is GenerateResult's contract; do not set
SGLANG_RETURN_ORIGINAL_LOGPROB on the server (it switches to pre-temperature logprobs). The seed goes
as `sampling_seed` (SGLang may honour it only with `--enable-deterministic-inference`).

Context length: SGLang refuses (400), rather than clamps, a request whose prompt + max_new_tokens does
not fit. This engine clamps max_new_tokens to the room the prompt leaves, like the built-in engine,
learning the context length from the first such refusal when it was not given, and maps a prompt that
leaves no room to ContextLengthExceeded.

Errors: a refused or dropped connection, a timeout and any 5xx map to EngineUnavailable. SGLang answers
a request it refuses (bad input, prompt too long) with 400, so a 500 is a server-side failure (its
scheduler or detokenizer died, or a bug); the request itself was valid and retrying against a
recovered server is the right response. 429 (sent by SGLang's router when its queue is full) maps to
EngineOverloaded.

Images (vision-language models): the prompt's images go as `image_data` (data URLs, in prompt order)
beside `input_ids`, whose image placeholders the gateway already expanded; SGLang's Qwen-VL processor
matches each expanded vision_start / pad run / vision_end with the next image. Only the wire format is
tested here (against the fake server); not yet tried against a real SGLang.

Weight updates use `POST /update_weights_from_disk {"model_path": ...}`; SGLang flushes its radix
cache itself after the update.

There is no CPU build of SGLang on this project's machines: tests run this client against
`openforgerl.testing.fake_sglang`, a FAKE SGLang server that speaks the same wire format.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import orjson

from openforgerl.engines.base import (
    ContextLengthExceeded,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    GenerateResult,
    SamplingParams,
    policy_version_end,
)
from openforgerl.images import Image

# SGLang's refusals: the prompt alone is too long, or prompt + max_new_tokens is (SGLang wants
# prompt + max_new_tokens < context length; it does not clamp max_new_tokens itself).
_PROMPT_TOO_LONG = re.compile(
    r"input \((?P<n>\d+) tokens\) is longer than the model's context length \((?P<max>\d+) tokens\)"
)
_TOTAL_TOO_LONG = re.compile(
    r"maximum context length of (?P<max>\d+) tokens.*?: (?P<n>\d+) tokens from the input", re.DOTALL
)


class _NoRoomForMaxTokens(EngineError):
    """SGLang refused prompt + max_new_tokens; `generate` learns the context length and retries."""

    def __init__(self, message: str, prompt_tokens: int, max_context: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def _retry_after(response: httpx.Response, default: float = 1.0) -> float:
    value = response.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:  # an HTTP date: the default is as good a hint
        return default


def _error_message(response: httpx.Response) -> str:
    """SGLang's error bodies: {"error": {"message": ...}}, {"message": ...} or {"detail": ...}."""
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return body[key]
    return response.text[:500]


class SGLangEngine:
    """Engine over a running SGLang server (`python -m sglang.launch_server`).

    Args:
        base_url: the server's root, e.g. "http://127.0.0.1:30000".
        api_key: sent as a bearer token when the server was started with `--api-key`.
        request_timeout: seconds one generation may take before the engine is deemed unavailable.
        start_timeout: seconds `start()` waits for `GET /health` to answer 200.
        policy_version: the version of the weights the server starts with.
        max_context: the server's context length. `max_new_tokens` is clamped to the room the prompt
            leaves (as the built-in engine does) and a prompt that leaves none raises
            ContextLengthExceeded without a round trip. When None it is learnt from the first refusal
            (SGLang's `/get_model_info` does not report it), and that request is retried clamped.
        extra_sampling_params: merged into every request's `sampling_params` (e.g. {"top_k": 50});
            they change the sampling distribution, so set only what the recorded data should reflect.
        client: an httpx.AsyncClient to use instead of one owned by the engine (it is not closed).
    """

    name = "sglang"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        request_timeout: float = 600.0,
        start_timeout: float = 240.0,
        policy_version: int = 0,
        max_context: int | None = None,
        extra_sampling_params: Mapping[str, Any] | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.start_timeout = start_timeout
        self.max_context = max_context
        self.extra_sampling_params = dict(extra_sampling_params or {})
        self.model_info: dict[str, Any] = {}
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

    async def start(self) -> None:
        """Wait until the server answers `/health`, then read `/get_model_info`."""
        deadline = time.monotonic() + self.start_timeout
        last = "no answer yet"
        while True:
            try:
                r = await self._client.get(f"{self.base_url}/health", timeout=5.0)
                if r.status_code == 200:
                    break
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EngineUnavailable(
                    f"SGLang server at {self.base_url} was not healthy within {self.start_timeout:.0f} s "
                    f"(last: {last}); is it running, and has it finished loading the model?"
                )
            await asyncio.sleep(0.5)
        r = await self._request("GET", "/get_model_info", timeout=10.0)
        info = orjson.loads(r.content)
        self.model_info = info if isinstance(info, dict) else {}

    async def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One HTTP call; transport failures (refused, reset, timed out) mean the server is unavailable."""
        try:
            return await self._client.request(method, f"{self.base_url}{path}", **kw)
        except httpx.TransportError as e:  # refused, reset, timed out, broken protocol
            raise EngineUnavailable(f"SGLang at {self.base_url}: {type(e).__name__}: {e}") from e

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = await self._send(method, path, **kw)
        if r.status_code < 400:
            return r
        msg = f"SGLang {method} {path} -> HTTP {r.status_code}: {_error_message(r)}"
        if r.status_code == 429:
            raise EngineOverloaded(msg, retry_after=_retry_after(r))
        if r.status_code >= 500:
            raise EngineUnavailable(msg, retry_after=_retry_after(r))
        if r.status_code == 400:
            if m := _PROMPT_TOO_LONG.search(msg):
                raise ContextLengthExceeded(int(m["n"]), int(m["max"]))
            if m := _TOTAL_TOO_LONG.search(msg):
                raise _NoRoomForMaxTokens(msg, int(m["n"]), int(m["max"]))
        raise EngineError(msg)

    def request_body(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> dict[str, Any]:
        """The `/generate` body for one generation; images go as `image_data` data URLs, in prompt order."""
        max_new = sampling.max_tokens
        if self.max_context is not None:
            room = self.max_context - len(prompt_ids) - 1  # SGLang: prompt + max_new < context
            if room < 1:
                raise ContextLengthExceeded(len(prompt_ids), self.max_context)
            max_new = min(max_new, room)
        params: dict[str, Any] = {
            "max_new_tokens": max_new,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop": list(sampling.stop),
            "stop_token_ids": list(sampling.stop_token_ids),
            # Keep the matched stop token in output_ids and the stop string in the text.
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        params.update(self.extra_sampling_params)
        body: dict[str, Any] = {
            "input_ids": prompt_ids,
            "sampling_params": params,
            "return_logprob": True,
            # -1: logprobs of the output only (0 would compute the whole prompt's too).
            "logprob_start_len": -1,
        }
        if images:
            # SGLang's Qwen-VL processor matches each already-expanded vision_start, pad run,
            # vision_end in input_ids and pairs it with the next image_data item.
            body["image_data"] = [im.data_url() for im in images]
        return body

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> GenerateResult:
        version, reloading = self._version, self._reloading
        # Cancelling this await closes the connection; SGLang aborts a request whose client left.
        try:
            r = await self._post_generate(self.request_body(prompt_ids, sampling, images))
        except _NoRoomForMaxTokens as e:
            if self.max_context == e.max_context:
                raise  # already clamped to what we knew: do not loop
            self.max_context = e.max_context
            r = await self._post_generate(self.request_body(prompt_ids, sampling, images))
        result = parse_generate_response(r.content, version)
        if (end := policy_version_end(version, reloading, self._version, self._reloading)) is not None:
            result.extra["policy_version_end"] = end
        return result

    async def _post_generate(self, body: dict[str, Any]) -> httpx.Response:
        return await self._request(
            "POST", "/generate", content=orjson.dumps(body), headers={"Content-Type": "application/json"}
        )

    async def load_weights(self, path: str) -> int:
        """Load new weights from `path` (a directory on the server's filesystem)."""
        async with self._reload_lock:
            self._reloading += 1
            try:
                r = await self._send("POST", "/update_weights_from_disk", json={"model_path": path})
                try:
                    answer = orjson.loads(r.content)
                except orjson.JSONDecodeError:
                    answer = {}
                ok = r.status_code == 200 and isinstance(answer, dict) and answer.get("success", False)
                if not ok:
                    if r.status_code == 429 or r.status_code >= 500:
                        raise EngineUnavailable(
                            f"SGLang could not update weights now: HTTP {r.status_code}: {_error_message(r)}",
                            retry_after=_retry_after(r),
                        )
                    raise EngineError(f"SGLang failed to load weights from {path!r}: {_error_message(r)}")
                self._version += 1
            finally:
                self._reloading -= 1
        return self._version

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def parse_generate_response(content: bytes, policy_version: int) -> GenerateResult:
    """Map one non-streaming `/generate` answer onto a GenerateResult."""
    try:
        out = orjson.loads(content)
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        output_ids: list[int] = out.get("output_ids") or []
        finish_json = meta.get("finish_reason") or {}
        ids = [int(e[1]) for e in entries]
        logprobs = [float(e[0]) for e in entries]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise EngineError(f"SGLang returned an unexpected /generate body: {content[:300]!r}") from e
    # output_ids equal the sampled ids, or lack the matched stop id if the server trimmed it anyway.
    if output_ids != ids and output_ids != ids[:-1]:
        raise EngineError(f"SGLang's output_ids {output_ids[:8]}... disagree with its logprob entries")
    kind = finish_json.get("type") if isinstance(finish_json, dict) else None
    finish = _FINISH.get(kind or "", "abort")
    extra: dict[str, object] = {}
    if kind not in _FINISH:
        extra["sglang_finish_reason"] = finish_json
    if kind == "abort" and isinstance(finish_json, dict) and finish_json.get("message"):
        extra["abort_message"] = finish_json["message"]
    if "weight_version" in meta:
        extra["weight_version"] = meta["weight_version"]
    stop_reason = finish_json.get("matched") if finish == "stop" else None
    return GenerateResult(
        completion_ids=ids,
        logprobs=logprobs,
        finish_reason=finish,
        policy_version=policy_version,
        stop_reason=stop_reason,
        extra=extra,
    )
