"""Harness-sized prompts: kit models with more positions, and the built-in engine prefilling prompts
longer than the default 4,096 positions (in chunks where attention needs a mask)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import openforgerl.modelkit as modelkit
from openforgerl.cli import main as cli
from openforgerl.engines.base import ContextLengthExceeded, GenerateResult, SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.modelkit import (
    MAX_POSITIONS,
    MAX_POSITIONS_LIMIT,
    cached_model,
    init_model,
    init_vision_model,
)
from tests.engine_helpers import running

LONG = 16384
# Recorded logprobs vs one teacher-forced forward pass over prompt + completion (float32, CPU).
LOGPROB_TOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SEEDED = SamplingParams(temperature=1.0, max_tokens=6, seed=11)


@pytest.fixture(scope="module")
def long_model_dir() -> Path:
    """The kit's tiny model at 16,384 positions (cached apart from the default one)."""
    return cached_model("tiny", 0, max_positions=LONG)


@pytest.fixture(scope="module")
def reference(long_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(long_model_dir, dtype=torch.float32).eval()


def random_prompt(n: int, seed: int) -> list[int]:
    """`n` ids of ordinary (non-special) tokens."""
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


def teacher_logprobs(
    model: Any, prompt_ids: list[int], result: GenerateResult, temperature: float
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + result.completion_ids])).logits[0].float()
    logits = logits[len(prompt_ids) - 1 : -1] / (temperature or 1.0)
    ids = torch.tensor(result.completion_ids)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, ids).squeeze(-1)


def worst_gap(
    model: Any, prompts: list[list[int]], params: list[SamplingParams], results: list[GenerateResult]
) -> float:
    worst = 0.0
    for p, s, r in zip(prompts, params, results, strict=True):
        assert len(r.logprobs) == len(r.completion_ids) > 0
        gap = (teacher_logprobs(model, p, r, s.temperature) - torch.tensor(r.logprobs)).abs().max().item()
        worst = max(worst, gap)
    return worst


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=300))


# ---- model kit ---------------------------------------------------------------------------------


