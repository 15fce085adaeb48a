"""The built-in engine's running batch (`transformers_engine.py`): a request's state, the batch
of rows sharing one left-padded DynamicCache, and the edits of that cache when rows join
(`merge`), leave (`select`) or finish with a prefix worth keeping (`row_kv`).

Everything here runs on the engine's worker thread but `deliver` and `stream`, which hand a
result or a token back to the caller's event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from openforgerl.engines.base import GenerateResult, SamplingParams, TokenSink
from openforgerl.engines.prefix_cache import KV


@dataclass(slots=True, eq=False)
class Request:
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
class Batch:
    rows: list[Request]
    cache: DynamicCache
    # (B, L): 1 where the cache holds a real token, 0 for left padding; L is the cache length.
    mask: torch.Tensor
    # (B,): the ids sampled last step (not in the cache yet) and their positions (for a VLM the text
    # position, which is the token index plus the row's rope delta).
    next_ids: torch.Tensor
    next_pos: torch.Tensor


@dataclass(slots=True)
class Swap:
    state: dict[str, torch.Tensor]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]


def deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: object) -> None:
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


def stream(loop: asyncio.AbstractEventLoop, sink: TokenSink, token: int) -> None:
    try:
        loop.call_soon_threadsafe(sink, (token,))
    except RuntimeError:  # the caller's loop is closed
        pass


SLACK_MIN = 64  # tokens of room a layer's buffers keep beyond what they hold (and a quarter more)


class SlackLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into buffers with room to grow, so that a
    decode step writes its token in place: DynamicLayer copies the whole cache each step
    (torch.cat), 13% of an evaluation's engine time with SmolLM2. An edit that replaces the tensors
    (rows leaving, batches merging, padding trimmed) leaves them outside the buffers; the next
    update copies them into new ones, once, as DynamicLayer's would have every step."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # set by lazy_initialization
        used = keys.shape[-2] if keys.numel() else 0
        end = used + key_states.shape[-2]
        fits = _holds(self._key_buf, keys, key_states, end)
        if not (fits and _holds(self._value_buf, values, value_states, end)):
            room = end + max(SLACK_MIN, end // 4)
            self._key_buf = _regrown(keys, key_states, used, room)
            self._value_buf = _regrown(values, value_states, used, room)
        assert self._key_buf is not None and self._value_buf is not None
        self._key_buf[..., used:end, :] = key_states
        self._value_buf[..., used:end, :] = value_states
        self.keys, self.values = self._key_buf[..., :end, :], self._value_buf[..., :end, :]
        return self.keys, self.values


def _holds(buf: torch.Tensor | None, held: torch.Tensor, new: torch.Tensor, end: int) -> bool:
    """Whether `held` is still the start of `buf` (no edit replaced it) and `buf` has room to `end`."""
    return (
        buf is not None
        and buf.shape[-2] >= end
        and buf.shape[:-2] == new.shape[:-2]
        and (held.numel() == 0 or (held.data_ptr() == buf.data_ptr() and held.stride() == buf.stride()))
    )


def _regrown(held: torch.Tensor, new: torch.Tensor, used: int, room: int) -> torch.Tensor:
    buf = new.new_empty((*new.shape[:-2], room, new.shape[-1]))
    if used:
        buf[..., :used, :] = held
    return buf


def new_cache(config: Any) -> DynamicCache:
    """A DynamicCache for `config` whose plain layers are SlackLayers (sliding ones stay as they are)."""
    cache = DynamicCache(config=config)
    cache.layers = [SlackLayer() if type(la) is DynamicLayer else la for la in cache.layers]
    return cache


def pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    # F.pad lists (left, right) pairs starting from the last dimension.
    pads = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [n, 0]
    return F.pad(t, pads)


def kv_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, for editing their `keys`/`values` tensors (only done when all are DynamicLayer)."""
    return list(cache.layers)


def kv_bytes_per_token(batch: Batch) -> int:
    """Bytes one token's keys and values take over all layers of the batch's cache."""
    return sum(2 * la.keys[0, :, 0].numel() * la.keys.element_size() for la in kv_layers(batch.cache))


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share from the start."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def row_kv(batch: Batch, i: int) -> tuple[list[int], KV] | None:
    """Row i's tokens (its prompt and completion but the last token, which never ran) and their KV,
    for the prefix cache: the positions its mask marks real (indexing copies them out of the batch).
    None when they do not match (never expected; a wrong entry would corrupt later prompts)."""
    row = batch.rows[i]
    tokens = row.prompt_ids + row.completion_ids[:-1]
    real = batch.mask[i].nonzero().squeeze(-1)  # padding may lie between cached and new tokens
    if len(real) != len(tokens):
        return None
    return tokens, [
        (la.keys[i : i + 1, :, real], la.values[i : i + 1, :, real]) for la in kv_layers(batch.cache)
    ]


def select(batch: Batch, keep: list[int], trim: bool) -> Batch:
    """Keep rows `keep` of every tensor; `trim`: also drop leading columns that are padding in
    every remaining row (they would cost every later step; only plain full-attention caches)."""
    index = torch.tensor(keep, device=batch.mask.device)
    batch.cache.batch_select_indices(index)
    batch.rows = [batch.rows[i] for i in keep]
    batch.mask = batch.mask[index]
    batch.next_ids = batch.next_ids[index]
    batch.next_pos = batch.next_pos[index]
    if trim:
        lead = int(batch.mask.any(0).int().argmax())
        if lead:
            for layer in kv_layers(batch.cache):
                layer.keys = layer.keys[..., lead:, :]
                layer.values = layer.values[..., lead:, :]
            batch.mask = batch.mask[:, lead:]
    return batch


def merge(a: Batch, b: Batch) -> Batch:
    """Stack two batches, left-padding the shorter cache so real tokens stay right-aligned."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    pad_a, pad_b = width - a.mask.shape[1], width - b.mask.shape[1]
    for la, lb in zip(kv_layers(a.cache), kv_layers(b.cache), strict=True):
        la.keys = torch.cat([pad_left(la.keys, pad_a, -2), pad_left(lb.keys, pad_b, -2)])
        la.values = torch.cat([pad_left(la.values, pad_a, -2), pad_left(lb.values, pad_b, -2)])
    a.rows = a.rows + b.rows
    a.mask = torch.cat([pad_left(a.mask, pad_a, -1), pad_left(b.mask, pad_b, -1)])
    a.next_ids = torch.cat([a.next_ids, b.next_ids])
    a.next_pos = torch.cat([a.next_pos, b.next_pos])
    return a
