"""An in-process engine: any Hugging Face causal LM, continuously batched on one worker thread.

Vision-language models (a directory whose config has a vision tower, e.g. Qwen2-VL) load with
AutoModelForImageTextToText and take images: their pixel inputs are computed by
`openforgerl.vision.checked_vision_inputs` (the trainer uses the same function), prefilled with the
prompt, and positions are the model's 3-D M-RoPE ids; during decode each row continues from its own
rope delta, so image and text requests share the continuous batch.

All torch work runs on a single worker thread, so the event loop never blocks and torch's intra-op
pool (torch.get_num_threads()) is used by one caller at a time. Requests wait in a queue; at every
step boundary the worker prefills newly arrived prompts, merges them into the running batch (left
padding, a shared DynamicCache) and decodes one token for every row. Rows that finish or whose
caller went away are dropped from the cache before the next step.

A prompt that opens with the tokens of a finished sequence (an agent's next turn; the system prompt
every rollout shares) starts from that sequence's KV, kept in `prefix_cache`, and runs only the rest.

Long prompts (real agent CLIs send 9k-22k tokens) are kept to bounded memory. On the CPU, SDPA runs
its flash kernel. A row with nothing to mask but the future (a cold prompt, unpadded) takes its
causal form, with no mask and memory linear in the length, so such a prompt runs whole, and a prompt
longer than `prefill_chunk_tokens` that arrives with others runs alone and joins their batch after.
Any other prefill (padded rows, the rest of a prompt after a cached prefix) needs an explicit mask:
transformers builds a (rows, 1, new, cached + new) boolean one and torch turns it into a float one
per layer, about 5 bytes per (new token, earlier token) pair; two ~20k-token prompts prefilled
together, padded, peaked at 4.7 GB (`benchmarks/long_context.py`). Those prefill through the KV
cache in chunks of about `prefill_chunk_tokens` tokens across the rows (2048 x 32k positions:
330 MB), which changes results only by float rounding.

Seeded requests sample with their own torch.Generator, so their draws do not depend on batch mates.
Batched float arithmetic can still differ from a solo run in the last bits of the logits; a sample
whose uniform draw lands within that distance of a boundary could flip, which in practice is never.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DynamicCache,
)
from transformers.cache_utils import DynamicLayer

from openforgerl.engines.base import (
    PREFIX_CACHE_MB,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    GenerateResult,
    SamplingParams,
    TokenSink,
    completion_room,
)
from openforgerl.engines.prefix_cache import KV, PrefixCache
from openforgerl.images import Image
from openforgerl.rendering import generation_eos_ids
from openforgerl.vision import (
    VisionProcessor,
    checked_vision_inputs,
    is_vision_model,
    load_model,
    load_processor,
    mask_unsampleable,
    rope_positions,
    unsampleable_token_ids,
)

# Prompt tokens per prefill pass, summed over the batch's rows (each row gets at least
# MIN_PREFILL_CHUNK of its own, so a wide batch does not take hundreds of passes).
PREFILL_CHUNK_TOKENS = 2048
MIN_PREFILL_CHUNK = 256


@dataclass(slots=True, eq=False)
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    # sampling.max_tokens clamped to the room left in the context.
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateResult]
    generator: torch.Generator | None
    # A VLM request's pixel inputs (pixel_values, image_grid_thw), on the CPU until prefill.
    vision: dict[str, torch.Tensor] | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # The caller's token sink (a streamed answer): each sampled id, on the caller's loop.
    on_tokens: TokenSink | None = None
    done: bool = False
    # Set from the event loop when the caller is cancelled; read by the worker at the next step.
    cancelled: bool = False


@dataclass(slots=True)
class _Batch:
    rows: list[_Request]
    cache: DynamicCache
    # (B, L): 1 where the cache holds a real token, 0 for left padding; L is the cache length.
    mask: torch.Tensor
    # (B,): the ids sampled last step (not in the cache yet) and their positions (for a VLM the text
    # position, which is the token index plus the row's rope delta).
    next_ids: torch.Tensor
    next_pos: torch.Tensor


@dataclass(slots=True)
class _Swap:
    state: dict[str, torch.Tensor]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: object) -> None:
    """Resolve `future` on its own loop from the worker thread; exceptions are set, not returned."""

    def resolve() -> None:
        if future.done():  # the awaiting task was cancelled
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


def _stream(loop: asyncio.AbstractEventLoop, sink: TokenSink, token: int) -> None:
    try:
        loop.call_soon_threadsafe(sink, (token,))
    except RuntimeError:  # the caller's loop is closed
        pass


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    # F.pad lists (left, right) pairs starting from the last dimension.
    pads = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [n, 0]
    return F.pad(t, pads)


def _kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, for editing their `keys`/`values` tensors (only done when all are DynamicLayer)."""
    return list(cache.layers)


