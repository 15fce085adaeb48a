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

Decode steps (one new token a row) take their attention from `decode_attention.py`, which reads
the shared KV heads without copying them per query head; prefill passes keep transformers' SDPA.

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

The parts, each in its own module: the running batch, its requests and the edits of its KV cache
(`transformers_batch.py`), the sampler and the end of a completion (`transformers_sampler.py`),
a checkpoint read and checked for a weight swap (`transformers_weights.py`), the prefix cache
(`prefix_cache.py`), each prefill pass's prompts and inputs (`transformers_prefill.py`), the decode
attention (`decode_attention.py`). This module is the scheduler: the queue, the worker's loop and
the prefills.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DynamicCache,
)
from transformers.cache_utils import DynamicLayer

from openforgerl.engines import transformers_prefill as prefill
from openforgerl.engines.base import (
    PREFIX_CACHE_MB,
    EngineBase,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    FinishReason,
    GenerateResult,
    Generation,
    completion_room,
)
from openforgerl.engines.decode_attention import use_grouped_decode
from openforgerl.engines.prefix_cache import PrefixCache
from openforgerl.engines.transformers_batch import (
    Batch,
    Request,
    Swap,
    deliver,
    kv_bytes_per_token,
    merge,
    new_cache,
    row_kv,
    select,
    stream,
)
from openforgerl.engines.transformers_sampler import end_of, sample
from openforgerl.engines.transformers_weights import validated_state, validated_tensors
from openforgerl.images import Image
from openforgerl.rendering import generation_eos_ids
from openforgerl.vision import (
    VisionProcessor,
    checked_vision_inputs,
    is_vision_model,
    load_model,
    load_processor,
    rope_positions,
    unsampleable_token_ids,
)

# Prompt tokens per prefill pass, summed over the batch's rows (each row gets at least
# MIN_PREFILL_CHUNK of its own, so a wide batch does not take hundreds of passes).
PREFILL_CHUNK_TOKENS = 2048
MIN_PREFILL_CHUNK = 256


