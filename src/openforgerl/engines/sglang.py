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

Streaming (`generate(..., on_tokens=...)` sends `"stream": true`): SSE events in the answer's own
shape, `finish_reason` null until the last one. By default SGLang resends everything so far in each
event (`output_ids`, `output_token_logprobs`: quadratic bytes over a long generation; start the server
with `--incremental-streaming-output` to get only the new part); `GenerateStream` takes either and
gives the same GenerateResult as the plain answer. Checked against SGLang's source
(tokenizer_manager's output processing), tested against the fake only.

Weight updates use `POST /update_weights_from_disk {"model_path": ...}`; SGLang flushes its radix
cache itself after the update.

There is no CPU build of SGLang on this project's machines: tests run this client against
`openforgerl.testing.fake_sglang`, a FAKE SGLang server that speaks the same wire format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import orjson

from openforgerl.engines.base import (
    FINISH_REASONS,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    GenerateResult,
    Generation,
    SamplingParams,
)
from openforgerl.engines.http import HTTPEngine, HTTPEngineOptions, error_message, retry_after
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


class SGLangEngine(HTTPEngine):
    """Engine over a running SGLang server (`python -m sglang.launch_server`).

    Args (and HTTPEngine's: api_key, request_timeout, start_timeout, policy_version, client):
        base_url: the server's root, e.g. "http://127.0.0.1:30000".
        max_context: the server's context length. `max_new_tokens` is clamped to the room the prompt
            leaves (as the built-in engine does) and a prompt that leaves none raises
            ContextLengthExceeded without a round trip. When None it is learnt from the first refusal
            (SGLang's `/get_model_info` does not report it), and that request is retried clamped.
        extra_sampling_params: merged into every request's `sampling_params` (e.g. {"top_k": 50});
            they change the sampling distribution, so set only what the recorded data should reflect.
    """

    name = "sglang"
    label = "SGLang"
    generate_path = "/generate"

    def __init__(
        self,
        base_url: str,
        *,
        extra_sampling_params: Mapping[str, Any] | None = None,
        **options: Unpack[HTTPEngineOptions],
    ) -> None:
        super().__init__(base_url, **options)
        self.extra_sampling_params = dict(extra_sampling_params or {})
        self.model_info: dict[str, Any] = {}

    async def _on_healthy(self) -> None:
        """Read `/get_model_info`."""
        r = await self._request("GET", "/get_model_info", timeout_s=10.0)
        info = orjson.loads(r.content)
        self.model_info = info if isinstance(info, dict) else {}

    def _bad_request(self, message: str) -> EngineError | None:
        if m := _PROMPT_TOO_LONG.search(message):
            return ContextLengthExceeded(int(m["n"]), int(m["max"]))
        if m := _TOTAL_TOO_LONG.search(message):
            return _NoRoomForMaxTokens(message, int(m["n"]), int(m["max"]))
        return None

    def request_body(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> dict[str, Any]:
        """The `/generate` body for one generation; images go as `image_data` data URLs, in prompt order."""
        params: dict[str, Any] = {
            # SGLang: prompt + max_new_tokens < context length.
            "max_new_tokens": self._room(prompt_ids, sampling.max_tokens, reserve=1),
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

    def parse_response(self, content: bytes, policy_version: int) -> GenerateResult:
        return parse_generate_response(content, policy_version)

    def stream_parser(self, policy_version: int) -> GenerateStream:
        return GenerateStream(policy_version)

    async def _post_generate(self, call: Generation, version: int) -> GenerateResult:
        try:
            return await super()._post_generate(call, version)
        except _NoRoomForMaxTokens as e:
            if self.max_context == e.max_context:
                raise  # already clamped to what we knew: do not loop
            self.max_context = e.max_context
            return await super()._post_generate(call, version)

    async def _update_weights(self, path: str) -> None:
        """`POST /update_weights_from_disk`; SGLang flushes its radix cache itself."""
        r = await self._send("POST", "/update_weights_from_disk", json={"model_path": path})
        try:
            answer = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            answer = {}
        ok = r.status_code == 200 and isinstance(answer, dict) and answer.get("success", False)
        if not ok:
            if r.status_code == 429 or r.status_code >= 500:
                raise EngineUnavailable(
                    f"SGLang could not update weights now: HTTP {r.status_code}: {error_message(r)}",
                    retry_after=retry_after(r),
                )
            raise EngineError(f"SGLang failed to load weights from {path!r}: {error_message(r)}")


def parse_generate_response(content: bytes, policy_version: int) -> GenerateResult:
    """Map one non-streaming `/generate` answer onto a GenerateResult."""
    try:
        out = orjson.loads(content)
        return _generate_result(out.get("output_ids") or [], out["meta_info"], policy_version)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise EngineError(f"SGLang returned an unexpected /generate body: {content[:300]!r}") from e


class GenerateStream:
    """A streamed `/generate` answer folded into the same GenerateResult as the non-streamed one.

    Each event is a whole answer's shape ({"text", "output_ids", "meta_info"}). By default SGLang
    resends everything so far in each event (`output_ids` and `meta_info.output_token_logprobs`
    cumulative); a server started with `--incremental-streaming-output` sends only the new part.
    `meta_info.completion_tokens` counts every id so far in both, which tells them apart. The last
    event carries the non-null `finish_reason`.
    """

    def __init__(self, policy_version: int) -> None:
        self.policy_version = policy_version
        self.entries: list[Any] = []
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {}

    def feed(self, event: dict[str, Any]) -> list[int]:
        try:
            meta = event["meta_info"]
            entries = meta["output_token_logprobs"]
            output_ids = event.get("output_ids") or []
            total = meta.get("completion_tokens")
            done = len(self.entries)
            # Cumulative (SGLang's default) unless the event holds only the ids past those seen.
            if done and len(entries) == total:
                entries = entries[done:]
                self.output_ids = list(output_ids)
            else:
                self.output_ids += output_ids
            new = [int(e[1]) for e in entries]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"SGLang sent an unexpected stream event: {str(event)[:300]}") from e
        self.entries += entries
        self.meta = meta
        return new

    def result(self) -> GenerateResult:
        if not self.meta.get("finish_reason"):
            raise EngineUnavailable("SGLang's stream ended before the generation finished")
        meta = {**self.meta, "output_token_logprobs": self.entries}
        try:
            return _generate_result(self.output_ids, meta, self.policy_version)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"SGLang streamed unexpected logprobs: {str(self.entries)[:300]}") from e


def _generate_result(output_ids: list[int], meta: dict[str, Any], policy_version: int) -> GenerateResult:
    """An answer's ids and meta_info (whole, or gathered from a stream) as a GenerateResult."""
    entries = meta["output_token_logprobs"]
    finish_json = meta.get("finish_reason") or {}
    ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    # output_ids equal the sampled ids, or lack the matched stop id if the server trimmed it anyway.
    if output_ids != ids and output_ids != ids[:-1]:
        raise EngineError(f"SGLang's output_ids {output_ids[:8]}... disagree with its logprob entries")
    kind = finish_json.get("type") if isinstance(finish_json, dict) else None
    finish = FINISH_REASONS.get(kind or "", "abort")
    extra: dict[str, object] = {}
    if kind not in FINISH_REASONS:
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
