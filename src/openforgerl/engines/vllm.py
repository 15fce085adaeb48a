"""A remote vLLM server (its OpenAI-compatible HTTP API) as an Engine.

Generation goes through `POST /v1/completions` with the prompt as token ids, so the server never
re-tokenizes anything, and `return_token_ids` + `logprobs: 0` return the exact ids vLLM sampled with
the logprob of each. What was checked against a real vLLM 0.32 (CPU build, tests/engines/test_vllm_engine.py):

- `choices[0].token_ids` and `choices[0].logprobs.token_logprobs` are aligned, one entry per sampled id.
- EOS: when vLLM stops on the tokenizer's EOS, the EOS id *is* the last entry of `token_ids` (with its
  logprob); `finish_reason` is "stop" and `stop_reason` is null. This engine records the EOS id as
  `GenerateResult.stop_reason`. (Extra EOS ids from `generation_config.json` are treated by vLLM as
  stop token ids: they come back as `stop_reason`.)
- `stop_token_ids`: the stop id is the last entry of `token_ids`; `stop_reason` is that id.
- `stop` strings: `token_ids` keep the whole token that completed the stop string (only the text is cut,
  and `include_stop_str_in_output` keeps the stop string in it); `stop_reason` is the string.
- Closing the HTTP connection aborts the request in vLLM (it watches for the client's disconnect), so
  cancelling the task awaiting `generate` frees the server's slot at once.
- Streaming (`generate(..., on_tokens=...)` sends `"stream": true`): one SSE event per engine step,
  `choices[0].token_ids` holding that step's new ids with their `logprobs.token_logprobs`,
  `finish_reason` / `stop_reason` null until the last event (the first event also echoes
  `prompt_token_ids`), then `data: [DONE]`; a failure mid-generation is an event
  {"error": {..., "code": 500}}. The ids, logprobs and reasons gathered from the events equal the
  plain answer's (tests/engines/test_vllm_engine.py generates every finish reason both ways); `VLLMStream`
  folds them into the same GenerateResult.
- Logprobs follow the server's `--logprobs-mode`. The default `raw_logprobs` is the model's own
  distribution whatever the temperature; `processed_logprobs` is of logits / temperature after top-k /
  top-p truncation. Start vLLM with `--logprobs-mode processed_logprobs` to get GenerateResult's
  contract (logits / temperature) at top_p = 1: measured within 1e-6 of a teacher-forced float32
  forward at temperatures 0.7, 1 and 1.3. At temperature 1 and top_p 1 both modes agree.

Images: `/v1/completions` takes a token prompt without images, and the chat endpoint would re-render
the conversation (the recorded ids would no longer be the ones the policy saw), so this engine refuses
images (EngineError); serve a vision-language policy with the builtin or SGLang engine.

Weight updates (`load_weights`) use `POST /collective_rpc` with `reload_weights`, an endpoint vLLM only
serves when started with `VLLM_SERVER_DEV_MODE=1`, then `POST /reset_prefix_cache`. Found in trials:
- A reload from a path that does not hold weights shut the whole vLLM 0.32 server down, so paths are
  checked locally first when the server is on this machine.
- On vLLM 0.32's CPU backend a model with tied embeddings (`tie_word_embeddings`, e.g. small Qwen2s,
  SmolLM2) keeps its OLD output head after a plain reload: at load time the LM head's
  `process_weights_after_loading` (vllm/model_executor/layers/vocab_parallel_embedding.py,
  UnquantizedEmbeddingMethod) calls `dispatch_cpu_unquantized_gemm` (layers/utils.py), which builds
  `layer.cpu_linear` around a oneDNN handle holding a packed COPY of the weight. The layer-wise
  reload (model_loader/reload/layerwise.py) re-runs that processing only for layers that received a
  tensor; a tied checkpoint has no `lm_head.weight`, so the head's module gets none: its parameter
  (shared with the embedding) is updated, its packed copy is not. Served: new body + new input
  embedding + old LM head.
  The way through, found in trials: during a reload every layer's parameters are fresh placeholders,
  so the tie is not seen and a checkpoint tensor named `lm_head.weight` is loaded into the head's
  module, which is then processed again (a new packed copy). For a tied checkpoint on a local server
  `load_weights` therefore reloads from a temporary view of the checkpoint (symlinks to its files)
  with one more file holding the embedding under the name `lm_head.weight` (`tied_head_view`); the
  served logprobs then equal the new checkpoint's (tests/engines/test_real_model_vllm.py). That needs an
  architecture whose vLLM model has an `lm_head` module tied by `tie_weights` (`_TIED_HEAD_ARCHS`)
  and safetensors weights; other tied reloads log a warning. GPU builds were not tried here (the
  extra tensor holds the same values, so it should be harmless there).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack
from urllib.parse import urlsplit

import orjson

from openforgerl.engines.base import (
    FINISH_REASONS,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)
from openforgerl.engines.http import HTTPEngine, HTTPEngineOptions, error_message
from openforgerl.images import Image

logger = logging.getLogger(__name__)

# vLLM's prompt-too-long refusals (renderer and serving checks): (prompt tokens, max context).
_CONTEXT_ERRORS = (
    re.compile(r"maximum context length is (?P<max>\d+) tokens.*?prompt contains (?:at least )?(?P<n>\d+)"),
    re.compile(r"Input length \((?P<n>\d+)\) exceeds model's maximum context length \((?P<max>\d+)\)"),
)


def _context_error(message: str) -> ContextLengthExceeded | None:
    for pattern in _CONTEXT_ERRORS:
        m = pattern.search(message)
        if m:
            return ContextLengthExceeded(int(m["n"]), int(m["max"]))
    return None


def _is_local(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_weights_dir(path: str) -> None:
    """Refuse a path that holds no weight files (a bad reload can take an inference server down)."""
    p = Path(path)
    if not p.is_dir():
        raise EngineError(f"weights path {path!r} is not a directory")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")) and not any(p.glob("*.pt")):
        raise EngineError(f"weights path {path!r} holds no *.safetensors, *.bin or *.pt files")


# Architectures whose vLLM model has an `lm_head` (ParallelLMHead) tied to `model.embed_tokens` by
# `tie_weights`, whose weights go through AutoWeightsLoader: a tensor named `lm_head.weight` reaches
# the head on a reload. (Loading it into a model without that module would fail the reload.)
_TIED_HEAD_ARCHS = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
_EMBEDDING, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_HEAD_FILE = "openforgerl-tied-lm-head.safetensors"
_INDEX = "model.safetensors.index.json"


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets) and where data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(100 << 20, os.fstat(f.fileno()).st_size - 8):  # the format's own header limit
            raise ValueError(f"{path} is not a safetensors file")
        header: dict[str, Any] = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file")
    return header, 8 + n


def tied_head_view(path: str | Path) -> Path | None:
    """A temporary directory from which vLLM reloads the tied checkpoint `path` with its LM head
    refreshed (see the module docstring): symlinks to the checkpoint's files plus `_HEAD_FILE`, the
    embedding's bytes under the name `lm_head.weight` (and an index naming it, for a sharded
    checkpoint). None when `path` is not such a checkpoint (untied, another architecture, no
    safetensors, or one that names `lm_head.weight` already). The caller removes the directory."""
    src = Path(path)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not config.get("tie_word_embeddings") or not _TIED_HEAD_ARCHS & set(config.get("architectures") or []):
        return None
    index: dict[str, Any] | None = None
    embedding: tuple[Path, dict[str, Any], int] | None = None
    try:
        if (src / _INDEX).is_file():
            index = json.loads((src / _INDEX).read_text())
            files = sorted({src / name for name in index["weight_map"].values()})
        else:
            files = sorted(src.glob("*.safetensors"))
        for f in files:
            header, data_start = _safetensors_header(f)
            if _LM_HEAD in header:
                return None  # the head is named: vLLM reloads it as it is
            if _EMBEDDING in header:
                embedding = (f, header[_EMBEDDING], data_start)
        if embedding is None:
            return None
        f, entry, data_start = embedding
        begin, end = (int(x) for x in entry["data_offsets"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # not a checkpoint this can read: the plain reload (and its warning)
    view = Path(tempfile.mkdtemp(prefix="openforgerl-vllm-reload-"))
    try:
        for item in src.iterdir():
            if item.name != _INDEX:
                (view / item.name).symlink_to(item.resolve())
        # The tensor's bytes as they are (any dtype), under the head's name; header padded to 8 bytes.
        meta = json.dumps(
            {_LM_HEAD: {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [0, end - begin]}}
        )
        meta += " " * (-len(meta) % 8)
        with open(f, "rb") as inp, open(view / _HEAD_FILE, "wb") as out:
            out.write(struct.pack("<Q", len(meta)) + meta.encode())
            inp.seek(data_start + begin)
            left = end - begin
            while left > 0:
                chunk = inp.read(min(left, 16 << 20))
                if not chunk:
                    raise OSError(f"{f} ends before its tensor {_EMBEDDING} does")
                out.write(chunk)
                left -= len(chunk)
        if index is not None:
            index = {**index, "weight_map": {**index["weight_map"], _LM_HEAD: _HEAD_FILE}}
            (view / _INDEX).write_text(json.dumps(index))
        for item in (view, view / _HEAD_FILE, *([view / _INDEX] if index else [])):
            item.chmod(0o755 if item.is_dir() else 0o644)  # a server under another uid reads it
    except BaseException:
        shutil.rmtree(view, ignore_errors=True)
        raise
    return view


class VLLMEngine(HTTPEngine):
    """Engine over a running vLLM OpenAI-compatible server (`vllm serve`, or its api_server module).

    Args (and HTTPEngine's: api_key, request_timeout, start_timeout, policy_version, client):
        base_url: the server's root, e.g. "http://127.0.0.1:8000" (no "/v1").
        model: the served model name; discovered from `GET /v1/models` when None.
        max_context: the server's context length (`--max-model-len`); read from `GET /v1/models` when
            None. `max_tokens` is clamped to the room the prompt leaves, as the built-in engine does,
            and a prompt that leaves none raises ContextLengthExceeded without a round trip.
        extra_body: extra fields merged into every completion request (e.g. {"top_k": 50}); they change
            the sampling distribution, so set only what the recorded data should reflect.
        check_weights_path: check `load_weights` paths on this machine; None = only when the server's
            address is a loopback one (its filesystem is then this machine's).
    """

    name = "vllm"
    label = "vLLM"
    generate_path = "/v1/completions"
    supports_response_format = True  # vLLM's structured outputs

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        check_weights_path: bool | None = None,
        **options: Unpack[HTTPEngineOptions],
    ) -> None:
        super().__init__(base_url, **options)
        self.model = model
        self.extra_body = dict(extra_body or {})
        self.check_weights_path = (
            _is_local(self.base_url) if check_weights_path is None else check_weights_path
        )
        self._cpu_server: bool | None = None  # learnt from /server_info on the first reload
        self._warned_tied_head = False
        self._diagnosis: asyncio.Task[None] | None = None

    async def _on_healthy(self) -> None:
        """Learn the served model name and context length from `/v1/models` where not given."""
        if self.model is None or self.max_context is None:
            await self._discover_model()

    async def _discover_model(self) -> None:
        r = await self._request("GET", "/v1/models", timeout_s=10.0)
        data = orjson.loads(r.content).get("data") or []
        if not data:
            raise EngineError(f"vLLM server at {self.base_url} serves no model")
        entry = next((d for d in data if d.get("id") == self.model), data[0])
        self.model = str(entry["id"])
        if self.max_context is None and isinstance(entry.get("max_model_len"), int):
            self.max_context = entry["max_model_len"]

    def _bad_request(self, message: str) -> EngineError | None:
        return _context_error(message)

    def refuses_images(self) -> str | None:
        # /v1/completions takes a token prompt or text, never images with it; the chat endpoint
        # would re-render the conversation and break the exact-ids record.
        return (
            "the vLLM engine sends token prompts to /v1/completions, which takes no images; "
            "serve a vision-language policy with the builtin or sglang engine"
        )

    async def _before_generate(self) -> None:
        if self.model is None:
            await self._discover_model()

    def request_body(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> dict[str, Any]:
        """The `/v1/completions` body for one generation (`generate` refuses images before this)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": self._room(prompt_ids, sampling.max_tokens),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.response_format is not None:
            body["response_format"] = sampling.response_format  # vLLM's structured outputs
        body.update(self.extra_body)
        return body

    def parse_response(self, content: bytes, policy_version: int) -> GenerateResult:
        return parse_completion_response(content, policy_version)

    def stream_parser(self, policy_version: int) -> VLLMStream:
        return VLLMStream(policy_version)

    async def load_weights(self, path: str) -> int:
        """Reload the server's weights from `path` (a directory on the server's filesystem).

        Needs the server started with VLLM_SERVER_DEV_MODE=1 (for `/collective_rpc`). The prefix cache
        is reset afterwards so no KV computed with the old weights is reused.
        """
        if self.check_weights_path:
            check_weights_dir(path)
        return await super().load_weights(path)

    async def _update_weights(self, path: str) -> None:
        # A tied LM head needs its tensor named to be refreshed (module docstring); only when the
        # server reads this machine's files.
        view: Path | None = None
        try:
            if self.check_weights_path:
                view = await asyncio.to_thread(tied_head_view, path)
            source = os.fspath(view or path)
            body = {"method": "reload_weights", "kwargs": {"weights_path": source}}
            r = await self._send("POST", "/collective_rpc", json=body)
            if r.status_code == 404:
                raise EngineError(
                    f"vLLM at {self.base_url} serves no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1"
                )
            if r.status_code >= 400:
                # The server answered, so the reload itself failed (a 5xx here may mean it is dying).
                raise EngineError(f"vLLM failed to reload weights from {path!r}: {error_message(r)}")
        finally:
            if view is not None:  # vLLM read the weights during the call
                shutil.rmtree(view, ignore_errors=True)
        if view is None:
            self._check_tied_head(path)

    async def _after_update(self) -> None:
        await self._reset_prefix_cache()

    def _check_tied_head(self, path: str) -> None:
        """Warn (once) when this reload hits vLLM CPU's stale tied LM head without the way around it
        (`tied_head_view` declined the checkpoint); see the module docstring."""
        if not self.check_weights_path or self._warned_tied_head:
            return  # a remote checkpoint's config cannot be read here
        try:
            tied = json.loads((Path(path) / "config.json").read_text()).get("tie_word_embeddings", False)
        except (OSError, ValueError):
            return
        if not tied:
            return
        if self._cpu_server is not None:
            self._warn_tied_head(path)
        elif self._diagnosis is None or self._diagnosis.done():
            # /server_info takes seconds (it gathers the server's environment): keep it off this path.
            self._diagnosis = asyncio.create_task(self._probe_device_then_warn(path))

    async def _probe_device_then_warn(self, path: str) -> None:
        try:
            r = await self._send("GET", "/server_info", timeout_s=30.0)
        except EngineError:
            return  # only a diagnosis
        self._cpu_server = r.status_code == 200 and "device_config=cpu" in r.text
        self._warn_tied_head(path)

    def _warn_tied_head(self, path: str) -> None:
        if self._cpu_server and not self._warned_tied_head:
            self._warned_tied_head = True  # once per engine: every reload of this model is affected
            logger.warning(
                "vLLM at %s runs on CPU and %s ties its embeddings: vLLM's CPU backend keeps the old "
                "LM head after reload_weights, so the served model mixes old and new weights",
                self.base_url,
                path,
            )

    async def _reset_prefix_cache(self) -> None:
        # Running requests hold cache blocks and make a plain reset fail; `reset_running_requests`
        # preempts them (they resume, recomputing their KV with the new weights).
        for _ in range(20):
            r = await self._request("POST", "/reset_prefix_cache", params={"reset_running_requests": "true"})
            try:
                answer = orjson.loads(r.content) if r.content else {}
            except orjson.JSONDecodeError:
                answer = {}
            # Older vLLMs answer an empty 200; newer ones {"success": bool}.
            if not isinstance(answer, dict) or answer.get("success", True):
                return
            await asyncio.sleep(0.25)
        raise EngineError(
            f"vLLM reloaded weights (policy version {self._version + 1}) "
            "but refused to reset its prefix cache"
        )

    async def close(self) -> None:
        if self._diagnosis is not None and not self._diagnosis.done():
            self._diagnosis.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._diagnosis
        await super().close()


def parse_completion_response(content: bytes, policy_version: int) -> GenerateResult:
    """Map one non-streaming `/v1/completions` answer (with `return_token_ids`) onto a GenerateResult."""
    try:
        choice = orjson.loads(content)["choices"][0]
        return _completion_result(
            choice["token_ids"],
            (choice.get("logprobs") or {}).get("token_logprobs") or [],
            choice.get("finish_reason"),
            choice.get("stop_reason"),
            policy_version,
        )
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as e:
        text = content[:300].decode(errors="replace")
        raise EngineError(f"vLLM returned an unexpected completion body: {text}") from e


class VLLMStream:
    """A streamed `/v1/completions` answer folded into the same GenerateResult as the non-streamed one.

    vLLM 0.32 sends one event per step, `choices[0]` holding that step's new `token_ids`, their
    `logprobs.token_logprobs`, and `finish_reason` / `stop_reason` (null until the last event); the
    first event also echoes `prompt_token_ids`. A usage event (`choices: []`) may follow, then
    `data: [DONE]`.
    """

    def __init__(self, policy_version: int) -> None:
        self.policy_version = policy_version
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def feed(self, event: dict[str, Any]) -> list[int]:
        try:
            choices = event["choices"]
            if not choices:
                return []  # the usage event
            choice = choices[0]
            ids: list[int] = choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            finish = choice.get("finish_reason")
            stop_reason = choice.get("stop_reason")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise EngineError(f"vLLM sent an unexpected stream event: {str(event)[:300]}") from e
        if len(logprobs) != len(ids):
            raise EngineError(f"vLLM streamed {len(logprobs)} logprobs for {len(ids)} token ids")
        self.ids += ids
        self.logprobs += logprobs
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, stop_reason
        return ids

    def result(self) -> GenerateResult:
        if self.finish_reason is None:
            raise EngineUnavailable("vLLM's stream ended before the generation finished")
        return _completion_result(
            self.ids, self.logprobs, self.finish_reason, self.stop_reason, self.policy_version
        )


def _completion_result(
    ids: list[int] | None,
    logprobs: list[float | None],
    raw_finish: str | None,
    stop_reason: str | int | None,
    policy_version: int,
) -> GenerateResult:
    """A choice's ids, logprobs and finish (whole, or gathered from a stream) as a GenerateResult."""
    if ids is None:
        raise EngineError("vLLM returned no token_ids (a vLLM too old for `return_token_ids`?)")
    if len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
        raise EngineError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} token ids")
    finish = FINISH_REASONS.get(raw_finish or "", "abort")
    if finish == "stop" and stop_reason is None and ids:
        # vLLM's stop on EOS: the EOS id is the last sampled id (and its stop_reason is null).
        stop_reason = ids[-1]
    extra: dict[str, object] = {}
    if raw_finish not in FINISH_REASONS:
        extra["vllm_finish_reason"] = raw_finish
    return GenerateResult(
        completion_ids=ids,
        logprobs=[float(lp) for lp in logprobs if lp is not None],
        finish_reason=finish,
        policy_version=policy_version,
        stop_reason=stop_reason,
        extra=extra,
    )
