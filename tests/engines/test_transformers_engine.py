"""TransformersEngine on the tiny kit model: batching, sampling, logprobs, cancellation, weight swaps."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from openforgerl.engines.base import (
    ContextLengthExceeded,
    Engine,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)
from openforgerl.engines.prefix_cache import PrefixCache
from openforgerl.engines.transformers_engine import TransformersEngine
from tests.engine_helpers import running

# Recorded logprobs vs a teacher-forced forward over prompt + completion, float32 on CPU.
# Measured at most 2.4e-6; batched rows differ from solo ones only in summation order.
LOGPROB_TOL = 1e-4

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# The random model's greedy text repeats one token; a seeded sample varies and replays exactly.
SEEDED = SamplingParams(temperature=1.0, max_tokens=24, seed=7)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # A tiny model gains nothing from a second thread, and OpenMP threads stall badly on shared cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _copy_model(src: Path, out: Path, scale: float = 1.0, eos: list[int] | None = None) -> Path:
    """A copy of `src` with the embedding (tied to the LM head) scaled and/or other EOS ids."""
    model: Any = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    model.save_pretrained(out)
    for f in src.iterdir():
        if not f.name.startswith(("model", "config")):  # tokenizer and generation files
            shutil.copy(f, out / f.name)
    if eos is not None:
        gen = json.loads((out / "generation_config.json").read_text())
        gen["eos_token_id"] = eos
        (out / "generation_config.json").write_text(json.dumps(gen))
    return out


@pytest.fixture(scope="module")
def sharp_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clearly different checkpoint: a 3x embedding makes the near-uniform random model peaked."""
    return _copy_model(tiny_model_dir, tmp_path_factory.mktemp("sharp"), scale=3.0)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout=120))


def prompt(engine: TransformersEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))


@functools.cache
def _reference_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def teacher_logprobs(
    model_dir: Path, prompt_ids: list[int], result: GenerateResult, temperature: float
) -> torch.Tensor:
    """Log-probabilities of the completion from one unbatched forward over prompt + completion."""
    model = _reference_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + result.completion_ids])).logits[0].float()
    logits = logits[len(prompt_ids) - 1 : -1]
    if temperature > 0:
        logits = logits / temperature
    ids = torch.tensor(result.completion_ids)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, ids).squeeze(-1)


async def wait_until(cond: Callable[[], bool]) -> None:
    """Poll a condition that the worker thread makes true (there is no event to await across threads)."""
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_is_an_engine(tiny_model_dir: Path) -> None:
    engine = TransformersEngine(tiny_model_dir)
    assert isinstance(engine, Engine)
    assert engine.name == "transformers"
    assert engine.max_context == engine.config.max_position_embeddings
    assert engine.policy_version == 0
    assert engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.eos_token_ids


def test_thread_cap_holds_while_serving_and_is_given_back(tiny_model_dir: Path) -> None:
    """eval caps the embedded engine's threads so sandboxes keep cores; the demo's SFT after an
    eval must get the process's threads back."""
    before = torch.get_num_threads()
    engine = TransformersEngine(tiny_model_dir, threads=1)

    async def serve() -> int:
        await engine.start()
        try:
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
            return torch.get_num_threads()
        finally:
            await engine.close()

    assert asyncio.run(serve()) == 1
    assert torch.get_num_threads() == before


def test_batching_batches(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            params = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
            texts = [f"def f{i}(x):" + " return x" * i for i in range(8)]
            results = await asyncio.gather(*(engine.generate(prompt(engine, t), params) for t in texts))
            tokens = sum(len(r.completion_ids) for r in results)
            assert engine.stats["tokens"] == tokens
            assert engine.stats["requests"] == 8
            assert engine.stats["max_batch_size"] > 1
            assert engine.stats["steps"] < tokens  # serial decoding needs one forward pass per token

    run(main)


def test_logprobs_match_teacher_forcing_when_batched(tiny_model_dir: Path) -> None:
    """Rows of different lengths, some joining a running batch, with every sampling mode."""
    settings = [
        SamplingParams(temperature=1.0, max_tokens=24, seed=1),
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=28, seed=2),
        SamplingParams(temperature=1.3, max_tokens=16, seed=3),
    ]

    async def main() -> None:
        async with running(tiny_model_dir, max_batch_size=8) as engine:
            texts = [
                "import os",
                "class Foo(object):\n    def __init__(self, a, b):",
                "x",
                "for i in range(10):",
            ]
            prompts = [prompt(engine, t) for t in texts]
            first = [
                asyncio.create_task(engine.generate(p, s)) for p, s in zip(prompts, settings, strict=True)
            ]
            await wait_until(lambda: engine.stats["tokens"] > 0)
            late = [
                asyncio.create_task(engine.generate(p[::-1], s))
                for p, s in zip(prompts, settings, strict=True)
            ]
            results = await asyncio.gather(*first, *late)
            assert engine.stats["joined"] >= 1  # the late ones joined the running batch

        worst = 0.0
        for p, s, r in zip(prompts + [p[::-1] for p in prompts], settings * 2, results, strict=True):
            assert len(r.logprobs) == len(r.completion_ids) > 0
            expected = teacher_logprobs(tiny_model_dir, p, r, s.temperature)
            worst = max(worst, (expected - torch.tensor(r.logprobs)).abs().max().item())
        assert worst < LOGPROB_TOL

    run(main)


