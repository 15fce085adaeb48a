"""Harness-sized prompts on the built-in engine and the embedded trainer, on the CPU.

Real agent CLIs send 9k-22k-token prompts (Claude Code's second call about 15k tokens, Qwen Code
about 22k): a long system prompt and tool list that every rollout shares, then the task. This
measures, for the tiny kit model made with `--max-positions 32768`:

- engine, cold: a ~20k-token harness-like turn on an empty prefix cache (median wall seconds of
  `--runs` runs, prompt tokens the model ran, peak RSS);
- engine, warm: the next rollout's first turn, the same ~19k-token system prompt and tools with a
  different task, which the prefix cache serves all but the task of;
- engine, cold batch: two such turns arriving together (different tasks, so different lengths: in
  one pass the shorter row is padded and attention takes an explicit mask);
- trainer: one forward + backward (and AdamW step) of the embedded trainer's policy
  (`Policy.logprobs`, its training forward) on a 16k-token sample, with the loss on a 512-token
  completion (an RL sample) and on every token (the worst case for the LM head's logits).

Each setting runs in its own process, with this process's environment (set OMP_WAIT_POLICY here);
peak RSS is sampled per phase every few ms, and the process's high-water mark is given too. The
engine runs once with chunked prefill (the default) and once with `prefill_chunk_tokens=0` (every
prompt in one pass, as before chunking). Prints one JSON object.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/long_context.py [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MAX_POSITIONS = 32768
SHARED_TOKENS = 19_000  # system prompt + tools, the part every rollout shares
TASK_TOKENS = 1_000  # the task, different per rollout
TRAIN_TOKENS = 16_384

_WORDS = (
    "file path command output test repository branch commit diff patch error line function class "
    "module import return value string number list object field schema user task tool call result "
    "shell directory search edit write read permission network sandbox timeout retry step plan todo "
    "issue review format lint build install package version config option flag argument default"
).split()


def _text(rng: random.Random, words: int) -> str:
    sentences = []
    while words > 0:
        n = min(words, rng.randint(8, 20))
        words -= n
        s = " ".join(rng.choice(_WORDS) for _ in range(n))
        sentences.append(s[0].upper() + s[1:] + ".")
    return " ".join(sentences)


def _tools(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        params = {
            f"{rng.choice(_WORDS)}_{j}": {
                "type": rng.choice(["string", "integer", "boolean"]),
                "description": _text(rng, 25),
            }
            for j in range(rng.randint(2, 6))
        }
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}_{rng.choice(_WORDS)}",
                    "description": _text(rng, 120),
                    "parameters": {"type": "object", "properties": params, "required": list(params)[:1]},
                },
            }
        )
    return out


def harness_prompts(
    tokenizer: Any, tasks: int, shared: int = SHARED_TOKENS, task: int = TASK_TOKENS
) -> list[list[int]]:
    """`tasks` prompts (a first turn each, with the generation prompt) sharing a system prompt and 24
    tools of about `shared` tokens, each with its own task of about `task` tokens."""
    rng = random.Random(0)
    tools = _tools(rng, 24)
    paragraphs = [_text(rng, 80) for _ in range(2000)]

    def render(system_paragraphs: int, task_text: str) -> list[int]:
        messages = [
            {"role": "system", "content": "\n\n".join(paragraphs[:system_paragraphs])},
            {"role": "user", "content": task_text},
        ]
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_dict=False
        )
        return list(ids)

    # The shared part grows about linearly with the system prompt's paragraphs: two renders fit it.
    short, long_ = len(render(10, "")), len(render(110, ""))
    k = max(0, round(10 + (shared - short) * 100 / (long_ - short)))
    task_texts = [f"Task {i}: " + _text(random.Random(100 + i), int(task * 0.75)) for i in range(tasks)]
    return [render(k, t) for t in task_texts]


class PeakRSS:
    """The process's RSS sampled every few milliseconds on a thread; `peak_mb` since the last reset."""

    def __init__(self, interval: float = 0.003) -> None:
        import psutil

        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def reset(self) -> None:
        self._peak = self._proc.memory_info().rss

    def peak_mb(self) -> float:
        self._peak = max(self._peak, self._proc.memory_info().rss)
        return round(self._peak / 2**20, 1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _max_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


async def _engine_child(model: str, runs: int, chunk: int, max_tokens: int) -> dict[str, Any]:
    from openforgerl.engines.base import SamplingParams
    from openforgerl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(model, device="cpu", prefill_chunk_tokens=chunk)
    await engine.start()
    prompts = harness_prompts(engine.tokenizer, 2 * runs + 2)
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rss = PeakRSS()

    async def turn(*ps: list[int]) -> dict[str, Any]:
        before = dict(engine.stats)
        hits = engine.prefix_cache.stats["hit_tokens"]
        rss.reset()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, params) for p in ps))
        return {
            "wall_s": round(time.perf_counter() - t0, 3),
            "prompt_tokens": sum(map(len, ps)),
            "prefill_tokens": engine.stats["prefill_tokens"] - before["prefill_tokens"],
            "cached_tokens": engine.prefix_cache.stats["hit_tokens"] - hits,
            "forward_passes": engine.stats["steps"] - before["steps"],
            "completion_tokens": sum(len(r.completion_ids) for r in results),
            "peak_rss_mb": rss.peak_mb(),
        }

    cold, warm = [], []
    try:
        await turn([1, 2, 3])  # warm-up: first-call allocations and kernels
        for i in range(runs):
            engine.prefix_cache.clear()
            cold.append(await turn(prompts[2 * i]))
            warm.append(await turn(prompts[2 * i + 1]))
        engine.prefix_cache.clear()
        batch = await turn(prompts[-2], prompts[-1][: len(prompts[-1]) - 200])
    finally:
        rss.close()
        await engine.close()
    summary = {
        phase: {k: _median(rows, k) for k in rows[0]} | {"runs": rows}
        for phase, rows in (("cold", cold), ("warm", warm))
    }
    return {
        "prefill_chunk_tokens": chunk,
        "shared_prefix_tokens": shared,
        **summary,
        "cold_batch_of_2": batch,
        "process_max_rss_mb": _max_rss_mb(),
    }


