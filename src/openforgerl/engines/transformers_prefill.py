"""What the built-in engine's prefill passes feed the model (`transformers_engine.py`): which
prompts run in this pass (`this_pass`), and the padded inputs of whole prompts (`whole_prompts`)
and of prompts that resume from a cached prefix's KV (`after_cached_prefixes`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, PretrainedConfig

from openforgerl.engines.prefix_cache import KV, PrefixCache
from openforgerl.engines.transformers_batch import Request, new_cache, pad_left, shared_prefix

# A prompt waits one prefill pass for the KV of another that opens alike only when that spares
# it at least this many tokens: a pass of its own costs about as much as a few dozen tokens.
SHARED_PREFIX_GAIN = 64

CacheHit = tuple[Request, int, KV]


def this_pass(
    reqs: list[Request], prefix_cache: PrefixCache, caches: Callable[[Request], bool]
) -> tuple[list[CacheHit], list[Request], list[Request]]:
    """(cache hits, cold prompts) to prefill now, and the prompts that wait a pass for the KV of a
    prompt of this pass that opens like them (`caches`: whether a request may use the cache)."""
    hits: list[CacheHit] = []
    cold: list[Request] = []
    now: list[Request] = []
    waiting: list[Request] = []
    for r in reqs:
        if not caches(r):
            cold.append(r)
            continue
        hit = prefix_cache.lookup(r.prompt_ids)
        have = hit[0] if hit else 0
        if any(waits_for(r, o, have) for o in now):
            waiting.append(r)
            continue
        now.append(r)
        if hit is None:
            cold.append(r)
        else:
            hits.append((r, *hit))
    return hits, cold, waiting


def waits_for(req: Request, other: Request, cached: int = 0) -> bool:
    """Whether `req`, whose first `cached` tokens the prefix cache holds, waits for `other`'s KV."""
    return shared_prefix(req.prompt_ids, other.prompt_ids) >= cached + SHARED_PREFIX_GAIN


def whole_prompts(reqs: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of whole prompts, left-padded to the longest."""
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids for r in reqs], device=device)
    mask = torch.tensor(
        [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs], device=device
    )
    return ids, mask


def after_cached_prefixes(
    hits: list[CacheHit], config: PretrainedConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache]:
    """(ids, mask, positions, cache) of prompts whose first tokens' KV the prefix cache gave. Row
    i's cache is [padding | its cached KV], its input [padding | the rest], so the mask has a hole
    between the two where the lengths differ."""
    width = max(c for _, c, _ in hits)
    rest = [r.prompt_ids[c:] for r, c, _ in hits]
    span = max(map(len, rest))
    cache = new_cache(config)
    for layer in range(len(hits[0][2])):
        keys = torch.cat([pad_left(kv[layer][0], width - c, -2) for _, c, kv in hits])
        values = torch.cat([pad_left(kv[layer][1], width - c, -2) for _, c, kv in hits])
        cache.update(keys, values, layer)
    rows = [(width - c, c, span - len(t), t) for (_, c, _), t in zip(hits, rest, strict=True)]
    ids = torch.tensor([[0] * gap + t for _, _, gap, t in rows], device=device)
    mask = torch.tensor(
        [[0] * p + [1] * c + [0] * gap + [1] * len(t) for p, c, gap, t in rows], device=device
    )
    pos = torch.tensor([[0] * gap + list(range(c, c + len(t))) for _, c, gap, t in rows], device=device)
    return ids, mask, pos, cache
