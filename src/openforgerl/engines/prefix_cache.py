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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (1, heads, n, dim)


@dataclass(slots=True)
class _Entry:
    tokens: torch.Tensor  # (n,) int64 on the CPU
    kv: KV
    nbytes: int


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 16) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._next_id = 0
        self.bytes = 0
        self.stats = {"lookups": 0, "hits": 0, "hit_tokens": 0, "inserts": 0, "evictions": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[int, KV] | None:
        """(n, the KV of prompt[:n]) for the longest cached prefix, or None below `min_tokens`."""
        self.stats["lookups"] += 1
        if not self._entries or len(prompt) <= self.min_tokens:
            return None
        p = torch.tensor(prompt)
        best, best_id = 0, -1
        for key, entry in self._entries.items():
            n = _common_prefix(entry.tokens, p)
            if n > best:
                best, best_id = n, key
        best = min(best, len(prompt) - 1)
        if best < self.min_tokens:
            return None
        entry = self._entries[best_id]
        self._entries.move_to_end(best_id)
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += best
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in entry.kv]

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Keep `kv` (owned by the cache from now on) as the KV of `tokens`."""
        if self.max_bytes <= 0 or len(tokens) < self.min_tokens:
            return
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return
        t = torch.tensor(tokens)
        for key in [k for k, e in self._entries.items() if len(e.tokens) <= len(t)]:
            old = self._entries[key]
            if _common_prefix(old.tokens, t) == len(old.tokens):
                self._drop(key)
        while self._entries and self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats["evictions"] += 1
        self._entries[self._next_id] = _Entry(t, kv, nbytes)
        self._next_id += 1
        self.bytes += nbytes
        self.stats["inserts"] += 1

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