def _checkpoint_names_to_model(state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors to the model's parameter names.

    save_pretrained writes some models (Qwen2-VL: `model.layers.*`, `visual.*`) under the names of an
    older layout than their modules' (`model.language_model.layers.*`, `model.visual.*`);
    from_pretrained renames them on load with the model's registered renamings, and so does this.
    """
    params = model.state_dict()
    if all(k in params for k in state):
        return state
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    out = {}
    for key, tensor in state.items():
        name = key
        for renaming in renamings:
            if name in params:
                break
            name, _ = renaming.rename_source_key(name)
        out[name] = tensor
    return out


def _read_state_dict(path: str) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class TransformersEngine:
    """The Engine protocol over a local HF causal-LM directory (CPU or CUDA).

    `max_queue` bounds the requests waiting for a batch slot (not those already decoding). A
    completion keeps the token that ended it: an EOS id (stop_reason None), a stop_token_ids entry
    (stop_reason that id) or the token that completed a stop string (stop_reason that string).
    `stats` counts batches, forward steps, rows and tokens, for tests and metrics.
    `prefill_chunk_tokens` bounds the prompt tokens of one prefill pass (0: every prompt in one pass).
    """

    name = "transformers"
    supports_response_format = False  # samples freely: no constrained decoding

    def __init__(
        self,
        model_dir: str | Path,
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        max_batch_size: int = 16,
        max_queue: int = 256,
        batch_wait_ms: float = 2.0,
        max_context: int | None = None,
        policy_version: int = 0,
        threads: int | None = None,
        prefix_cache_mb: float = PREFIX_CACHE_MB,
        prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be at least 1")
        if prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be 0 (off) or positive")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.model_dir = str(model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        # float32 on CPU (bf16 matmuls there are slow and lossy); the checkpoint's own dtype on GPU.
        self.dtype: torch.dtype | str = dtype or (torch.float32 if self.device.type == "cpu" else "auto")
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        # torch's intra-op pool is process-wide: capping it leaves cores to the rollouts' sandboxes.
        self.threads = threads
        self.batch_wait = batch_wait_ms / 1000.0
        # KV of finished sequences for later prompts that open alike (a rollout's next turn, the
        # shared system prompt); 0 turns it off. Cleared at every weight swap.
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20))

        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.vision = is_vision_model(self.model_dir)
        self.processor: VisionProcessor | None = load_processor(self.model_dir) if self.vision else None
        self.tokenizer: Any = (
            self.processor.tokenizer if self.processor else AutoTokenizer.from_pretrained(self.model_dir)
        )
        text_config = self.config.get_text_config()
        self.max_context: int = max_context or int(text_config.max_position_embeddings)
        self.vocab_size = int(text_config.vocab_size)
        self.eos_token_ids = self._find_eos_ids()

        self.stats: dict[str, int] = {
            "batches": 0,  # prefill passes (each starts or joins rows)
            "steps": 0,  # forward passes of any kind
            "max_batch_size": 0,
            "requests": 0,
            "joined": 0,  # requests merged into an already running batch
            "cancelled": 0,  # rows dropped because their caller went away
            "running": 0,  # rows in the batch after the last step
            "tokens": 0,
            "prefill_tokens": 0,  # prompt tokens run through the model (cached prefixes are not)
            "prefill_chunks": 0,  # extra prefill passes: chunks of a prefill after its first
        }
        self._model: Any = None
        # Continuous joins pad caches on the left, which only plain full-attention layers allow.
        self._mergeable = False
        self._causal_kernel = False
        self._version = policy_version  # a resumed run's engine starts at its checkpoint's version
        self._cond = threading.Condition()
        self._pending: deque[_Request] = deque()
        # Weight swaps waiting for the running batch to drain, applied in order.
        self._swaps: deque[_Swap] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None

    def _find_eos_ids(self) -> frozenset[int]:
        # The generation config's ids first: the gateway's renderer reads the same (turn ends).
        eos: Any = list(generation_eos_ids(self.model_dir)) or None
        if eos is None:
            eos = self.config.get_text_config().eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._threads_before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        model = await asyncio.to_thread(self._load_model)
        self._model = model
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._unsampleable = torch.tensor(unsampleable_token_ids(model), dtype=torch.long)
        self._mergeable = all(
            type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers
        )
        # Attention that needs no materialised mask for a plain causal pass (see _prefill_forward).
        attn = str(getattr(model.config, "_attn_implementation", None) or "")
        self._causal_kernel = attn == "sdpa" or attn.startswith("flash")
        self._closing = False
        self._thread = threading.Thread(target=self._worker, name="transformers-engine", daemon=True)
        self._thread.start()

    def _load_model(self) -> Any:
        return load_model(self.model_dir, self.dtype).to(self.device).eval()

    async def close(self) -> None:
        """Stop the worker; running and queued requests end with finish_reason "abort"."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        await asyncio.to_thread(thread.join)
        self._thread = None
        if self.threads:  # the process's other torch work (e.g. the demo's SFT next) gets them back
            torch.set_num_threads(self._threads_before)

    def _check_running(self) -> None:
        if self._thread is None or self._closing:
            raise EngineUnavailable("transformers engine is not running")

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        images: Sequence[Image] = (),
        on_tokens: TokenSink | None = None,
    ) -> GenerateResult:
        self._check_running()
        if images and self.processor is None:
            raise EngineError(f"the model in {self.model_dir} takes no images")
        if not prompt_ids:
            raise EngineError("empty prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise EngineError(f"prompt ids must lie in [0, {self.vocab_size})")
        vision = await self._vision_inputs(prompt_ids, images) if self.processor else None
        if not sampling.temperature >= 0 or not 0 < sampling.top_p <= 1 or sampling.max_tokens < 1:
            raise EngineError(f"invalid sampling parameters: {sampling}")
        max_tokens = completion_room(len(prompt_ids), sampling.max_tokens, self.max_context)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        loop = asyncio.get_running_loop()
        req = _Request(
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            loop=loop,
            future=loop.create_future(),
            generator=generator,
            vision=vision,
            on_tokens=on_tokens,
        )
        with self._cond:
            if self._closing:
                raise EngineUnavailable("transformers engine is closing")
            if len(self._pending) >= self.max_queue:
                raise EngineOverloaded(f"{len(self._pending)} requests already queued")
            self._pending.append(req)
            self._cond.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            with self._cond:
                if req in self._pending:
                    self._pending.remove(req)
            raise

    async def _vision_inputs(
        self, prompt_ids: list[int], images: Sequence[Image]
    ) -> dict[str, torch.Tensor] | None:
        """The images' pixel inputs (off the event loop), checked against the prompt's placeholders."""
        assert self.processor is not None
        try:
            return await asyncio.to_thread(checked_vision_inputs, self.processor, prompt_ids, images)
        except ValueError as e:
            raise EngineError(str(e)) from None

    async def load_weights(self, path: str) -> int:
        """Copy a save_pretrained checkpoint's weights into the model once no row is mid-generation.

        While a swap waits, new requests stay queued and running rows finish, so every result's
        tokens come from one policy version.
        """
        self._check_running()
        state = await asyncio.to_thread(self._validated_state, path)
        loop = asyncio.get_running_loop()
        swap = _Swap(state=state, loop=loop, future=loop.create_future())
        with self._cond:
            if self._closing:
                raise EngineUnavailable("transformers engine is closing")
            self._swaps.append(swap)
            self._cond.notify()
        return await swap.future

    def _validated_state(self, path: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, checked against the model so a swap never half-applies."""
        state = _checkpoint_names_to_model(_read_state_dict(path), self._model)
        params = self._model.state_dict()
        unexpected = sorted(set(state) - set(params))
        if unexpected:
            raise EngineError(f"checkpoint {path} has tensors the model lacks: {unexpected[:5]}")
        # Tied weights (e.g. lm_head = embed_tokens) are saved once; they share storage in the model.
        loaded_ptrs = {params[k].data_ptr() for k in state}
        missing = sorted(k for k in set(params) - set(state) if params[k].data_ptr() not in loaded_ptrs)
        if missing:
            raise EngineError(f"checkpoint {path} lacks tensors: {missing[:5]}")
        for k, t in state.items():
            if t.shape != params[k].shape:
                raise EngineError(
                    f"checkpoint {path}: {k} has shape {tuple(t.shape)}, want {params[k].shape}"
                )
        return state

    # ---- worker thread -------------------------------------------------------------------------

    def _worker(self) -> None:
        batch: _Batch | None = None
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._pending or batch or self._swaps or self._closing):
                        self._cond.wait()
                    if batch is None and self._pending and not self._swaps:
                        self._wait_for_company()
                    if self._closing:
                        break
                    swap = self._swaps.popleft() if batch is None and self._swaps else None
                    admit: list[_Request] = []
                    if not self._swaps and swap is None and (batch is None or self._mergeable):
                        free = self.max_batch_size - (len(batch.rows) if batch else 0)
                        while self._pending and len(admit) < free:
                            admit.append(self._pending.popleft())
                if swap is not None:
                    self._apply_swap(swap)
                    continue
                try:
                    if admit:
                        joined = self._prefill(admit)
                        if batch is None:
                            batch = joined
                        elif joined is not None:
                            self.stats["joined"] += len(joined.rows)
                            batch = self._merge(batch, joined)
                    if batch is not None:
                        batch = self._decode(batch)
                except Exception as e:
                    rows = (batch.rows if batch else []) + admit
                    for row in {id(r): r for r in rows}.values():
                        if not row.done:
                            _deliver(row.loop, row.future, EngineError(f"generation failed: {e!r}"))
                    batch = None
                    self.stats["running"] = 0
        self._abort_all(batch)

    def _wait_for_company(self) -> None:
        """Hold a fresh batch back briefly so requests arriving together are prefilled together."""
        deadline = time.monotonic() + self.batch_wait
        while len(self._pending) < self.max_batch_size and not self._closing and not self._swaps:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _abort_all(self, batch: _Batch | None) -> None:
        with self._cond:
            rows = (batch.rows if batch else []) + list(self._pending)
            self._pending.clear()
            swaps = list(self._swaps)
            self._swaps.clear()
        for row in rows:
            self._finish(row, "abort", None)
        for swap in swaps:
            _deliver(swap.loop, swap.future, EngineUnavailable("engine closed before the weights loaded"))

    def _apply_swap(self, swap: _Swap) -> None:
        try:
            params = self._model.state_dict()
            for name, tensor in swap.state.items():
                params[name].copy_(tensor)
            self.prefix_cache.clear()  # its KV came from the old weights
            self._version += 1
            result: object = self._version
        except Exception as e:
            result = EngineError(f"loading weights failed: {e!r}")
        _deliver(swap.loop, swap.future, result)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache, **vision: Any
    ) -> Any:
        self.stats["steps"] += 1
        self.stats["max_batch_size"] = max(self.stats["max_batch_size"], ids.shape[0])
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **vision,
        )
        return out.logits[:, -1, :]

    def _prefill_forward(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache
    ) -> Any:
        """`_forward` over a prefill's new tokens `ids` (B, S), whose `cache` already holds the
        first mask.shape[1] - S columns of `mask`, in chunks of the span; the last chunk's logits."""
        span = ids.shape[1]
        past = mask.shape[1] - span
        budget = self.prefill_chunk_tokens
        step = max(budget // ids.shape[0], min(MIN_PREFILL_CHUNK, budget)) if budget else span
        if span <= step or (past == 0 and self._causal_kernel and bool(mask.all())):
            # Nothing to mask but the future: SDPA's causal kernel runs without a mask in memory
            # linear in the length, and faster than any chunking.
            return self._forward(ids, mask, pos, cache)
        logits = None
        for start in range(0, span, step):
            end = min(start + step, span)
            if start:
                self.stats["prefill_chunks"] += 1
            # The mask covers the cache so far plus this chunk; later columns do not exist yet.
            logits = self._forward(ids[:, start:end], mask[:, : past + end], pos[..., start:end], cache)
        return logits

    def _prefill(self, reqs: list[_Request]) -> _Batch | None:
        """Prefill the prompts of `reqs`, those opening with a cached prefix from its KV (only the
        rest runs), the others whole; returns them as one batch."""
        reqs = [r for r in reqs if not r.cancelled]
        if not reqs:
            return None
        self.stats["batches"] += 1
        self.stats["requests"] += len(reqs)
        hits, cold = [], []
        for r in reqs:
            hit = self.prefix_cache.lookup(r.prompt_ids) if self._caches_prefixes(r) else None
            if hit is None:
                cold.append(r)
            else:
                hits.append((r, *hit))
        cached = self._prefill_cached(hits) if hits else None
        whole = self._prefill_together(cold) if cold else None
        if cached is None or whole is None:
            return cached or whole
        return self._merge(cached, whole)

    def _caches_prefixes(self, req: _Request) -> bool:
        # Cached rows join by merging caches, as continuous batching does; a VLM's M-RoPE positions
        # depend on the images, so its prompts always run whole.
        return self.prefix_cache.max_bytes > 0 and self._mergeable and req.vision is None

    def _prefill_cached(self, hits: list[tuple[_Request, int, KV]]) -> _Batch | None:
        """Prefill prompts whose first `cached` tokens' KV the prefix cache gave, in one pass over
        the rest of each. Row i's cache is [padding | its cached KV], its input [padding | the rest],
        so the mask has a hole between the two where the lengths differ."""
        width = max(c for _, c, _ in hits)
        rest = [r.prompt_ids[c:] for r, c, _ in hits]
        span = max(map(len, rest))
        cache = DynamicCache(config=self._model.config)
        for layer in range(len(hits[0][2])):
            keys = torch.cat([_pad_left(kv[layer][0], width - c, -2) for _, c, kv in hits])
            values = torch.cat([_pad_left(kv[layer][1], width - c, -2) for _, c, kv in hits])
            cache.update(keys, values, layer)
        rows = [(width - c, c, span - len(t), t) for (_, c, _), t in zip(hits, rest, strict=True)]
        ids = torch.tensor([[0] * gap + t for _, _, gap, t in rows], device=self.device)
        mask = torch.tensor(
            [[0] * p + [1] * c + [0] * gap + [1] * len(t) for p, c, gap, t in rows], device=self.device
        )
        pos = torch.tensor(
            [[0] * gap + list(range(c, c + len(t))) for _, c, gap, t in rows], device=self.device
        )
        self.stats["prefill_tokens"] += sum(map(len, rest))
        logits = self._prefill_forward(ids, mask, pos, cache)
        lengths = torch.tensor([len(r.prompt_ids) for r, _, _ in hits], device=self.device)
        batch = _Batch(
            rows=[r for r, _, _ in hits],
            cache=cache,
            mask=mask,
            next_ids=torch.zeros_like(lengths),
            next_pos=lengths,
        )
        return self._sample_step(batch, logits)

    def _prefill_together(self, reqs: list[_Request]) -> _Batch | None:
        """Prefill whole prompts: together, except that each prompt longer than a chunk runs alone,
        unpadded, and joins the others' batch after (padding would give the whole prompt an
        explicit mask, which the causal kernel spares a row of its own)."""
        chunk = self.prefill_chunk_tokens
        long = [r for r in reqs if len(r.prompt_ids) > chunk] if chunk and self._mergeable else []
        if len(reqs) < 2 or not long or self.processor is not None:
            return self._prefill_rows(reqs)
        short = [r for r in reqs if len(r.prompt_ids) <= chunk]
        batch: _Batch | None = None
        for group in [[r] for r in long] + ([short] if short else []):
            part = self._prefill_rows(group)
            if batch is None or part is None:
                batch = batch or part
            else:
                batch = self._merge(batch, part)
        return batch

    def _prefill_rows(self, reqs: list[_Request]) -> _Batch | None:
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in reqs], device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs], device=self.device
        )
        cache = DynamicCache(config=self._model.config)
        lengths = torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device)
        self.stats["prefill_tokens"] += int(lengths.sum())
        if self.processor is not None:
            # One pass: the image features go in with the prompt (VLM prompts are not chunked).
            pos, next_pos, vision = self._vision_prefill(reqs, ids, mask)
            logits = self._forward(ids, mask, pos, cache, **vision)
            next_pos = lengths + next_pos
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self._prefill_forward(ids, mask, pos, cache)
            next_pos = lengths
        # next_ids is filled in by _sample_step.
        batch = _Batch(
            rows=reqs, cache=cache, mask=mask, next_ids=torch.zeros_like(lengths), next_pos=next_pos
        )
        return self._sample_step(batch, logits)

    def _vision_prefill(
        self, reqs: list[_Request], ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(3, B, L) M-RoPE positions, (B,) rope deltas and the pixel kwargs of a VLM prefill."""
        assert self.processor is not None
        rows = [r.vision for r in reqs if r.vision is not None]
        vision: dict[str, torch.Tensor] = {}
        if rows:
            vision = {k: torch.cat([v[k] for v in rows]).to(self.device) for k in rows[0]}
        grid = vision.get("image_grid_thw")
        pos, deltas = rope_positions(self._model, ids, mask, grid, self.processor.image_token_id)
        return pos, deltas.to(self.device), vision

    def _decode(self, batch: _Batch) -> _Batch | None:
        pruned = self._prune(batch)  # callers that went away since the last step
        if pruned is None:
            return None
        batch = pruned
        mask = F.pad(batch.mask, (0, 1), value=1)
        pos = batch.next_pos[:, None]
        if self.processor is not None:
            pos = pos[None].expand(3, -1, -1)  # text tokens: the same position on all three axes
        logits = self._forward(batch.next_ids[:, None], mask, pos, batch.cache)
        batch.mask = mask
        batch.next_pos = batch.next_pos + 1
        return self._sample_step(batch, logits)

    def _sample_step(self, batch: _Batch, logits: torch.Tensor) -> _Batch | None:
        ids, logprobs = self._sample(batch.rows, logits)
        self.stats["tokens"] += len(ids)
        for i, (row, tok, lp) in enumerate(zip(batch.rows, ids, logprobs, strict=True)):
            row.completion_ids.append(tok)
            row.logprobs.append(lp)
            if row.on_tokens is not None:  # queued on the loop ahead of the result, so it comes first
                _stream(row.loop, row.on_tokens, tok)
            if (end := self._end(row, tok)) is not None:
                if self._caches_prefixes(row):  # before the caller hears: its next turn may follow at once
                    self._keep_prefix(batch, i)
                self._finish(row, *end)
        batch.next_ids = torch.tensor(ids, device=self.device)
        return self._prune(batch)

    def _sample(self, rows: list[_Request], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Sample each row's next id; logprobs are under logits / T (raw logits when T == 0)."""
        logits = logits.float()
        logits = mask_unsampleable(logits, self._unsampleable)  # processor-only tokens: never sampled
        temps = torch.tensor([r.sampling.temperature or 1.0 for r in rows], device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        ids = logp.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if r.sampling.temperature > 0]
        if sampled:
            probs = logp[sampled].exp()
            top_p = torch.tensor([rows[i].sampling.top_p for i in sampled], device=logits.device)
            if bool((top_p < 1).any()):
                sorted_p, order = probs.sort(-1, descending=True)
                # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
                drop = (sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]) & (top_p[:, None] < 1)
                probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
            for j, i in enumerate(sampled):
                ids[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
        chosen = logp.gather(-1, ids[:, None]).squeeze(-1)
        return ids.tolist(), chosen.tolist()

    def _keep_prefix(self, batch: _Batch, i: int) -> None:
        """Offer row i's KV (its prompt and completion but the last token, which never ran) to the
        prefix cache: the positions its mask marks real (indexing copies them out of the batch)."""
        row = batch.rows[i]
        tokens = row.prompt_ids + row.completion_ids[:-1]
        real = batch.mask[i].nonzero().squeeze(-1)  # padding may lie between cached and new tokens
        if len(real) != len(tokens):  # never expected; a wrong entry would corrupt later prompts
            return
        kv = [(la.keys[i : i + 1, :, real], la.values[i : i + 1, :, real]) for la in _kv_layers(batch.cache)]
        self.prefix_cache.insert(tokens, kv)

    def _end(self, row: _Request, tok: int) -> tuple[FinishReason, str | int | None] | None:
        """(finish reason, stop reason) when `tok` ends the row's completion, else None."""
        if tok in row.sampling.stop_token_ids:
            return "stop", tok
        if tok in self.eos_token_ids:
            return "stop", None
        if row.sampling.stop and (stop := self._stop_string(row)) is not None:
            return "stop", stop
        if len(row.completion_ids) >= row.max_tokens:
            return "length", None
        return None

    def _stop_string(self, row: _Request) -> str | None:
        """The stop string that the newest token completed, if any (earliest in the text wins).

        The whole completion is decoded each step because a token can finish a multi-byte character
        that an earlier decode showed as a replacement character.
        """
        text: str = self.tokenizer.decode(row.completion_ids, skip_special_tokens=False)
        hits = [(pos, s) for s in row.sampling.stop if s and (pos := text.find(s)) >= 0]
        return min(hits)[1] if hits else None

    def _finish(self, row: _Request, reason: FinishReason, stop_reason: str | int | None) -> None:
        row.done = True
        result = GenerateResult(
            completion_ids=row.completion_ids,
            logprobs=row.logprobs,
            finish_reason=reason,
            policy_version=self._version,
            stop_reason=stop_reason,
        )
        _deliver(row.loop, row.future, result)

    def _prune(self, batch: _Batch) -> _Batch | None:
        """Drop finished and cancelled rows from every tensor, and padding no remaining row needs."""
        keep = [i for i, r in enumerate(batch.rows) if not (r.done or r.cancelled)]
        self.stats["cancelled"] += sum(r.cancelled and not r.done for r in batch.rows)
        self.stats["running"] = len(keep)
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            index = torch.tensor(keep, device=self.device)
            batch.cache.batch_select_indices(index)
            batch.rows = [batch.rows[i] for i in keep]
            batch.mask = batch.mask[index]
            batch.next_ids = batch.next_ids[index]
            batch.next_pos = batch.next_pos[index]
            if self._mergeable:
                # Leading columns that are padding in every remaining row would cost every later step.
                lead = int(batch.mask.any(0).int().argmax())
                if lead:
                    for layer in _kv_layers(batch.cache):
                        layer.keys = layer.keys[..., lead:, :]
                        layer.values = layer.values[..., lead:, :]
                    batch.mask = batch.mask[:, lead:]
        return batch

    def _merge(self, a: _Batch, b: _Batch) -> _Batch:
        """Stack two batches, left-padding the shorter cache so real tokens stay right-aligned."""
        width = max(a.mask.shape[1], b.mask.shape[1])
        pad_a, pad_b = width - a.mask.shape[1], width - b.mask.shape[1]
        for la, lb in zip(_kv_layers(a.cache), _kv_layers(b.cache), strict=True):
            la.keys = torch.cat([_pad_left(la.keys, pad_a, -2), _pad_left(lb.keys, pad_b, -2)])
            la.values = torch.cat([_pad_left(la.values, pad_a, -2), _pad_left(lb.values, pad_b, -2)])
        a.rows = a.rows + b.rows
        a.mask = torch.cat([_pad_left(a.mask, pad_a, -1), _pad_left(b.mask, pad_b, -1)])
        a.next_ids = torch.cat([a.next_ids, b.next_ids])
        a.next_pos = torch.cat([a.next_pos, b.next_pos])
        return a
