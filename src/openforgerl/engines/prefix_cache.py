"""Automatic prefix caching for the in-process engine: the KV of finished sequences, reused by later
prompts that open with the same tokens (what vLLM and SGLang do in their own engines).

Agent rollouts are made for it. A harness's turn t + 1 prompt is its turn t prompt, the completion
the engine sampled and the tool's result (the gateway's token memory keeps the sampled ids, so the
prefix matches token for token), and every rollout of a run opens with the same system prompt and
tools. Without a cache each turn runs the whole conversation again.

An entry is the per-layer (keys, values) of one sequence, each (1, kv_heads, n, head_dim), for its
first n tokens. A lookup finds the entry sharing the longest prefix with the prompt (at least
`min_tokens`, and at most all but the prompt's last token, which must run to give the next logits)
and returns that many positions of its KV: causal attention makes the KV of a prefix independent of
what followed it. Entries are bounded by bytes, least recently used out first; one that is a prefix
of a newer entry is dropped, since the newer one answers every lookup it could. The owner clears
the cache whenever the weights change.

Entries are found a block of 16 tokens at a time, as in vLLM: a hash of each block's prefix maps to
the entries that open with it, so a lookup or an insert costs a few dict probes per block, not a
scan of every entry; the match is then extended token by token and checked against the tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (1, heads, n, dim)
BLOCK = 16


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """One hash per full block: hashes[b] stands for tokens[: (b + 1) * BLOCK]."""
    out: list[int] = []
    h = 0
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, *tokens[i : i + BLOCK]))
        out.append(h)
    return out


@dataclass(slots=True)
class _Entry:
    tokens: list[int]
    hashes: list[int]
    kv: KV
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = BLOCK) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = max(BLOCK, min_tokens)  # matches are found a block at a time
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._holding: dict[int, set[int]] = {}  # block-prefix hash -> entries that open with it
        self._ending: dict[int, set[int]] = {}  # hash of an entry's last full block -> entries
        self._next_id = 0
        self.bytes = 0
        self.stats = {"lookups": 0, "hits": 0, "hit_tokens": 0, "inserts": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, KV] | None:
        """(n, the KV of prompt[:n]) for the longest cached prefix, or None below `min_tokens`."""
        self.stats["lookups"] += 1
        key, n = -1, 0
        for b, h in enumerate(block_hashes(prompt)):
            holders = self._holding.get(h)
            if not holders:
                break
            key, n = next(iter(holders)), (b + 1) * BLOCK
        if key < 0:
            return None
        entry = self._entries[key]
        if entry.tokens[:n] != prompt[:n]:  # a hash collision: never trust a hash alone
            return None
        limit = min(len(entry.tokens), len(prompt) - 1)  # the prompt's last token must run
        while n < limit and entry.tokens[n] == prompt[n]:
            n += 1
        n = min(n, limit)
        if n < self.min_tokens:
            return None
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += n
        return n, [(k[:, :, :n], v[:, :, :n]) for k, v in entry.kv]

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Keep `kv` (owned by the cache from now on) as the KV of `tokens`."""
        if self.max_bytes <= 0 or len(tokens) < self.min_tokens:
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return
        hashes = block_hashes(tokens)
        for h in hashes:  # entries this one extends answer no lookup it does not
            for key in list(self._ending.get(h, ())):
                old = self._entries[key].tokens
                if len(old) <= len(tokens) and old == tokens[: len(old)]:
                    self._drop(key)
        while self._entries and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["evictions"] += 1
        key = self._next_id
        self._next_id += 1
        self._entries[key] = _Entry(list(tokens), hashes, kv, nbytes)
        for h in hashes:
            self._holding.setdefault(h, set()).add(key)
        self._ending.setdefault(hashes[-1], set()).add(key)
        self.bytes += nbytes
        self.stats["inserts"] += 1

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        for h in entry.hashes:
            holders = self._holding[h]
            holders.discard(key)
            if not holders:
                del self._holding[h]
        ending = self._ending[entry.hashes[-1]]
        ending.discard(key)
        if not ending:
            del self._ending[entry.hashes[-1]]
        self.bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._holding.clear()
        self._ending.clear()
        self.bytes = 0