def _trainer_child(model: str, tokens: int, completion: int) -> dict[str, Any]:
    from openforgerl.rl.trainer import Policy
    from openforgerl.rollouts.trajectory import Sample

    policy = Policy(model, lr=1e-5, device="cpu")
    rng = random.Random(0)
    vocab = int(policy.model.get_input_embeddings().num_embeddings)
    ids = [rng.randrange(vocab - 16) for _ in range(tokens)]
    completion = min(completion, tokens - 1)
    sample = Sample(
        rollout_id="bench",
        reward=1.0,
        branch_id=0,
        branch_reason="",
        input_ids=ids,
        loss_mask=[0] * (tokens - completion) + [1] * completion,
        logprobs=[0.0] * tokens,
        advantage=1.0,
    )
    rss = PeakRSS()
    rows = []
    for _ in range(2):
        rss.reset()
        t0 = time.perf_counter()
        batch = policy.collate([sample])
        lp = policy.logprobs(batch)
        loss = -(lp * batch.mask).sum() / batch.mask.sum()
        loss.backward()
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        rows.append({"wall_s": round(time.perf_counter() - t0, 3), "peak_rss_mb": rss.peak_mb()})
    rss.close()
    return {
        "tokens": tokens,
        "loss_tokens": completion,
        "forward_backward_step": rows,
        "wall_s": rows[-1]["wall_s"],
        "process_max_rss_mb": _max_rss_mb(),
    }


def _child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", help=f"a model directory (default: the kit's tiny model at {MAX_POSITIONS} positions)"
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens sampled per turn")
    ap.add_argument("--train-tokens", type=int, default=TRAIN_TOKENS)
    ap.add_argument("--skip-unchunked", action="store_true", help="only the default (chunked) engine")
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--child", choices=["engine", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--loss-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child == "engine":
        result = asyncio.run(_engine_child(args.model, args.runs, args.chunk, args.max_tokens))
        print(json.dumps(result))
        return
    if args.child == "trainer":
        print(json.dumps(_trainer_child(args.model, args.train_tokens, args.loss_tokens)))
        return

    import torch

    from openforgerl.engines.transformers_engine import PREFILL_CHUNK_TOKENS
    from openforgerl.modelkit import cached_model

    model = args.model or str(cached_model("tiny", 0, max_positions=MAX_POSITIONS))
    common = ["--model", model, "--runs", str(args.runs), "--max-tokens", str(args.max_tokens)]
    chunks = [PREFILL_CHUNK_TOKENS] + ([] if args.skip_unchunked else [0])
    report: dict[str, Any] = {
        "model": model,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "engine": {
            ("chunked" if c else "unchunked"): _child([*common, "--child", "engine", "--chunk", str(c)])
            for c in chunks
        },
        # Loss on the last turn's completion (an RL sample), and on every token (the worst case:
        # the LM head's logits for the whole sequence).
        "trainer": {}
        if args.skip_trainer
        else {
            name: _child(
                [
                    "--model",
                    model,
                    "--child",
                    "trainer",
                    "--train-tokens",
                    str(args.train_tokens),
                    "--loss-tokens",
                    str(n),
                ]
            )
            for name, n in (("loss_on_512", 512), ("loss_on_all", args.train_tokens))
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
