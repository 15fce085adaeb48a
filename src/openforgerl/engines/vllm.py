"""A remote vLLM server (its OpenAI-compatible HTTP API) as an Engine.

Generation goes through `POST /v1/completions` with the prompt as token ids, so the server never
re-tokenizes anything, and `return_token_ids` + `logprobs: 0` return the exact ids vLLM sampled with
the logprob of each. What was checked against a real vLLM 0.32 (CPU build, tests/test_vllm_engine.py):

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
  served logprobs then equal the new checkpoint's (tests/test_real_model_vllm.py). That needs an
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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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

logger = logging.getLogger(__name__)

# vLLM's prompt-too-long refusals (renderer and serving checks): (prompt tokens, max context).
_CONTEXT_ERRORS = (
    re.compile(r"maximum context length is (?P<max>\d+) tokens.*?prompt contains (?:at least )?(?P<n>\d+)"),
    re.compile(r"Input length \((?P<n>\d+)\) exceeds model's maximum context length \((?P<max>\d+)\)"),
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def _retry_after(response: httpx.Response, default: float = 1.0) -> float:
    value = response.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:  # an HTTP date: not worth parsing, the default is as good a hint
        return default


def _error_message(response: httpx.Response) -> str:
    """vLLM's error body is {"error": {"message": ...}} (older: {"message": ...}); fall back to text."""
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
        if isinstance(body.get("message"), str):
            return body["message"]
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return response.text[:500]


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