def test_greedy_is_deterministic_and_batch_independent(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            p = prompt(engine, "def main():")
            alone = await engine.generate(p, GREEDY)
            others = [engine.generate(prompt(engine, "#" * i), GREEDY) for i in range(1, 6)]
            together, *_ = await asyncio.gather(engine.generate(p, GREEDY), *others)
            assert together.completion_ids == alone.completion_ids
            assert alone.finish_reason == "length" and len(alone.completion_ids) == GREEDY.max_tokens
            # top_p so small that only the argmax survives: greedy ids, temperature-1 logprobs.
            nucleus = await engine.generate(p, SamplingParams(temperature=1.0, top_p=1e-9, max_tokens=12))
            assert nucleus.completion_ids == alone.completion_ids
            assert nucleus.logprobs == pytest.approx(alone.logprobs, abs=LOGPROB_TOL)

    run(main)


def test_seed_reproducible_regardless_of_batch_mates(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            p = prompt(engine, "while True:")
            seeded = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
            alone = await engine.generate(p, seeded)
            mates = [engine.generate(p, SamplingParams(temperature=1.0, max_tokens=30)) for _ in range(4)]
            together, *_ = await asyncio.gather(engine.generate(p, seeded), *mates)
            assert together.completion_ids == alone.completion_ids
            other = await engine.generate(p, SamplingParams(temperature=1.0, max_tokens=20, seed=4321))
            assert other.completion_ids != alone.completion_ids

    run(main)


def test_stop_string_ends_at_the_completing_token(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            p = prompt(engine, "print(")
            free = await engine.generate(p, SEEDED)
            decode = engine.tokenizer.decode
            # The first token k whose text adds something, and a stop string made of what it completed.
            for k in range(2, len(free.completion_ids)):
                before, text = decode(free.completion_ids[:k]), decode(free.completion_ids[: k + 1])
                stop = before[-2:] + text[len(before) :]
                if text.startswith(before) and len(text) > len(before) and stop not in before:
                    break
            else:
                pytest.fail("no usable stop string in the greedy completion")
            r = await engine.generate(p, replace(SEEDED, stop=("\x00", stop)))
            assert r.completion_ids == free.completion_ids[: k + 1]
            assert (r.finish_reason, r.stop_reason) == ("stop", stop)

            tok = free.completion_ids[3]
            r = await engine.generate(p, replace(SEEDED, stop_token_ids=(tok,)))
            first = free.completion_ids.index(tok)
            assert r.completion_ids == free.completion_ids[: first + 1]
            assert (r.finish_reason, r.stop_reason) == ("stop", tok)

    run(main)


def test_eos_from_generation_config_stops(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            p = prompt(engine, "return")
            free = await engine.generate(p, SEEDED)
        eos = free.completion_ids[4]
        first = free.completion_ids.index(eos)
        async with running(_copy_model(tiny_model_dir, tmp_path, eos=[eos])) as engine:
            assert engine.eos_token_ids == {eos}
            r = await engine.generate(p, SEEDED)
            assert r.completion_ids == free.completion_ids[: first + 1]  # EOS is kept as the last id
            assert (r.finish_reason, r.stop_reason) == ("stop", None)

    run(main)


def test_cancellation_frees_the_row(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            p = prompt(engine, "import sys")
            long = SamplingParams(temperature=1.0, max_tokens=3000)
            task = asyncio.create_task(engine.generate(p, long))
            await wait_until(lambda: engine.stats["tokens"] >= 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: engine.stats["running"] == 0)
            assert engine.stats["cancelled"] == 1
            spent = engine.stats["tokens"]
            assert spent < long.max_tokens
            r = await engine.generate(p, GREEDY)  # the engine carries on
            assert engine.stats["tokens"] == spent + len(r.completion_ids)

    run(main)


def test_queue_limit_overloads(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir, max_batch_size=1, max_queue=2) as engine:
            p = prompt(engine, "def")
            params = SamplingParams(temperature=1.0, max_tokens=40)
            outcomes = await asyncio.gather(
                *(engine.generate(p, params) for _ in range(6)), return_exceptions=True
            )
            overloaded = [o for o in outcomes if isinstance(o, EngineOverloaded)]
            served = [o for o in outcomes if isinstance(o, GenerateResult)]
            # At most one running and two queued when all six arrive in the same loop iteration.
            assert len(overloaded) >= 3 and len(served) + len(overloaded) == 6
            assert overloaded[0].retry_after > 0

    run(main)


def test_unavailable_before_start_and_after_close(tiny_model_dir: Path) -> None:
    async def main() -> None:
        engine = TransformersEngine(tiny_model_dir)
        with pytest.raises(EngineUnavailable):
            await engine.generate([1, 2, 3], GREEDY)
        await engine.start()
        p = prompt(engine, "async def")
        task = asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=3000)))
        await wait_until(lambda: engine.stats["tokens"] > 0)
        await engine.close()
        r = await task
        assert r.finish_reason == "abort" and 0 < len(r.completion_ids) < 3000
        assert len(r.logprobs) == len(r.completion_ids)
        with pytest.raises(EngineUnavailable):
            await engine.generate(p, GREEDY)

    run(main)


def test_context_length(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir, max_context=32) as engine:
            assert engine.max_context == 32
            with pytest.raises(ContextLengthExceeded) as info:
                await engine.generate([5] * 32, GREEDY)
            assert isinstance(info.value, ValueError) and isinstance(info.value, EngineError)
            assert (info.value.prompt_tokens, info.value.max_context) == (32, 32)
            # Only the completion would overflow: max_tokens is clamped to the room left.
            r = await engine.generate([5] * 28, SamplingParams(temperature=0.0, max_tokens=100))
            assert len(r.completion_ids) <= 4
            with pytest.raises(EngineError):
                await engine.generate([engine.vocab_size], GREEDY)

    run(main)


def test_load_weights_swaps_between_generations(tiny_model_dir: Path, sharp_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            p = prompt(engine, "def load(path):")
            before = await engine.generate(p, GREEDY)
            assert before.policy_version == 0
            # Generations in flight around the swap: each must come wholly from the version it reports.
            sampled = SamplingParams(temperature=1.0, max_tokens=64, seed=5)
            racing = [asyncio.create_task(engine.generate(p, sampled))]
            await wait_until(lambda: engine.stats["tokens"] > len(before.completion_ids))
            swap = asyncio.create_task(engine.load_weights(str(sharp_dir)))
            for _ in range(3):
                await asyncio.sleep(0.01)
                racing.append(asyncio.create_task(engine.generate(p, sampled)))
            assert await swap == 1
            assert engine.policy_version == 1
            after = await engine.generate(p, GREEDY)
            raced = await asyncio.gather(*racing)

        assert after.policy_version == 1
        assert raced[0].policy_version == 0  # it was mid-generation when the swap was asked for
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-2)
        checkpoints = {0: tiny_model_dir, 1: sharp_dir}
        for r, t in [(after, 0.0)] + [(r, 1.0) for r in raced]:
            expected = teacher_logprobs(checkpoints[r.policy_version], p, r, t)
            assert (expected - torch.tensor(r.logprobs)).abs().max().item() < LOGPROB_TOL


def test_load_weights_rejects_a_foreign_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            with pytest.raises(EngineError):
                await engine.load_weights(str(tmp_path))  # no safetensors at all
            assert engine.policy_version == 0

    run(main)


def test_later_turns_run_only_their_new_tokens_and_a_weight_swap_reuses_nothing(
    tiny_model_dir: Path, sharp_dir: Path
) -> None:
    """An agent's turn 2 is turn 1's prompt, its completion and a tool result: with the prefix cache
    only the tokens after turn 1's last sampled one run; a new rollout reuses the shared system
    prompt; after a weight swap every prompt runs whole. Logprobs match teacher forcing throughout."""
    sampled = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    checked: list[tuple[Path, list[int], GenerateResult]] = []

    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            system = prompt(
                engine, "You are an agent in a workspace. Use the tools to read and write files. " * 2
            )
            # Rows of different lengths, so cached prefixes and new tokens differ in length within a batch.
            turn1 = [
                system + prompt(engine, f" Task {i}: copy a.txt to b.txt" + " now" * i) for i in range(3)
            ]
            first = await asyncio.gather(*(engine.generate(p, sampled) for p in turn1))
            assert engine.stats["prefill_tokens"] == sum(map(len, turn1))  # nothing cached yet
            results = [prompt(engine, " The tool says: a.txt holds" + " hat" * (i + 1)) for i in range(3)]
            turn2 = [p + r.completion_ids + t for p, r, t in zip(turn1, first, results, strict=True)]
            ran = engine.stats["prefill_tokens"]
            second = await asyncio.gather(*(engine.generate(p, sampled) for p in turn2))
            # Each turn-1 row cached its prompt and completion but the last sampled token.
            assert engine.stats["prefill_tokens"] - ran == sum(len(t) + 1 for t in results)
            ran = engine.stats["prefill_tokens"]
            fresh = system + prompt(engine, " Task 9: reverse w.txt.")
            third = await engine.generate(fresh, sampled)
            assert engine.stats["prefill_tokens"] - ran <= len(fresh) - len(system)
            assert await engine.load_weights(str(sharp_dir)) == 1
            assert len(engine.prefix_cache) == 0
            ran = engine.stats["prefill_tokens"]
            swapped = await engine.generate(turn2[0], sampled)
            assert engine.stats["prefill_tokens"] - ran == len(turn2[0])
        for p, r in [*zip(turn1 + turn2, first + second, strict=True), (fresh, third)]:
            checked.append((tiny_model_dir, p, r))
        checked.append((sharp_dir, turn2[0], swapped))

    run(main)
    for model_dir, p, r in checked:
        expected = teacher_logprobs(model_dir, p, r, 1.0)
        assert (expected - torch.tensor(r.logprobs)).abs().max().item() < LOGPROB_TOL


def test_prefix_cache_serves_the_longest_prefix_within_its_byte_budget() -> None:
    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.arange(n, dtype=torch.float32).view(1, 1, n, 1),) * 2]  # 8 bytes per token

    cache = PrefixCache(max_bytes=8 * 100)  # found a block of 16 tokens at a time, then extended
    cache.insert(list(range(40)), kv(40))
    hit = cache.lookup([*range(30), 99])
    assert hit is not None and hit[0] == 30 and hit[1][0][0].flatten().tolist() == list(range(30))
    assert cache.lookup(list(range(40)))[0] == 39  # type: ignore[index]  # the last token must run
    assert cache.lookup([5, 6, 7, 8, 9, 10]) is None
    assert cache.lookup([*range(15), 99, 16, 17]) is None  # 15 tokens shared: under one block
    cache.insert(list(range(50)), kv(50))  # the 40-token entry is a prefix of it: dropped
    assert len(cache) == 1 and cache.bytes == 8 * 50
    cache.insert(list(range(100, 160)), kv(60))  # over budget: the least recently used goes
    assert len(cache) == 1 and cache.lookup(list(range(45))) is None
    cache.insert(list(range(200, 400)), kv(200))  # larger than the whole budget: not kept
    assert len(cache) == 1 and cache.stats["evictions"] == 1