def test_max_positions_sets_config_and_tokenizer_and_keeps_the_weights(
    long_model_dir: Path, tiny_model_dir: Path
) -> None:
    config = json.loads((long_model_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == LONG
    assert AutoTokenizer.from_pretrained(long_model_dir).model_max_length == LONG
    assert (
        json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"] == MAX_POSITIONS
    )
    assert AutoTokenizer.from_pretrained(tiny_model_dir).model_max_length == MAX_POSITIONS
    # Rotary positions: the context length changes no weight.
    long_state, default_state = (
        load_file(long_model_dir / "model.safetensors"),
        load_file(tiny_model_dir / "model.safetensors"),
    )
    assert long_state.keys() == default_state.keys()
    assert all(torch.equal(long_state[k], default_state[k]) for k in long_state)


def test_cached_models_are_keyed_by_max_positions(long_model_dir: Path, tiny_model_dir: Path) -> None:
    assert long_model_dir != tiny_model_dir
    assert f"ctx{LONG}" in long_model_dir.name and "ctx" not in tiny_model_dir.name
    assert cached_model("tiny", 0, max_positions=MAX_POSITIONS) == tiny_model_dir  # the default's key


@pytest.mark.parametrize("bad", [0, -1, MAX_POSITIONS_LIMIT + 1, True, 2.5, "8192"])
def test_max_positions_is_validated(bad: Any, tmp_path: Path) -> None:
    for build in (init_model, init_vision_model):
        with pytest.raises(ValueError, match="max_positions"):
            build(tmp_path / "m", max_positions=bad)
    with pytest.raises(ValueError, match="max_positions"):
        cached_model("tiny", 0, max_positions=bad)
    assert not (tmp_path / "m").exists()  # refused before writing anything


def test_vision_model_takes_max_positions(tmp_path: Path) -> None:
    out = init_vision_model(tmp_path / "vlm", max_positions=8192)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["max_position_embeddings"] == 8192
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 8192


def test_cli_model_init_max_positions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def fake_init(out: str, **kwargs: Any) -> Path:
        calls.append(kwargs)
        return Path(out)

    monkeypatch.setattr(modelkit, "init_model", fake_init)
    runner = CliRunner()
    ok = runner.invoke(cli, ["model", "init", str(tmp_path / "m"), "--max-positions", "32768"])
    assert ok.exit_code == 0, ok.output
    assert calls == [{"size": "tiny", "seed": 0, "max_positions": 32768}]
    default = runner.invoke(cli, ["model", "init", str(tmp_path / "d")])
    assert default.exit_code == 0 and calls[-1]["max_positions"] == MAX_POSITIONS
    bad = runner.invoke(cli, ["model", "init", str(tmp_path / "b"), "--max-positions", "0"])
    assert (
        bad.exit_code == 2 and "--max-positions" in bad.output and "max_positions must lie in" in bad.output
    )
    assert len(calls) == 2


# ---- engine ------------------------------------------------------------------------------------


def test_serves_prompts_longer_than_the_default_context(long_model_dir: Path, reference: Any) -> None:
    """Two cold 6-7k-token prompts together (each prefilled alone, unpadded, then batched), and a
    later turn whose 3k new tokens after a cached prefix prefill in chunks of 2048."""
    first = [random_prompt(7000, 1), random_prompt(6100, 2)]
    params = [GREEDY, SEEDED]

    async def main() -> tuple[list[GenerateResult], list[int], GenerateResult, dict[str, int], int]:
        # A long batch wait: the two requests must meet in one prefill.
        async with running(long_model_dir, batch_wait_ms=500) as engine:
            assert engine.max_context == LONG
            results = list(
                await asyncio.gather(*(engine.generate(p, s) for p, s in zip(first, params, strict=True)))
            )
            assert engine.stats["batches"] == 1
            passes = engine.stats["steps"]
            # The next turn: the first prompt, its completion and a 3k-token tool result.
            turn = first[0] + results[0].completion_ids + random_prompt(3000, 3)
            later = await engine.generate(turn, SEEDED)
            return results, turn, later, dict(engine.stats), passes

    results, turn, later, stats, passes = run(main())
    # Each long prompt ran in one pass (the causal kernel needs no mask), then both decoded together.
    assert passes == 2 + max(len(r.completion_ids) for r in results) - 1
    assert stats["prefill_tokens"] == 7000 + 6100 + len(turn) - (7000 + len(results[0].completion_ids) - 1)
    assert stats["prefill_chunks"] == 1  # the later turn's 3,000 + 1 new tokens: two passes
    assert worst_gap(reference, [*first, turn], [*params, SEEDED], [*results, later]) < LOGPROB_TOL


def test_chunked_prefill_of_a_padded_batch_changes_nothing(long_model_dir: Path, reference: Any) -> None:
    """Padded rows prefilled in chunks give what one pass gives, and what a full forward gives.

    With 512-token chunks the 900-token prompt runs alone (longer than a chunk) and the other three
    together, padded, in chunks of max(512 // 3, 256) = 256 tokens: two passes. Without chunking all
    four run in one padded pass."""
    prompts = [random_prompt(n, 10 + n) for n in (900, 500, 380, 300)]
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=5), GREEDY]

    async def generate(chunk: int) -> tuple[list[GenerateResult], int]:
        async with running(
            long_model_dir, prefill_chunk_tokens=chunk, prefix_cache_mb=0, batch_wait_ms=500
        ) as engine:
            results = await asyncio.gather(
                *(engine.generate(p, s) for p, s in zip(prompts, params, strict=True))
            )
            assert engine.stats["batches"] == 1
            return list(results), engine.stats["prefill_chunks"]

    chunked, chunks = run(generate(512))
    whole, none = run(generate(0))
    assert chunks == 1 and none == 0
    for a, b in zip(chunked, whole, strict=True):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < LOGPROB_TOL
    assert worst_gap(reference, prompts, params, chunked) < LOGPROB_TOL


def test_a_prompt_over_max_positions_is_refused(long_model_dir: Path, tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(long_model_dir) as engine:
            with pytest.raises(ContextLengthExceeded):
                await engine.generate(random_prompt(LONG, 4), GREEDY)
            with pytest.raises(ContextLengthExceeded):
                await engine.generate(random_prompt(LONG + 500, 4), GREEDY)
        async with running(tiny_model_dir) as engine:  # the default model: 4,096 positions
            with pytest.raises(ContextLengthExceeded):
                await engine.generate(random_prompt(6000, 4), GREEDY)

    run(main())


def test_prefill_chunk_tokens_is_validated(long_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        TransformersEngine(long_model_dir, prefill_chunk_tokens=-1)