class VLLMEngine:
    """Engine over a running vLLM OpenAI-compatible server (`vllm serve`, or its api_server module).

    Args:
        base_url: the server's root, e.g. "http://127.0.0.1:8000" (no "/v1").
        model: the served model name; discovered from `GET /v1/models` when None.
        max_context: the server's context length (`--max-model-len`); read from `GET /v1/models` when
            None. `max_tokens` is clamped to the room the prompt leaves, as the built-in engine does,
            and a prompt that leaves none raises ContextLengthExceeded without a round trip.
        api_key: sent as a bearer token when the server was started with `--api-key`.
        request_timeout: seconds one generation may take before the engine is deemed unavailable.
        start_timeout: seconds `start()` waits for `GET /health` to answer 200.
        policy_version: the version of the weights the server starts with.
        extra_body: extra fields merged into every completion request (e.g. {"top_k": 50}); they change
            the sampling distribution, so set only what the recorded data should reflect.
        check_weights_path: check `load_weights` paths on this machine; None = only when the server's
            address is a loopback one (its filesystem is then this machine's).
        client: an httpx.AsyncClient to use instead of one owned by the engine (it is not closed).
    """

    name = "vllm"
    supports_response_format = True

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        max_context: int | None = None,
        api_key: str | None = None,
        request_timeout: float = 600.0,
        start_timeout: float = 240.0,
        policy_version: int = 0,
        extra_body: Mapping[str, Any] | None = None,
        check_weights_path: bool | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_context = max_context
        self.start_timeout = start_timeout
        self.extra_body = dict(extra_body or {})
        self.check_weights_path = (
            _is_local(self.base_url) if check_weights_path is None else check_weights_path
        )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_client = client is None
        # No connection-pool cap: the gateway bounds concurrency; vLLM batches whatever it gets.
        self._client = client or httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._version = policy_version
        self._cpu_server: bool | None = None  # learnt from /server_info on the first reload
        self._warned_tied_head = False
        self._diagnosis: asyncio.Task[None] | None = None
        self._reloading = 0  # reloads in flight: a generation overlapping one is marked in `extra`
        self._reload_lock = asyncio.Lock()

    @property
    def policy_version(self) -> int:
        return self._version

    def _url(self, path: str) -> str:
        # A caller-supplied client may have no base_url.
        return f"{self.base_url}{path}"

    async def start(self) -> None:
        """Wait until the server answers `/health`, then learn the served model name if not given."""
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
                    f"vLLM server at {self.base_url} was not healthy within {self.start_timeout:.0f} s "
                    f"(last: {last}); is it running, and has it finished loading the model?"
                )
            await asyncio.sleep(0.5)
        if self.model is None or self.max_context is None:
            await self._discover_model()

    async def _discover_model(self) -> None:
        r = await self._request("GET", "/v1/models", timeout=10.0)
        data = orjson.loads(r.content).get("data") or []
        if not data:
            raise EngineError(f"vLLM server at {self.base_url} serves no model")
        entry = next((d for d in data if d.get("id") == self.model), data[0])
        self.model = str(entry["id"])
        if self.max_context is None and isinstance(entry.get("max_model_len"), int):
            self.max_context = entry["max_model_len"]

    async def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One HTTP call; transport failures (refused, reset, timed out) mean the server is unavailable."""
        try:
            return await self._client.request(method, self._url(path), **kw)
        except httpx.TransportError as e:  # refused, reset, timed out, broken protocol
            raise EngineUnavailable(f"vLLM at {self.base_url}: {type(e).__name__}: {e}") from e

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One HTTP call with vLLM's error statuses mapped onto the engine errors."""
        r = await self._send(method, path, **kw)
        if r.status_code < 400:
            return r
        msg = f"vLLM {method} {path} -> HTTP {r.status_code}: {_error_message(r)}"
        if r.status_code == 429:
            raise EngineOverloaded(msg, retry_after=_retry_after(r))
        if r.status_code >= 500:
            # vLLM answers 500 when its engine core has died and 503 while it is not ready.
            raise EngineUnavailable(msg, retry_after=_retry_after(r))
        too_long = _context_error(msg) if r.status_code == 400 else None
        if too_long is not None:
            raise too_long
        raise EngineError(msg)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, images: Sequence[Image] = ()
    ) -> GenerateResult:
        if images:
            # /v1/completions takes a token prompt or text, never images with it; the chat endpoint
            # would re-render the conversation and break the exact-ids record.
            raise EngineError(
                "the vLLM engine sends token prompts to /v1/completions, which takes no images; "
                "serve a vision-language policy with the builtin or sglang engine"
            )
        if self.model is None:
            await self._discover_model()
        max_tokens = sampling.max_tokens
        if self.max_context is not None:
            room = self.max_context - len(prompt_ids)
            if room <= 0:
                raise ContextLengthExceeded(len(prompt_ids), self.max_context)
            max_tokens = min(max_tokens, room)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
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

        version, reloading = self._version, self._reloading
        # Cancelling this await closes the connection; vLLM aborts the request on the disconnect.
        r = await self._request(
            "POST",
            "/v1/completions",
            content=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        try:
            choice = orjson.loads(r.content)["choices"][0]
            ids: list[int] = choice["token_ids"]
            logprobs: list[float | None] = (choice.get("logprobs") or {}).get("token_logprobs") or []
            raw_finish = choice.get("finish_reason")
            stop_reason = choice.get("stop_reason")
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise EngineError(f"vLLM returned an unexpected completion body: {r.text[:300]}") from e
        if ids is None:
            raise EngineError("vLLM returned no token_ids (a vLLM too old for `return_token_ids`?)")
        if len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            raise EngineError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} token ids")
        finish = _FINISH.get(raw_finish or "", "abort")
        if finish == "stop" and stop_reason is None and ids:
            # vLLM's stop on EOS: the EOS id is the last sampled id (and its stop_reason is null).
            stop_reason = ids[-1]
        extra: dict[str, object] = {}
        if raw_finish not in _FINISH:
            extra["vllm_finish_reason"] = raw_finish
        if (end := policy_version_end(version, reloading, self._version, self._reloading)) is not None:
            extra["policy_version_end"] = end
        return GenerateResult(
            completion_ids=ids,
            logprobs=[float(lp) for lp in logprobs if lp is not None],
            finish_reason=finish,
            policy_version=version,
            stop_reason=stop_reason,
            extra=extra,
        )

    async def load_weights(self, path: str) -> int:
        """Reload the server's weights from `path` (a directory on the server's filesystem).

        Needs the server started with VLLM_SERVER_DEV_MODE=1 (for `/collective_rpc`). The prefix cache
        is reset afterwards so no KV computed with the old weights is reused.
        """
        if self.check_weights_path:
            check_weights_dir(path)
        async with self._reload_lock:
            self._reloading += 1
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
                        f"vLLM at {self.base_url} serves no /collective_rpc: start it with "
                        "VLLM_SERVER_DEV_MODE=1"
                    )
                if r.status_code >= 400:
                    # The server answered, so the reload itself failed (a 5xx here may mean it is dying).
                    raise EngineError(f"vLLM failed to reload weights from {path!r}: {_error_message(r)}")
                self._version += 1
                await self._reset_prefix_cache()
                if view is None:
                    self._check_tied_head(path)
            finally:
                self._reloading -= 1
                if view is not None:  # vLLM read the weights during the call
                    shutil.rmtree(view, ignore_errors=True)
        return self._version

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
            r = await self._send("GET", "/server_info", timeout=30.0)
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
            f"vLLM reloaded weights (policy version {self._version}) but refused to reset its prefix cache"
        )

    async def close(self) -> None:
        if self._diagnosis is not None and not self._diagnosis.done():
            self._diagnosis.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._diagnosis
        if self._owns_client:
            await self._client.aclose()