def test_the_gateways_builtin_engine_takes_the_prefix_cache_size(tiny_model_dir: Path) -> None:
    from openforgerl.engines import make_engine

    for mb, size in ((0.0, 0), (1.5, 3 << 19)):
        engine = make_engine("builtin", str(tiny_model_dir), prefix_cache_mb=mb)
        assert isinstance(engine, TransformersEngine) and engine.prefix_cache.max_bytes == size


def test_a_groups_shared_prompt_is_prefilled_once(tiny_model_dir: Path) -> None:
    """A GRPO group's rollouts send one first prompt at once, and every rollout opens with the same
    system prompt: the first of each runs whole, the others wait a pass for its KV and run only what
    differs. Tokens and logprobs stay those of prompts prefilled apart (engine without a cache)."""
    group = 6
    seeded = [replace(SEEDED, seed=s) for s in range(group)]
    Sampled = tuple[int, list[list[int]], list[GenerateResult], dict[str, int]]

    async def sample(**kwargs: Any) -> Sampled:
        async with running(tiny_model_dir, max_batch_size=2 * group, batch_wait_ms=200, **kwargs) as engine:
            system = prompt(engine, "You are an agent in a workspace. Use the tools to read files. " * 4)
            # The two tasks differ from their first token after the system prompt.
            tails = [prompt(engine, f"{w} copy a.txt" + " now" * n) for w, n in (("Do", 30), ("Go", 60))]
            tasks = [system + t for t in tails]
            prompts = [tasks[i % 2] for i in range(2 * group)]
            calls = [engine.generate(p, seeded[i // 2]) for i, p in enumerate(prompts)]
            results = await asyncio.gather(*calls)
            return len(system), prompts, list(results), dict(engine.stats)

    async def main() -> None:
        system, prompts, shared, stats = await sample()
        assert stats["batches"] == 1  # all arrived together
        # Task 1 whole; task 2 all but the system prompt; every other row its last token only.
        assert stats["prefill_tokens"] == len(prompts[0]) + len(prompts[1]) - system + 2 * group - 2
        _, _, apart, stats_apart = await sample(prefix_cache_mb=0)
        assert stats_apart["prefill_tokens"] == sum(map(len, prompts))
        for a, b in zip(shared, apart, strict=True):
            assert a.completion_ids == b.completion_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < LOGPROB_TOL
        for p, r in zip(prompts, shared, strict=True):
            expected = teacher_logprobs(tiny_model_dir, p, r, 1.0)
            assert (expected - torch.tensor(r.logprobs)).abs().max().item() < LOGPROB_TOL

    run(main)


@pytest.mark.parametrize("kv_heads", [1, 3, 9])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_grouped_decode_attention_equals_sdpa(kv_heads: int, mask_kind: str) -> None:
    """The engine's decode attention (one query token against a padded cache, no repeat of the
    KV heads) gives SDPA's output; prefill shapes go to SDPA itself."""
    from openforgerl.engines.decode_attention import grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    batch, heads, length, dim = 4, 9, 37, 16
    key = torch.randn(batch, kv_heads, length, dim, generator=g)
    value = torch.randn(batch, kv_heads, length, dim, generator=g)
    keep = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    keep[1, ..., :10] = False  # left padding in two rows
    keep[3, ..., :30] = False
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    masks = {"none": None, "bool": keep, "additive": additive}
    layer = torch.nn.Module()  # what transformers' SDPA reads off an attention layer
    layer.num_key_value_groups, layer.is_causal = heads // kv_heads, False
    for q_len in (1, 5):
        query = torch.randn(batch, heads, q_len, dim, generator=g)
        mask = masks[mask_kind]
        if mask is not None and q_len > 1:
            mask = mask.expand(-1, -1, q_len, -1)
        out, _ = grouped_decode_attention(layer, query, key, value, mask, scaling=0.25)
        k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (key, value))
        expected = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=0.25).transpose(1, 2)
        assert out.shape == (batch, q_len, heads, dim)
        assert (out - expected).abs().max().item() < 1e-5


def test_the_engine_decodes_with_grouped_attention(tiny_model_dir: Path) -> None:
    async def main() -> None:
        async with running(tiny_model_dir) as engine:
            assert engine._model.config._attn_implementation == "grouped_decode"

    run(main)


def test_slack_kv_layers_hold_what_plain_layers_hold_through_every_batch_edit() -> None:
    """The engine's KV layers append a decode step's token in place (no copy of the whole cache)
    and hold the same keys and values as transformers' DynamicLayer through the edits the engine
    makes: rows leaving, batches merging, leading padding trimmed."""
    from transformers.cache_utils import DynamicLayer

    from openforgerl.engines.transformers_batch import SlackLayer, pad_left

    torch.manual_seed(0)
    slack, plain = SlackLayer(), DynamicLayer()

    def step(rows: int, n: int = 1) -> None:
        k, v = torch.randn(rows, 2, n, 4), torch.randn(rows, 2, n, 4)
        for layer in (slack, plain):
            layer.update(k, v)

    def same() -> None:
        assert torch.equal(slack.keys, plain.keys) and torch.equal(slack.values, plain.values)

    step(3, 5)  # a prefill
    same()
    start = slack.keys.data_ptr()
    for _ in range(80):  # decode steps beyond the first buffer's room: it grows, then stays put
        step(3)
        same()
    assert slack.keys.shape[-2] == 85 and slack.keys.data_ptr() != start
    grown = slack.keys.data_ptr()
    step(3)
    assert slack.keys.data_ptr() == grown  # in place
    for layer in (slack, plain):  # a row leaves
        layer.batch_select_indices(torch.tensor([0, 2]))
    step(2)
    same()
    other = torch.randn(1, 2, 4, 4)
    for layer in (slack, plain):  # a shorter batch joins, left-padded; then padding is trimmed
        assert layer.keys is not None and layer.values is not None
        layer.keys = torch.cat([layer.keys, pad_left(other, 87 - 4, -2)])
        layer.values = torch.cat([layer.values, pad_left(other, 87 - 4, -2)])
        layer.keys, layer.values = layer.keys[..., 1:, :], layer.values[..., 1:, :]
    for _ in range(3):
        step(3)
        same()