class TransformersEngine(EngineBase):
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
        self._pending: deque[Request] = deque()
        # Weight swaps waiting for the running batch to drain, applied in order.
        self._swaps: deque[Swap] = deque()
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
        if not self.vision:  # a VLM's vision tower attends its own way: left as loaded
            use_grouped_decode(model)
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

    def refuses_images(self) -> str | None:
        return None if self.processor is not None else f"the model in {self.model_dir} takes no images"

    async def _generate(self, call: Generation) -> GenerateResult:
        self._check_running()
        prompt_ids, sampling, images = call.prompt_ids, call.sampling, call.images
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
        req = Request(
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            loop=loop,
            future=loop.create_future(),
            generator=generator,
            vision=vision,
            on_tokens=call.on_tokens,
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
        state = await asyncio.to_thread(validated_state, path, self._model)
        return await self._swap(state)

    async def load_state(self, state: dict[str, torch.Tensor]) -> int:
        """`load_weights` from named tensors in memory (a trainer's, e.g. veRL's FSDP actor): checked
        against the model the same way, applied once no row is mid-generation; the new version."""
        self._check_running()
        state = await asyncio.to_thread(validated_tensors, dict(state), self._model, "the new weights")
        return await self._swap(state)

    async def _swap(self, state: dict[str, torch.Tensor]) -> int:
        loop = asyncio.get_running_loop()
        swap = Swap(state=state, loop=loop, future=loop.create_future())
        with self._cond:
            if self._closing:
                raise EngineUnavailable("transformers engine is closing")
            self._swaps.append(swap)
            self._cond.notify()
        return await swap.future

    # ---- worker thread -------------------------------------------------------------------------

    def _worker(self) -> None:
        batch: Batch | None = None
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
                    admit: list[Request] = []
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
                            batch = merge(batch, joined)
                    if batch is not None:
                        batch = self._decode(batch)
                except Exception as e:
                    rows = (batch.rows if batch else []) + admit
                    for row in {id(r): r for r in rows}.values():
                        if not row.done:
                            deliver(row.loop, row.future, EngineError(f"generation failed: {e!r}"))
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

    def _abort_all(self, batch: Batch | None) -> None:
        with self._cond:
            rows = (batch.rows if batch else []) + list(self._pending)
            self._pending.clear()
            swaps = list(self._swaps)
            self._swaps.clear()
        for row in rows:
            self._finish(row, "abort", None)
        for swap in swaps:
            deliver(swap.loop, swap.future, EngineUnavailable("engine closed before the weights loaded"))

    def _apply_swap(self, swap: Swap) -> None:
        try:
            params = self._model.state_dict()
            for name, tensor in swap.state.items():
                params[name].copy_(tensor)
            self.prefix_cache.clear()  # its KV came from the old weights
            self._version += 1
            result: object = self._version
        except Exception as e:
            result = EngineError(f"loading weights failed: {e!r}")
        deliver(swap.loop, swap.future, result)

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

    def _prefill(self, reqs: list[Request]) -> Batch | None:
        """Prefill the prompts of `reqs`, those opening with a cached prefix from its KV (only the
        rest runs), the others whole; returns them as one batch.

        A prompt that opens like another one of `reqs`, for more than the cache already gives it,
        waits one pass for that prompt's KV (a GRPO group's rollouts all send one first prompt,
        every rollout the same system prompt): each pass keeps its prompts' KV in the prefix
        cache, and the next pass serves the waiting prompts from there, as vLLM's automatic
        prefix caching does within a batch."""
        pending = [r for r in reqs if not r.cancelled]
        if not pending:
            return None
        self.stats["batches"] += 1
        self.stats["requests"] += len(pending)
        batch: Batch | None = None
        while pending:
            hits, cold, pending = prefill.this_pass(pending, self.prefix_cache, self._caches_prefixes)
            for part in (self._prefill_cached(hits) if hits else None, self._prefill_together(cold)):
                if part is not None:
                    self._keep_prompts(part, pending)
                    batch = part if batch is None else merge(batch, part)
        return batch

    def _keep_prompts(self, batch: Batch, waiting: list[Request]) -> None:
        """Offer to the prefix cache the prompts just prefilled that a waiting prompt opens like
        (only those: each offer copies the row's KV out of the batch)."""
        for i, row in enumerate(batch.rows):
            if self._caches_prefixes(row) and any(prefill.waits_for(w, row) for w in waiting):
                self._keep_prefix(batch, i)

    def _caches_prefixes(self, req: Request) -> bool:
        # Cached rows join by merging caches, as continuous batching does; a VLM's M-RoPE positions
        # depend on the images, so its prompts always run whole.
        return self.prefix_cache.max_bytes > 0 and self._mergeable and req.vision is None

    def _prefill_cached(self, hits: list[prefill.CacheHit]) -> Batch | None:
        """Prefill prompts whose first tokens' KV the prefix cache gave, in one pass over the rest of each."""
        ids, mask, pos, cache = prefill.after_cached_prefixes(hits, self._model.config, self.device)
        self.stats["prefill_tokens"] += sum(len(r.prompt_ids) - c for r, c, _ in hits)
        logits = self._prefill_forward(ids, mask, pos, cache)
        lengths = torch.tensor([len(r.prompt_ids) for r, _, _ in hits], device=self.device)
        batch = Batch(
            rows=[r for r, _, _ in hits],
            cache=cache,
            mask=mask,
            next_ids=torch.zeros_like(lengths),
            next_pos=lengths,
        )
        return self._sample_step(batch, logits)

    def _prefill_together(self, reqs: list[Request]) -> Batch | None:
        """Prefill whole prompts (None for none): together, except that each prompt longer than a
        chunk runs alone, unpadded, and joins the others' batch after (padding would give the whole
        prompt an explicit mask, which the causal kernel spares a row of its own)."""
        if not reqs:
            return None
        chunk = self.prefill_chunk_tokens
        long = [r for r in reqs if len(r.prompt_ids) > chunk] if chunk and self._mergeable else []
        if len(reqs) < 2 or not long or self.processor is not None:
            return self._prefill_rows(reqs)
        short = [r for r in reqs if len(r.prompt_ids) <= chunk]
        batch: Batch | None = None
        for group in [[r] for r in long] + ([short] if short else []):
            part = self._prefill_rows(group)
            if batch is None or part is None:
                batch = batch or part
            else:
                batch = merge(batch, part)
        return batch

    def _prefill_rows(self, reqs: list[Request]) -> Batch | None:
        ids, mask = prefill.whole_prompts(reqs, self.device)
        cache = new_cache(self._model.config)
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
        batch = Batch(
            rows=reqs, cache=cache, mask=mask, next_ids=torch.zeros_like(lengths), next_pos=next_pos
        )
        return self._sample_step(batch, logits)

    def _vision_prefill(
        self, reqs: list[Request], ids: torch.Tensor, mask: torch.Tensor
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

    def _decode(self, batch: Batch) -> Batch | None:
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

    def _sample_step(self, batch: Batch, logits: torch.Tensor) -> Batch | None:
        ids, logprobs = sample(batch.rows, logits, self._unsampleable)
        self.stats["tokens"] += len(ids)
        for i, (row, tok, lp) in enumerate(zip(batch.rows, ids, logprobs, strict=True)):
            row.completion_ids.append(tok)
            row.logprobs.append(lp)
            if row.on_tokens is not None:  # queued on the loop ahead of the result, so it comes first
                stream(row.loop, row.on_tokens, tok)
            if (end := end_of(row, tok, self.eos_token_ids, self.tokenizer)) is not None:
                if self._caches_prefixes(row):  # before the caller hears: its next turn may follow at once
                    self._keep_prefix(batch, i)
                self._finish(row, *end)
        batch.next_ids = torch.tensor(ids, device=self.device)
        return self._prune(batch)

    def _keep_prefix(self, batch: Batch, i: int) -> None:
        """Offer row i's KV to the prefix cache (not copied out when the cache could not hold it)."""
        if int(batch.mask[i].sum()) * kv_bytes_per_token(batch) > self.prefix_cache.max_bytes:
            return
        if (kept := row_kv(batch, i)) is not None:
            self.prefix_cache.insert(*kept)

    def _finish(self, row: Request, reason: FinishReason, stop_reason: str | int | None) -> None:
        row.done = True
        result = GenerateResult(
            completion_ids=row.completion_ids,
            logprobs=row.logprobs,
            finish_reason=reason,
            policy_version=self._version,
            stop_reason=stop_reason,
        )
        deliver(row.loop, row.future, result)

    def _prune(self, batch: Batch) -> Batch | None:
        """Drop finished and cancelled rows from every tensor, and padding no remaining row needs."""
        keep = [i for i, r in enumerate(batch.rows) if not (r.done or r.cancelled)]
        self.stats["cancelled"] += sum(r.cancelled and not r.done for r in batch.rows)
        self.stats["running"] = len(keep)
        if not keep:
            return None
        if len(keep) < len(batch.rows):
            batch = select(batch, keep, trim=self._mergeable)
        return batch
