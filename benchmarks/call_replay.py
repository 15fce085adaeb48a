"""Where an evaluation's or a training run's model time went, from its recorded calls alone (no model).

    .venv/bin/python benchmarks/call_replay.py RUN/gateway.db --model MODEL_DIR [--cache-mb 0 256 512 2048]

From the gateway's store (`gateway.db`): how busy the engine was (the wall time with at least one
call in flight, the mean number in flight, completion tokens per second of wall), and the calls
replayed in the order they started and ended through the built-in engine's prefix cache at each
size: how many prompt tokens a prefill would have run. The replay keeps what the engine keeps: a
prompt's KV when it is prefilled, the whole sequence's when it ends; an entry costs the model's KV
bytes per token (fp32). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from openforgerl.engines.prefix_cache import KV, PrefixCache
from openforgerl.store.records import full_prompts
from openforgerl.store.sqlite import call_from_row, connect_read_only


def kv_shape(model: Path) -> tuple[int, int]:
    """(layers x KV heads, head dim) of the model's cache."""
    cfg = AutoConfig.from_pretrained(model)
    cfg = getattr(cfg, "text_config", cfg)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * heads, dim


def busy(calls: list[tuple[float, float, int]]) -> dict[str, float]:
    """calls: (start, end, completion tokens)."""
    events = sorted([(s, 1) for s, _, _ in calls] + [(e, -1) for _, e, _ in calls])
    in_flight, last, busy_s, area = 0, events[0][0], 0.0, 0.0
    for t, step in events:
        if in_flight:
            busy_s += t - last
            area += in_flight * (t - last)
        in_flight, last = in_flight + step, t
    wall = max(e for _, e, _ in calls) - min(s for s, _, _ in calls)
    tokens = sum(n for _, _, n in calls)
    return {
        "calls": len(calls),
        "wall_s": round(wall, 1),
        "busy_s": round(busy_s, 1),
        "mean_in_flight": round(area / busy_s, 2) if busy_s else 0.0,
        "completion_tokens": tokens,
        "completion_tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "mean_latency_s": round(sum(e - s for s, e, _ in calls) / len(calls), 2),
    }


def replay(
    order: list[tuple[float, int, int]],
    prompts: dict[int, list[int]],
    done: dict[int, list[int]],
    mb: float,
    shape: tuple[int, int],
) -> dict[str, Any]:
    cache = PrefixCache(int(mb * 2**20))
    zero = torch.zeros(1)

    def kv(n: int) -> KV:  # stands for n tokens' KV: the bytes counted, none allocated
        t = zero.expand(1, shape[0], n, shape[1])
        return [(t, t)]

    prefilled = 0
    for _, ends, cid in order:
        prompt = prompts[cid]
        if ends:
            cache.insert(done[cid], kv(len(done[cid])))
            continue
        hit = cache.lookup(prompt)
        prefilled += len(prompt) - (hit[0] if hit else 0)
        cache.insert(prompt, kv(len(prompt)))
    total = sum(map(len, prompts.values()))
    return {
        "cache_mb": mb,
        "prompt_tokens": total,
        "prefilled_tokens": prefilled,
        "prefilled_fraction": round(prefilled / total, 4) if total else 0.0,
        **{k: cache.stats[k] for k in ("lookups", "hits", "evictions")},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("db", type=Path, help="a run's gateway.db")
    ap.add_argument("--model", type=Path, required=True, help="the model the calls ran on (its KV size)")
    ap.add_argument("--cache-mb", type=float, nargs="+", default=[0, 256, 512, 1024, 2048])
    args = ap.parse_args(argv)
    conn = connect_read_only(args.db)
    calls = [call_from_row(r) for r in conn.execute("SELECT * FROM calls ORDER BY rollout_id, seq")]
    prompts: dict[int, list[int]] = {}
    for rollout in {c.rollout_id for c in calls}:
        prompts |= full_prompts([c for c in calls if c.rollout_id == rollout])
    timed = {c.id: (c.created_at - c.latency_ms / 1000, c.created_at) for c in calls if c.id is not None}
    done = {c.id: prompts[c.id] + c.completion_ids for c in calls if c.id is not None}
    order = sorted(
        [(s, 0, cid) for cid, (s, _) in timed.items()] + [(e, 1, cid) for cid, (_, e) in timed.items()]
    )
    shape = kv_shape(args.model)
    result = {
        "db": str(args.db),
        "engine": busy([(*timed[c.id], len(c.completion_ids)) for c in calls if c.id is not None]),
        "prefix_cache": [replay(order, prompts, done, mb, shape) for mb in args.cache_mb],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
