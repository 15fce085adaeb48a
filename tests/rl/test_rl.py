"""The embedded trainer: veRL's algorithms on hand-computed batches, importance weights, group
filtering, gradient accumulation, weights pushed into the engine in place, SFT, and a training run
killed with SIGKILL and resumed."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from openforgerl.engines.base import SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.rl import algos, loop
from openforgerl.rl.loop import (
    Prefetcher,
    StepRollouts,
    TrainOptions,
    _train_on,
    collect_step,
    lag_bound,
    load_options,
    mixed_groups,
    ptx_demonstrations,
    train,
)
from openforgerl.rl.policy import auto_micro_batch_tokens
from openforgerl.rl.runs import start_engine, step_tasks, training_tasks
from openforgerl.rl.sft import SFTConfig, SFTTrainer, chat_sample, oracle_samples
from openforgerl.rl.trainer import (
    SHARED_PREFIX_MIN,
    MetricsLog,
    Policy,
    Rollout,
    Trainer,
    TrainerConfig,
    Tuning,
    common_prefix,
    iter_checkpoints,
    micro_batches,
    select_groups,
)
from openforgerl.rollouts.results import RolloutResult, Status
from openforgerl.rollouts.trajectory import NO_VERSION, Sample
from openforgerl.tasks import load_tasks
from openforgerl.tasks.suites.tools_tiny import oracle
from openforgerl.testing.samples import one_turn_sample

LOG_1_5, LOG_0_5, LOG_1_1 = math.log(1.5), math.log(0.5), math.log(1.1)


# ---- veRL's algorithms, through algos, on hand-computed values ---------------------------------


def test_grpo_rloo_and_dr_grpo_advantages() -> None:
    rewards, groups = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], ["a", "a", "a", "a", "b", "b"]
    # Group a: mean 0.75, sample std 0.5; group b: mean 0.5, std sqrt(0.5).
    grpo = algos.outcome_advantages(rewards, groups, "grpo")
    assert grpo == pytest.approx([0.5, -1.5, 0.5, 0.5, -1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)
    dr_grpo = algos.outcome_advantages(rewards, groups, "grpo", norm_adv_by_std=False)
    assert dr_grpo == pytest.approx([0.25, -0.75, 0.25, 0.25, -0.5, 0.5])
    # RLOO: the reward minus the mean of the other G - 1 rollouts.
    rloo = algos.outcome_advantages(rewards, groups, "rloo")
    assert rloo == pytest.approx([1 / 3, -1.0, 1 / 3, 1 / 3, -1.0, 1.0])
    with pytest.raises(ValueError, match="choose from"):
        algos.outcome_advantages(rewards, groups, "gae")


def test_vanilla_ppo_loss_and_clip_fraction_by_hand() -> None:
    old = torch.zeros(2, 3)
    lp = torch.tensor([[LOG_1_5, LOG_0_5, 0.0], [LOG_1_1, 0.0, 0.0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    cfg = algos.actor_config(algos.LossConfig(), group_size=2)
    # Per token: -min(r A, clip(r, 0.8, 1.2) A): -1.2 (clipped), -0.5, 1.1, 1, 1; token mean over 5.
    loss, metrics = algos.policy_loss(lp, old, adv, mask, cfg, algos.MiniBatchSize(tokens=5, sequences=2))
    assert float(loss) == pytest.approx(1.4 / 5, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 5)
    # Micro-batches normalised by the whole mini-batch add up to its loss.
    parts = [
        algos.policy_loss(
            lp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], cfg, algos.MiniBatchSize(5, 2)
        )[0]
        for i in range(2)
    ]
    assert float(sum(parts)) == pytest.approx(float(loss), abs=1e-6)
    # Importance weights scale each token's loss.
    weights = torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 0.0]])
    weighted, _ = algos.policy_loss(lp, old, adv, mask, cfg, algos.MiniBatchSize(5, 2), is_weights=weights)
    assert float(weighted) == pytest.approx((-1.2 - 1.0 + 1.1 + 1.0) / 5, abs=1e-6)


def test_kl_to_reference_and_sft_loss_by_hand() -> None:
    lp = torch.tensor([[LOG_0_5, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    cfg = algos.actor_config(algos.LossConfig(kl_coef=0.5), group_size=2)
    zero_adv = torch.zeros(1, 2)
    loss, metrics = algos.policy_loss(
        lp, lp.detach(), zero_adv, mask, cfg, algos.MiniBatchSize(1, 1), ref_logprobs=torch.zeros(1, 2)
    )
    # low_var_kl (k3): with d = ref - lp = log 2, exp(d) - d - 1 = 1 - log 2.
    assert metrics["actor/kl_loss"] == pytest.approx(1 - math.log(2), abs=1e-6)
    assert float(loss) == pytest.approx(0.5 * (1 - math.log(2)), abs=1e-6)
    assert (
        float(algos.sft_loss(torch.tensor([[-1.0, -3.0, -7.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 4)) == 1.0
    )


def test_truncated_importance_weights() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    weights, metrics = algos.importance_weights(old, old.clone(), mask, algos.LossConfig())
    assert weights is not None and torch.allclose(weights, torch.ones(1, 3))
    behaviour = old - torch.tensor([[math.log(3.0), 0.0, -math.log(2.0)]])  # ratios 3, 1, 0.5
    weights, metrics = algos.importance_weights(old, behaviour, mask, algos.LossConfig(tis_threshold=2.0))
    assert weights is not None and weights[0].tolist() == pytest.approx([2.0, 1.0, 0.5])
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    off, _ = algos.importance_weights(old, behaviour, mask, algos.LossConfig(tis=None))
    assert off is None


# ---- the trainer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_and_prompts(tiny_model_dir: Path) -> Any:
    """A running engine on the tiny model and two sampled (prompt, completion, logprobs) triples."""
    engine = TransformersEngine(tiny_model_dir)
    prompts = [engine.tokenizer.encode("Read a.txt and b.txt."), engine.tokenizer.encode("Hello there")]

    async def go() -> list[Any]:
        await engine.start()
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
        return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))

    results = asyncio.run(go())
    yield engine, [(p, r.completion_ids, r.logprobs) for p, r in zip(prompts, results, strict=True)]
    asyncio.run(engine.close())


def rollouts_from(triples: list[Any], rewards: list[float]) -> list[Rollout]:
    """Each triple as one task's group of len(rewards) rollouts (identical samples, given rewards)."""
    out = []
    for t, (prompt, completion, lps) in enumerate(triples):
        for k, reward in enumerate(rewards):
            out.append(Rollout(f"task{t}", reward, [one_turn_sample(prompt, completion, lps, f"t{t}-{k}")]))
    return out


def test_zero_variance_groups_are_dropped_and_counted(tiny_model_dir: Path, engine_and_prompts: Any) -> None:
    _, triples = engine_and_prompts
    p, c, lp = triples[0]
    rollouts = [
        Rollout("same", 1.0, [one_turn_sample(p, c, lp)]),
        Rollout("same", 1.0, [one_turn_sample(p, c, lp)]),
        Rollout("mixed", 1.0, [one_turn_sample(p, c, lp)]),
        Rollout("mixed", 0.0, [one_turn_sample(p, c, lp)]),
        Rollout("alone", 1.0, [one_turn_sample(p, c, lp)]),
        Rollout("mixed", None, [one_turn_sample(p, c, lp)]),  # not scored (infrastructure failure)
    ]
    kept, stats = select_groups(rollouts)
    assert [r.group for r in kept] == ["mixed", "mixed"]
    assert stats["groups_dropped_zero_variance"] == 1 and stats["groups_dropped_single"] == 1
    assert stats["rollouts_unscored"] == 1 and stats["groups_kept"] == 1
    assert stats["pass_rate"] == pytest.approx(4 / 5)

    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=1e-2), group_size=2)
    before = [t.clone() for t in trainer.policy.model.parameters()]
    metrics = trainer.train_step(rollouts[:2])  # only the zero-variance group
    assert metrics["updated"] is False and metrics["groups_dropped_zero_variance"] == 1
    assert trainer.policy_version == 0 and trainer.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.model.parameters(), strict=True))


def test_importance_weights_are_one_when_behaviour_matches(
    tiny_model_dir: Path, engine_and_prompts: Any
) -> None:
    """The engine's sampled logprobs are the trainer's own: pi_old / pi_behaviour = 1 on every token."""
    _, triples = engine_and_prompts
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=1e-3), group_size=2)
    metrics = trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
    assert metrics["updated"] is True and metrics["policy_version"] == 1
    assert metrics["is_weight_min"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["is_weight_max"] == pytest.approx(1.0, abs=1e-3)
    assert abs(metrics["kl_behaviour"]) < 1e-4
    assert metrics["clip_fraction"] == 0.0  # one update per step: pi_old is the current policy
    assert metrics["loss_tokens"] == 2 * sum(len(c) for _, c, _ in triples)


def test_ppo_epochs_reuse_every_sample_and_the_clip_bounds_the_later_updates(
    tiny_model_dir: Path, engine_and_prompts: Any
) -> None:
    """Two passes of two mini-batches: four updates that each see half the samples, every sample
    twice; after the first update the ratio to pi_old leaves 1 and the PPO clip starts to act."""
    _, triples = engine_and_prompts
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=3e-2, mini_batches=2, ppo_epochs=2), group_size=2)
    metrics = trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
    assert metrics["optimizer_steps"] == 4 and trainer.policy_version == 1
    assert metrics["loss_tokens"] == 2 * 2 * sum(len(c) for _, c, _ in triples)
    assert metrics["clip_fraction"] > 0.0
    assert metrics["actor/ppo_kl"] != 0.0  # pi_old stayed the policy from before the first update


def test_ptx_term_pulls_each_update_toward_the_demonstrations(
    tiny_model_dir: Path, engine_and_prompts: Any, tmp_path: Path
) -> None:
    """The same RL step with and without the SFT-loss term: with it, the demonstrations' loss
    falls further, and the step reports it; without demonstrations the term is refused."""
    _, triples = engine_and_prompts
    policy = Policy(tiny_model_dir, lr=1e-3)
    demos = [
        chat_sample(
            [
                {"role": "user", "content": f"What is {a} + {b}?"},
                {"role": "assistant", "content": str(a + b)},
            ],
            None,
            policy.tokenizer,
        )
        for a, b in [(2, 3), (4, 4), (1, 6), (5, 2)]
    ]

    def demo_loss(trainer: Trainer) -> float:
        batch = trainer.policy.collate(demos)
        with torch.no_grad():
            lp = trainer.policy.logprobs(batch, temperature=1.0)
        return float(-(lp * batch.mask).sum() / batch.mask.sum())

    losses = {}
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        cfg = TrainerConfig(lr=1e-2, ptx_coef=coef, ptx_batch=4)
        trainer = Trainer(tiny_model_dir, cfg, group_size=2, temperature=0.7, demonstrations=demos)
        before = demo_loss(trainer)
        metrics = trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
        losses[coef] = demo_loss(trainer)
        assert ("ptx_loss" in metrics) == (coef > 0)
    assert metrics["ptx_loss"] == pytest.approx(before, rel=1e-4)  # measured before the update
    assert losses[1.0] < losses[0.0] and losses[1.0] < before
    with pytest.raises(ValueError, match="demonstrations"):
        Trainer(tiny_model_dir, TrainerConfig(ptx_coef=1.0), group_size=2)
    with pytest.raises(ValueError, match="ptx_data"):
        ptx_demonstrations(
            TrainOptions(model=str(tiny_model_dir), out=Path("x"), temperature=0.7, trainer=cfg)
        )
    with_image = tmp_path / "images.jsonl"
    row = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "image_digests": ["d" * 64]}
    with_image.write_text(json.dumps(row) + "\n")
    opts = TrainOptions(
        model=str(tiny_model_dir), out=tmp_path, temperature=0.7, ptx_data=str(with_image), trainer=cfg
    )
    with pytest.raises(ValueError, match="images are not supported"):
        ptx_demonstrations(opts)


def test_micro_batches_accumulate_to_the_same_update(tiny_model_dir: Path, engine_and_prompts: Any) -> None:
    _, triples = engine_and_prompts
    params = []
    for budget in (10_000, 1):  # everything in one pass / one sequence per pass
        torch.manual_seed(0)
        trainer = Trainer(tiny_model_dir, TrainerConfig(micro_batch_tokens=budget), group_size=2)
        # Plain SGD: the update is the (clipped) gradient itself; Adam's first step is sign-like.
        trainer.policy.optimizer = torch.optim.SGD(trainer.policy.model.parameters(), lr=1.0)
        trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
        params.append(torch.cat([p.detach().flatten() for p in trainer.policy.model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-5)
    assert micro_batches([5, 3, 9, 2], 10) == [[2], [0, 1], [3]]


def test_the_default_micro_batch_fits_the_models_size(tiny_model_dir: Path) -> None:
    """With no budget set, a micro-batch holds as many tokens as the model's activations allow in
    4 GiB: the tiny model batches 8,192 tokens, SmolLM2 (30 layers, a 49,152-token vocabulary, which
    at 8,192 tokens peaked at 17 GB) about 1,000, so its 1,400-token rollouts go one at a time."""
    from transformers import AutoConfig

    from openforgerl.modelkit.pretrained import cached_pretrained

    assert TrainerConfig().micro_batch_tokens == 0 and SFTConfig().micro_batch_tokens == 0
    policy = Policy(tiny_model_dir, lr=1e-3)
    assert auto_micro_batch_tokens(policy.model.config) == 8192
    rows = [one_turn_sample(list(range(i, 3000 + i)), [7, 8], [-1.0, -1.0]) for i in range(3)]
    assert policy.micro_batches(rows) == [[0, 1], [2]]  # 2 x 3,002 tokens fit, a third does not
    smollm2 = AutoConfig.from_pretrained(cached_pretrained("smollm2-135m-instruct"))
    assert 800 <= auto_micro_batch_tokens(smollm2) <= 1400


def test_a_shared_system_prompt_runs_once_with_the_same_logprobs_and_gradients(tiny_model_dir: Path) -> None:
    """Rows that open alike (a harness's system prompt, a group's task) run that prefix once and go
    on from its KV cache: the logprobs and the gradients equal those of running every row whole."""
    policy = Policy(tiny_model_dir, lr=1e-3)
    system = {"role": "system", "content": "You are an agent in a workspace. Use the tools. " * 4}

    def row(name: str, opener: dict[str, str] = system) -> Sample:
        turns = [opener, {"role": "user", "content": f"Read {name}."}, {"role": "assistant", "content": name}]
        return chat_sample(turns, None, policy.tokenizer)

    samples = [row("a.txt"), row("notes/b.txt"), row("c")]  # unequal lengths: right padding
    batch = policy.collate(samples)
    assert SHARED_PREFIX_MIN <= batch.shared <= int(batch.positions.min())
    results = []
    for shared in (batch.shared, 0):
        policy.model.zero_grad()
        one = dataclasses.replace(batch, shared=shared)
        lp = policy.logprobs(one)
        (-(lp * one.mask).sum()).backward()
        grads = [p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]
        results.append((lp.detach(), torch.cat(grads)))
    (lp_shared, g_shared), (lp_whole, g_whole) = results
    assert torch.allclose(lp_shared, lp_whole, atol=1e-5)
    # Equal up to float32 rounding: summation order differs (largest gradients here are about 10).
    assert float((g_shared - g_whole).norm()) <= 1e-5 * float(g_whole.norm())
    assert torch.allclose(g_shared, g_whole, rtol=1e-4, atol=1e-4)
    # Nothing shared from the first token: every row runs whole.
    other = row("a.txt", {"role": "system", "content": "Be brief. " * 12})
    assert policy.collate([samples[0], other]).shared == 0
    # Micro-batches count that prefix once: rows that fit only because of it go in one pass.
    assert common_prefix(samples) == batch.shared and common_prefix([samples[0], other]) == 0
    longest = max(len(s.input_ids) for s in samples)
    budget = batch.shared + 3 * (longest - batch.shared)
    assert budget < 3 * longest
    assert policy.micro_batches(samples, budget) == [[1, 0, 2]]
    assert len(policy.micro_batches([samples[0], other, samples[1]], budget)) > 1


def test_engine_logprobs_equal_the_trainers_after_a_step(
    tiny_model_dir: Path, engine_and_prompts: Any, tmp_path: Path
) -> None:
    engine, triples = engine_and_prompts
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=5e-3), group_size=2)
    metrics = trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
    trainer.save(tmp_path / "ckpt", metrics=metrics)
    start = engine.policy_version
    assert asyncio.run(trainer.push_weights(engine, tmp_path / "ckpt")) == start + 1
    prompt, old_completion, old_lps = triples[0]

    async def regenerate() -> Any:
        return await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=7))

    result = asyncio.run(regenerate())
    assert result.policy_version == start + 1
    new = one_turn_sample(prompt, result.completion_ids, result.logprobs)
    recomputed = trainer.policy.sample_logprobs([new])[0][len(prompt) :]
    assert recomputed == pytest.approx(result.logprobs, abs=1e-4)
    # And the weights did change: the old completion scores differently now.
    old = trainer.policy.sample_logprobs([one_turn_sample(prompt, old_completion, old_lps)])[0][len(prompt) :]
    assert max(abs(a - b) for a, b in zip(old, old_lps, strict=True)) > 1e-3
    saved = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert saved["step"] == 1 and saved["policy_version"] == 1
    assert {"model.safetensors", "optimizer.pt", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "ckpt").iterdir()
    }


def test_a_server_engine_starts_one_version_back_and_gets_the_weights_pushed_first(
    tiny_model_dir: Path,
) -> None:
    """`openforge train --engine vllm:URL`: a server's weights are unknown until the loop pushes the
    starting model (or the last checkpoint); that push brings the engine to the trainer's version."""
    from openforgerl.engines.vllm import VLLMEngine

    server, push_first = start_engine("vllm:http://127.0.0.1:9", tiny_model_dir, 3)
    assert isinstance(server, VLLMEngine) and push_first
    assert server.policy_version == 2 and server.base_url == "http://127.0.0.1:9"
    asyncio.run(server.close())
    builtin, push_first = start_engine("builtin", tiny_model_dir, 3)
    assert isinstance(builtin, TransformersEngine) and not push_first and builtin.policy_version == 3
    with pytest.raises(ValueError, match="unknown engine"):
        start_engine("sglang", tiny_model_dir, 0)  # a server it cannot start: its URL is needed


def test_an_engine_that_starts_vllm_says_where_vllm_is_wanted(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--engine vllm` starts a server from the environment that holds vLLM: with none named and no
    ./.venv-vllm, it says how to give one, before anything starts."""
    from openforgerl.engines.base import EngineError
    from openforgerl.engines.vllm_server import LocalVLLMEngine, server_command

    monkeypatch.delenv("OPENFORGE_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineError, match="OPENFORGE_VLLM_PYTHON"):
        start_engine("vllm", tiny_model_dir, 0)
    monkeypatch.setenv("OPENFORGE_VLLM_PYTHON", "/opt/vllm/bin/python")
    monkeypatch.setenv("OPENFORGE_VLLM_ARGS", "--dtype bfloat16 --max-model-len 2048")
    engine, push_first = start_engine("vllm", tiny_model_dir, 3)
    assert isinstance(engine, LocalVLLMEngine) and push_first and engine.policy_version == 2
    cmd, env = server_command("/opt/vllm/bin/python", str(tiny_model_dir), 8123)
    assert cmd[0] == "/opt/vllm/bin/python" and ["--host", "127.0.0.1"] == cmd[5:7]
    assert cmd[-4:] == ["--dtype", "bfloat16", "--max-model-len", "2048"]  # given last: they win
    assert ["--logprobs-mode", "processed_logprobs"] == cmd[cmd.index("--logprobs-mode") :][:2]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


# ---- SFT -------------------------------------------------------------------------------------


def test_chat_sample_masks_assistant_turns_only(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}
    messages = [
        {"role": "user", "content": "Read a.txt."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "17"},
        {"role": "assistant", "content": "It says 17."},
    ]
    s = chat_sample(messages, None, tok)
    trained = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
    call_text = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
    assert trained == f"{call_text}<|im_end|>It says 17.<|im_end|>"

    # `weight: 0` (OpenAI's fine-tuning convention): the turn stays in the context, untrained.
    weighted = [*messages[:1], {**messages[1], "weight": 0}, *messages[2:]]
    w = chat_sample(weighted, None, tok)
    assert w.input_ids == s.input_ids
    trained_w = tok.decode([i for i, m in zip(w.input_ids, w.loss_mask, strict=True) if m])
    assert trained_w == "It says 17.<|im_end|>"


def test_sft_on_oracle_trajectories_lowers_the_loss(tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = oracle_samples(tiny_model_dir, tmp_path / "teacher", limit=3, concurrency=2, progress=False)
    assert len(samples) == 3  # one merged sequence per solved task
    train, val = samples[:2], samples[2:]
    trainer = SFTTrainer(tiny_model_dir, SFTConfig(lr=3e-3, epochs=4, batch_size=2, eval_every=2))
    tool_calls = trainer.policy.tokenizer.decode(
        [i for i, m in zip(samples[0].input_ids, samples[0].loss_mask, strict=True) if m]
    )
    assert tool_calls.count("<tool_call>") >= 3 and '"name": "submit"' in tool_calls
    # The teacher shows its work: a note of each value it read, the computation before the write.
    taught = [
        trainer.policy.tokenizer.decode([i for i, m in zip(x.input_ids, x.loss_mask, strict=True) if m])
        for x in samples
    ]
    for task in load_tasks("tools-tiny", split="train")[:3]:
        assert isinstance(task.files, dict)
        first = task.metadata["inputs"][0]
        note = f'{first} holds "{task.files[first].strip()}".'
        assert any(note in t and f"{oracle(task).working}.\n<tool_call>" in t for t in taught), note
    summary = trainer.fit(train, tmp_path / "student", val=val, progress=False)
    assert summary["loss_after"] < summary["loss_before"] - 0.5
    # The task never trained on shares the format: its loss falls too, and is logged every 2 steps.
    assert summary["val_samples"] == 1
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.5
    lines = [json.loads(x) for x in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert [x["step"] for x in lines if "val_loss" in x] == [2, 4]
    assert lines[-1]["val_loss"] == pytest.approx(summary["val_loss_after"])
    assert (tmp_path / "student" / "model.safetensors").is_file()


def test_cli_sft_logs_the_validation_loss(tiny_model_dir: Path, tmp_path: Path) -> None:
    import re

    from click.testing import CliRunner

    from openforgerl.cli import main

    def chats(path: Path, words: list[str]) -> Path:
        rows = [
            {"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
            for w in words
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    train = chats(tmp_path / "train.jsonl", ["cat", "dog", "sun", "map"])
    val = chats(tmp_path / "val.jsonl", ["cup", "pen"])
    out = tmp_path / "student"
    args = ["sft", "--data", str(train), "--val-data", str(val), "--eval-every", "1"]
    args += ["--model", str(tiny_model_dir), "--out", str(out), "--epochs", "3", "--lr", "3e-3"]
    args += ["--batch-size", "2", "--device", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    printed = re.search(r"6 steps on 4 samples: .* val loss ([\d.]+) -> ([\d.]+)", result.output)
    assert printed, result.output
    assert float(printed[2]) < float(printed[1])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [round(x["val_loss"], 3) for x in lines][-1] == float(printed[2])
    assert len([x for x in lines if "val_loss" in x]) == 6

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    result = CliRunner().invoke(main, [*args[:4], str(bad), *args[5:]])  # the bad file as --val-data
    assert result.exit_code != 0 and "differ in length" in result.output


def test_sft_warmup_then_cosine_schedule(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The logged rate of each step follows the warm-up, peaks at --lr and decays."""
    tok = SFTTrainer(tiny_model_dir, SFTConfig()).policy.tokenizer
    sample = chat_sample(
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}], None, tok
    )
    cfg = SFTConfig(lr=1e-3, epochs=8, batch_size=1, schedule="cosine", warmup_steps=3)
    SFTTrainer(tiny_model_dir, cfg).fit([sample], tmp_path / "out", progress=False)
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(lrs) == 8
    assert lrs[0] < lrs[1] < lrs[2] < lrs[3] == pytest.approx(1e-3)
    assert all(a > b for a, b in itertools.pairwise(lrs[3:])) and lrs[-1] < 1e-4
    with pytest.raises(ValueError, match="unknown schedule"):
        SFTTrainer(tiny_model_dir, SFTConfig(schedule="linear-ish")).fit([sample], tmp_path / "x")


def test_metrics_log_survives_a_torn_line(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.write(1, {"loss": 1.0})
    with log.path.open("a") as f:
        f.write('{"step": 2, "lo')  # killed mid-write
    log.write(2, {"loss": 0.5})
    assert log.steps() == {1, 2}


# ---- the loop: kill -9 and resume ----------------------------------------------------------------


def _done_rollouts(runner_db: Path) -> dict[str, str]:
    if not runner_db.exists():
        return {}
    with sqlite3.connect(runner_db) as db:
        try:
            rows = db.execute("SELECT key, gateway_rollout_id FROM rollouts WHERE status='done'").fetchall()
        except sqlite3.OperationalError:  # the runner has created the file but not its table yet
            return {}
    return dict(rows)


def test_train_resumes_after_sigkill_without_losing_or_repeating_rollouts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    steps, tasks, group = 2, 1, 2
    argv = [
        sys.executable,
        "-m",
        "openforgerl.cli",
        "train",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(run),
    ]
    argv += ["--steps", str(steps), "--batch-tasks", str(tasks), "--group", str(group), "--lr", "1e-3"]
    # A random model never earns a reward: train on the (all-zero) groups anyway, so versions advance.
    argv += ["--max-tokens", "12", "--max-turns", "2", "--concurrency", "1", "--keep-zero-variance"]
    argv += ["--skip-tasks", "990", "--ppo-epochs", "2"]  # the last 10 train tasks; 2 updates a step
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    step2 = run / "steps" / "000002" / "runner.db"
    deadline = time.monotonic() + 120
    try:
        while not _done_rollouts(step2):  # kill it in the middle of step 2
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "step 2 never started"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = _done_rollouts(step2)
    assert 0 < len(kept) < tasks * group
    done = subprocess.run(
        [sys.executable, "-m", "openforgerl.cli", "train", "--out", str(run), "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{steps} steps, policy version {steps}" in done.stdout
    for step in range(1, steps + 1):
        finished = _done_rollouts(run / "steps" / f"{step:06d}" / "runner.db")
        assert len(finished) == tasks * group
    after = _done_rollouts(step2)
    assert {k: after[k] for k in kept} == kept  # finished before the kill: kept, not run again
    with sqlite3.connect(run / "gateway.db") as db:
        closed = db.execute("SELECT run_id, task_id, metadata FROM rollouts WHERE status='closed'").fetchall()
        versions = db.execute(
            "SELECT r.run_id, MIN(c.policy_version), MAX(c.policy_version) FROM calls c"
            " JOIN rollouts r ON r.id = c.rollout_id WHERE r.status='closed' GROUP BY r.run_id"
        ).fetchall()
    keys = [(r, t, json.loads(m)["sample"]) for r, t, m in closed]
    assert len(keys) == len(set(keys)) == steps * tasks * group  # no rollout scored twice
    # Step k's rollouts were sampled by the weights of step k - 1, before the kill and after.
    assert sorted(versions) == [(f"run-step{k}", k - 1, k - 1) for k in range(1, steps + 1)]
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, steps + 1))
    # The resumed run kept its options: tasks after the first 990 only, two passes per step.
    assert {t for _, t, _ in keys} <= {t.id for t in load_tasks("tools-tiny", split="train")[990:]}
    assert all(m["optimizer_steps"] == 2 for m in logged)


# ---- overlap of rollouts and training ----------------------------------------------------------


def _versioned(group: str, versions_per_sample: list[list[int]]) -> Rollout:
    """A rollout whose samples' loss tokens carry these policy versions."""
    samples = [
        Sample(
            rollout_id=group,
            reward=1.0,
            branch_id=0,
            branch_reason="",
            input_ids=[1] * (1 + len(vs)),
            loss_mask=[0] + [1] * len(vs),
            logprobs=[0.0] * (1 + len(vs)),
            policy_versions=[NO_VERSION, *vs],
        )
        for vs in versions_per_sample
    ]
    return Rollout(group, 1.0, samples)


def test_skip_tasks_keeps_rl_off_the_tasks_the_sft_teacher_solved(tmp_path: Path) -> None:
    teacher = {t.id for t in load_tasks("tools-tiny", split="train")[:400]}  # oracle_samples(limit=400)
    opts = TrainOptions(model="m", out=tmp_path, skip_tasks=400)
    rest = training_tasks(opts)
    assert len(rest) == len(load_tasks("tools-tiny", split="train")) - 400
    drawn = {t.id for step in range(1, 50) for t in step_tasks(rest, step, 6, seed=0)}
    assert drawn and not drawn & teacher
    assert training_tasks(dataclasses.replace(opts, skip_tasks=0))[0].id in teacher
    with pytest.raises(ValueError, match="after the first 5000"):
        training_tasks(dataclasses.replace(opts, skip_tasks=5000))


def test_curriculum_draws_only_the_measured_tasks_with_mixed_outcomes(tmp_path: Path) -> None:
    from openforgerl.rl import headroom
    from openforgerl.rl.loop import curriculum_tasks

    opts = TrainOptions(model="m", out=tmp_path, headroom_tasks=4, curriculum=True)
    tasks = training_tasks(opts)
    with pytest.raises(ValueError, match="no headroom measurement"):
        curriculum_tasks(tasks, opts)
    a, b, c, d = (t.id for t in tasks[10:14])
    rates = {a: 0.0, b: 0.25, c: 1.0, d: 0.875}  # all fail, mixed, all pass, mixed
    measured = headroom.Headroom(
        k=8, tasks=4, rollouts=32, unscored=0, pass_at_1=0.5, pass_at_k=0.75, mixed_fraction=0.5,
        all_fail_fraction=0.25, all_pass_fraction=0.25, sampled_nll=0.1, sampled_tokens=100,
        task_pass_rates=rates, seconds=1.0, temperature=1.0,
    )  # fmt: skip
    headroom.write(measured, tmp_path)
    pool = curriculum_tasks(tasks, opts)
    assert [t.id for t in pool] == [b, d]
    # Each step draws from the pool alone, so its tasks come back step after step.
    drawn = [t.id for step in range(1, 6) for t in step_tasks(pool, step, 6, seed=0)]
    assert drawn.count(b) == drawn.count(d) == 5
    headroom.write(dataclasses.replace(measured, task_pass_rates={a: 0.0, c: 1.0}), tmp_path)
    with pytest.raises(ValueError, match="none of the 2 measured tasks had mixed outcomes"):
        curriculum_tasks(tasks, opts)
    with pytest.raises(ValueError, match="set headroom_tasks"):
        TrainOptions(model="m", out=tmp_path, curriculum=True)


# ---- dynamic sampling ----------------------------------------------------------------------------


def test_dynamic_sampling_draws_batches_until_enough_groups_have_mixed_rewards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = TrainOptions(model="m", out=tmp_path, batch_tasks=2, group=4, max_gen_batches=5, seed=3)
    tasks = training_tasks(opts)
    batches: list[list[Any]] = []
    for b in range(3):
        batches.append(step_tasks(tasks, 7, 2, 3, b, [t for x in batches for t in x]))
    drawn = [t.id for b in batches for t in b]
    assert len(set(drawn)) == 6  # a later batch never draws a task again
    assert batches[0] == step_tasks(tasks, 7, 2, 3)  # the first batch is the step's usual draw
    # Batch 1: both groups agree; batch 2: one mixed; batch 3: both mixed. An unscored rollout
    # (infrastructure failure) does not make a group mixed.
    mixed = {drawn[2], drawn[4], drawn[5]}
    ran: list[tuple[list[str], Path, str]] = []

    def run_tasks(gw: Any, ts: list[Any], n: int, state_dir: Path, run_id: str, o: Any, **_: Any) -> Any:
        ran.append(([t.id for t in ts], state_dir, run_id))
        out = []
        for t in ts:
            for i in range(n):
                reward = float(i % 2) if t.id in mixed else 1.0
                out.append(RolloutResult(t.id, i, Status.DONE, reward, gateway_rollout_id=f"{t.id}#{i}"))
            out.append(RolloutResult(t.id, n, Status.INFRA_FAILED, None))
        return out

    read: list[str] = []

    def recorded(results: list[RolloutResult]) -> list[Rollout]:
        read.extend(r.task_id for r in results)
        return [Rollout(r.task_id, r.reward, []) for r in results]

    monkeypatch.setattr(loop, "run_tasks", run_tasks)
    monkeypatch.setattr(loop, "recorded_rollouts", recorded)
    got = collect_step(None, opts, tasks, 7)  # type: ignore[arg-type]
    step_dir = tmp_path / "steps" / "000007"
    assert ran == [
        (drawn[0:2], step_dir, f"{tmp_path.name}-step7"),
        (drawn[2:4], step_dir / "gen-1", f"{tmp_path.name}-step7-gen1"),
        (drawn[4:6], step_dir / "gen-2", f"{tmp_path.name}-step7-gen2"),
    ]  # it stopped at 3 of 5 batches: 2 mixed groups were enough
    assert {r.group for r in got.rollouts} == {drawn[2], drawn[4]}  # the first two mixed groups
    assert set(read) == {drawn[2], drawn[4]}  # only the kept groups go to the trainer
    assert len(got.results) == 6 * 5  # every rollout run is counted in the step's outcomes
    assert got.metrics == {
        "timed_out": 0,
        "timed_out_excluded": 0,
        "dynamic/gen_batches": 3,
        "dynamic/pass_rate_drawn": (3 * 4 + 3 * 2) / 24,  # 3 groups all pass, 3 half
        "dynamic/groups_drawn": 6,
        "dynamic/groups_mixed": 3,
        "dynamic/groups_kept": 2,
    }
    assert mixed_groups(got.results) == [drawn[2], drawn[4], drawn[5]]
    # Off (max_gen_batches 1): one batch, every group goes to the trainer, no dynamic metrics.
    ran.clear()
    off = collect_step(None, dataclasses.replace(opts, max_gen_batches=1), tasks, 7)  # type: ignore[arg-type]
    assert [r[0] for r in ran] == [drawn[0:2]] and len(off.rollouts) == 10
    assert off.metrics == {"timed_out": 0, "timed_out_excluded": 0}


def test_dynamic_sampling_stops_after_max_gen_batches_and_trains_on_no_equal_group(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # A random model never earns a reward: every group agrees, so each step draws all 3 batches.
    opts = TrainOptions(
        model=str(tiny_model_dir),
        out=run,
        steps=1,
        group=2,
        batch_tasks=1,
        max_gen_batches=3,
        skip_tasks=990,
        max_tokens=8,
        max_turns=1,
        concurrency=2,
        progress=False,
        trainer=TrainerConfig(lr=1e-3),
    )
    summary = train(opts)
    assert summary["policy_version"] == 0  # nothing with a signal: no update, no new weights
    (m,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m["dynamic/gen_batches"] == 3 and m["dynamic/groups_drawn"] == 3
    assert m["dynamic/groups_mixed"] == 0 and m["dynamic/groups_kept"] == 0
    assert m["updated"] is False and m["rollouts"] == 0 and sum(m["outcomes"].values()) == 6
    step = run / "steps" / "000001"
    done = [_done_rollouts(d / "runner.db") for d in (step, step / "gen-1", step / "gen-2")]
    assert [len(d) for d in done] == [2, 2, 2]
    tasks = [{key.split("#")[0] for key in d} for d in done]
    assert all(len(t) == 1 for t in tasks) and len(set.union(*tasks)) == 3  # three different tasks
    with pytest.raises(ValueError, match="equal-reward"):
        bad = dataclasses.replace(opts, out=tmp_path / "bad", trainer=TrainerConfig(drop_zero_variance=False))
        train(bad)


def test_lag_bound_keeps_rollouts_within_max_lag_and_measures_the_lag() -> None:
    rollouts = [
        _versioned("a", [[5, 5]]),
        _versioned("a", [[4, 5]]),  # the call before the push came from version 4: lag 1
        _versioned("b", [[5], [3, 4]]),  # one sample lags by 2: the whole rollout goes
        _versioned("b", [[NO_VERSION]]),  # an engine that reports no version: counted as current
    ]
    kept, m = lag_bound(rollouts, version=5, max_lag=1)
    assert kept == [rollouts[0], rollouts[1], rollouts[3]]
    assert m["lag/dropped_rollouts"] == 1 and m["lag/max"] == 1
    assert m["lag/histogram"] == {"0": 2, "1": 1}
    # Over the 5 kept loss tokens: one from version 4.
    assert m["lag/mean"] == pytest.approx(1 / 5) and m["lag/stale_token_fraction"] == pytest.approx(1 / 5)
    kept, m = lag_bound(rollouts, version=5, max_lag=2)
    assert kept == rollouts and m["lag/dropped_rollouts"] == 0
    assert m["lag/histogram"] == {"0": 3, "1": 1, "2": 1}


def test_prefetcher_runs_ahead_by_at_most_max_lag_steps() -> None:
    started: list[int] = []

    def collect(step: int, cancel: Any) -> StepRollouts:
        started.append(step)
        if step == 4:
            raise RuntimeError("rollouts of step 4 failed")
        return StepRollouts(step, [], [], time.time(), time.time(), 0.0)

    prefetch = Prefetcher(collect, 1, 5, max_lag=1)
    try:
        # Steps 1 and 2 may run on the starting weights (step 2 is trained with step 1's: lag 1).
        assert prefetch.get(1).step == 1 and prefetch.get(2).step == 2
        time.sleep(0.3)
        assert started == [1, 2]  # step 3 waits until the weights of step 1 are in the engine
        prefetch.pushed(1)
        assert prefetch.get(3).step == 3
        prefetch.pushed(2)
        with pytest.raises(RuntimeError, match="step 4 failed"):  # the trainer's thread sees the error
            prefetch.get(4)
    finally:
        prefetch.close()
    assert started == [1, 2, 3, 4]  # nothing after the failure
    waiting = Prefetcher(collect, 1, 5, max_lag=0)  # max_lag 0: step 2 waits for step 1's weights
    assert waiting.get(1).step == 1
    waiting.close()  # returns although step 2 is waiting for weights that never come


def test_stale_samples_are_weighted_by_pi_old_over_behaviour_and_left_out_beyond_the_bound(
    tiny_model_dir: Path, engine_and_prompts: Any, tmp_path: Path
) -> None:
    engine, triples = engine_and_prompts  # behaviour logprobs from the starting weights (version 0)
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=3e-2), group_size=2)
    trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
    assert trainer.policy_version == 1
    stale = rollouts_from(triples, [1.0, 0.0])  # sampled by version 0, trained by version 1: lag 1
    samples = [s for r in stale for s in r.samples]
    pi_old = trainer.policy.sample_logprobs(samples)  # the weights this step starts from
    weights = [
        min(math.exp(old - behaviour), 2.0)  # truncated at tis_threshold
        for s, olds in zip(samples, pi_old, strict=True)
        for old, behaviour, m in zip(olds, s.logprobs, s.loss_mask, strict=True)
        if m
    ]
    kept, lag = lag_bound(stale, trainer.policy_version, max_lag=1)
    assert lag["lag/histogram"] == {"1": 4} and lag["lag/stale_token_fraction"] == 1.0
    metrics = trainer.train_step(kept)
    assert metrics["updated"] is True and metrics["staleness_max"] == 1
    # The IS weight is pi_old / pi_behaviour, token by token ...
    # (the step did move the weights: pi_old is not the behaviour policy; the mean weight alone can
    # land near 1 when tokens move both ways, measured 1.003 on a fresh machine)
    moved = [
        abs(o - b)
        for s, olds in zip(samples, pi_old, strict=True)
        for o, b, m in zip(olds, s.logprobs, s.loss_mask, strict=True)
        if m
    ]
    assert max(moved) > 0.01 and any(abs(w - 1.0) > 0.01 for w in weights)
    assert metrics["is_weight_mean"] == pytest.approx(sum(weights) / len(weights), abs=1e-4)
    assert metrics["is_weight_max"] <= 2.0
    # ... and the PPO ratio is taken against pi_old, not the behaviour policy: at the step's only
    # update it is exactly 1, so nothing is clipped however stale the samples.
    assert metrics["clip_fraction"] == 0.0
    # Beyond the bound (now lag 2 > max_lag 1) the loop trains on none of it, and counts it.
    batch = StepRollouts(3, [], rollouts_from(triples, [1.0, 0.0]), 0.0, 0.0, 0.0)
    opts = TrainOptions(model=str(tiny_model_dir), out=tmp_path, max_lag=1)
    metrics = _train_on(batch, engine, trainer, opts, 0.0)
    assert metrics["lag/dropped_rollouts"] == 4 and metrics["updated"] is False
    assert trainer.policy_version == 2


def _overlap_options(model: Path, run: Path, concurrency: int) -> TrainOptions:
    # A random model never earns a reward: train on the (all-zero) groups anyway, so versions advance.
    return TrainOptions(
        model=str(model),
        out=run,
        steps=3,
        group=2,
        batch_tasks=1,
        max_tokens=12,
        max_turns=2,
        concurrency=concurrency,
        progress=False,
        overlap=True,
        max_lag=1,
        trainer=TrainerConfig(lr=1e-3, drop_zero_variance=False),
    )


def _call_versions(gateway_db: Path) -> dict[int, list[list[int]]]:
    """Per step, each closed rollout's call versions in call order."""
    with sqlite3.connect(gateway_db) as db:
        rows = db.execute(
            "SELECT r.run_id, r.id, c.policy_version FROM calls c JOIN rollouts r ON r.id = c.rollout_id"
            " WHERE r.status='closed' ORDER BY r.id, c.seq"
        ).fetchall()
    by_step: dict[int, dict[str, list[int]]] = {}
    for run_id, rollout_id, version in rows:
        by_step.setdefault(int(run_id.rsplit("-step", 1)[1]), {}).setdefault(rollout_id, []).append(version)
    return {step: list(rollouts.values()) for step, rollouts in sorted(by_step.items())}


def _check_lag_bound(run: Path, logged: list[dict[str, Any]], max_lag: int) -> None:
    """Every step trained within the bound, by its own metrics and by the gateway's records."""
    trained_by = {1: 0} | {m["step"] + 1: m["policy_version"] for m in logged}  # weights each step trains
    for m in logged:
        assert m["staleness_max"] <= max_lag and m["lag/max"] <= max_lag
        assert m["lag/dropped_rollouts"] == 0
    for step, rollouts in _call_versions(run / "gateway.db").items():
        for versions in rollouts:
            assert versions == sorted(versions)  # a rollout never goes back to older weights
            assert trained_by[step] - max_lag <= min(versions) <= max(versions) <= trained_by[step]


def test_overlap_trains_within_the_lag_bound_while_the_next_rollouts_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    summary = train(_overlap_options(tiny_model_dir, run, concurrency=2))
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    _check_lag_bound(run, logged, max_lag=1)
    calls = _call_versions(run / "gateway.db")
    assert {v for vs in calls[1] for v in vs} == {0}
    assert min(v for vs in calls[3] for v in vs) >= 1  # step 3's rollouts waited for step 1's weights
    t = [m["timeline"] for m in logged]
    for k in (1, 2):
        # The rollouts of step k + 1 ran while step k trained ...
        assert t[k]["rollout_start"] < t[k - 1]["train_end"] and t[k]["rollout_end"] > t[k - 1]["train_start"]
        assert logged[k]["time/wait"] <= logged[k]["time/rollout"]
    # ... but not before the weights of step k - 1 were in the engine (max_lag 1).
    assert t[2]["rollout_start"] >= t[0]["pushed"]


class _SimulatedCrash(Exception):
    pass


def test_overlap_resumes_after_a_crash_mid_overlap_without_losing_or_repeating_rollouts(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    opts = _overlap_options(tiny_model_dir, run, concurrency=1)
    step2, step3 = (run / "steps" / f"{k:06d}" / "runner.db" for k in (2, 3))
    real_train_step = Trainer.train_step

    def crash_in_step_2(self: Trainer, rollouts: Any) -> dict[str, Any]:
        if self.step + 1 == 2:  # step 3's rollouts are running: crash once one of them has finished
            deadline = time.monotonic() + 120
            while not _done_rollouts(step3):
                assert time.monotonic() < deadline, "step 3's rollouts never finished"
                time.sleep(0.05)
            raise _SimulatedCrash
        return real_train_step(self, rollouts)

    monkeypatch.setattr(Trainer, "train_step", crash_in_step_2)
    with pytest.raises(_SimulatedCrash):
        train(opts)
    monkeypatch.undo()
    assert [s for s, _ in iter_checkpoints(run / "checkpoints")] == [1]  # step 2 was never saved
    kept2, kept3 = _done_rollouts(step2), _done_rollouts(step3)
    assert len(kept2) == 2 and 0 < len(kept3) <= 2

    summary = train(load_options(run), resume=True)
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    for k in (1, 2, 3):
        assert len(_done_rollouts(run / "steps" / f"{k:06d}" / "runner.db")) == 2
    after2, after3 = _done_rollouts(step2), _done_rollouts(step3)
    assert after2 == kept2 and {k: after3[k] for k in kept3} == kept3  # kept, not run again
    with sqlite3.connect(run / "gateway.db") as db:
        closed = db.execute("SELECT run_id, task_id, metadata FROM rollouts WHERE status='closed'").fetchall()
    keys = [(r, t, json.loads(m)["sample"]) for r, t, m in closed]
    assert len(keys) == len(set(keys)) == 3 * 2  # every rollout scored once
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    _check_lag_bound(run, logged, max_lag=1)


def _grads(policy: Policy, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    policy.model.zero_grad()
    lp = policy.logprobs(batch)
    (-(lp * batch.mask).sum()).backward()
    grads = [p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]
    return lp.detach(), torch.cat(grads)


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model_dir: Path) -> None:
    """Recomputing activations in the backward pass changes memory, not the update."""
    samples = [
        chat_sample(
            [{"role": "user", "content": f"Read {n}."}, {"role": "assistant", "content": n}], None, tok
        )
        for tok in [Policy(tiny_model_dir, lr=1e-3).tokenizer]
        for n in ("a.txt", "notes/b.txt")
    ]
    plain = Policy(tiny_model_dir, lr=1e-3)
    checkpointed = Policy(tiny_model_dir, lr=1e-3, tuning=Tuning(gradient_checkpointing=True))
    assert checkpointed.collate(samples).shared == 0  # a checkpointed layer would drop a shared KV
    lp_plain, g_plain = _grads(plain, plain.collate(samples))
    lp_ckpt, g_ckpt = _grads(checkpointed, checkpointed.collate(samples))
    assert torch.allclose(lp_plain, lp_ckpt, atol=1e-5)
    assert torch.allclose(g_plain, g_ckpt, rtol=1e-4, atol=1e-5)
    # The layers really recompute: their forward runs again inside the backward pass.
    calls = 0

    def count(*_: Any) -> None:
        nonlocal calls
        calls += 1

    layer = checkpointed.model.model.layers[0]
    handle = layer.register_forward_pre_hook(count)  # the recomputation may stop before the end
    _grads(checkpointed, checkpointed.collate(samples))
    handle.remove()
    assert calls == 2
    assert not any(
        m.training for m in checkpointed.model.modules() if not hasattr(m, "gradient_checkpointing")
    )


def test_lora_trains_adapters_only_and_its_checkpoint_serves_the_trainers_logprobs(
    tiny_model_dir: Path, engine_and_prompts: Any, tmp_path: Path
) -> None:
    _, triples = engine_and_prompts
    cfg = TrainerConfig(lr=5e-3, tuning=Tuning(lora_rank=4))
    trainer = Trainer(tiny_model_dir, cfg, group_size=2)
    model = trainer.policy.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # New adapters leave the function unchanged (B = 0): the start is the base model.
    base = Policy(tiny_model_dir, lr=0.0)
    probe = [one_turn_sample(p, c, lps) for p, c, lps in triples]
    assert trainer.policy.sample_logprobs(probe) == base.sample_logprobs(probe)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    metrics = trainer.train_step(rollouts_from(triples, [1.0, 0.0]))
    assert metrics["updated"]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    trainer.save(tmp_path / "ckpt", metrics=metrics)
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"model.safetensors", "tokenizer.json", "optimizer.pt", "adapter"} <= files
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()

    # The merged checkpoint is a plain model: the engine serves it with the trainer's logprobs.
    prompt = triples[0][0]
    engine = TransformersEngine(tmp_path / "ckpt")

    async def generate() -> Any:
        await engine.start()
        try:
            return await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=7))
        finally:
            await engine.close()

    result = asyncio.run(generate())
    new = one_turn_sample(prompt, result.completion_ids, result.logprobs)
    assert trainer.policy.sample_logprobs([new])[0][len(prompt) :] == pytest.approx(result.logprobs, abs=1e-4)
    moved = base.sample_logprobs([new])[0][len(prompt) :]
    assert max(abs(a - b) for a, b in zip(moved, result.logprobs, strict=True)) > 1e-3

    # Resume: the saved adapter on the frozen base, the optimizer's moments with it; the next step
    # is the one an uninterrupted trainer takes.
    resumed = Trainer.resume(tmp_path / "ckpt", cfg, group_size=2, reference_dir=tiny_model_dir)
    assert resumed.policy_version == 1
    assert resumed.policy.sample_logprobs([new])[0] == pytest.approx(
        trainer.policy.sample_logprobs([new])[0], abs=1e-6
    )
    batch = rollouts_from(triples, [0.0, 1.0])
    trainer.train_step(batch)
    resumed.train_step(batch)
    assert resumed.policy.sample_logprobs([new])[0] == pytest.approx(
        trainer.policy.sample_logprobs([new])[0], abs=1e-5
    )


def test_cli_sft_with_lora_writes_a_merged_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from openforgerl.cli import main

    rows = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    rows.write_text(json.dumps(chat) + "\n")
    out = tmp_path / "sft"
    args = ["sft", "--data", str(rows), "--model", str(tiny_model_dir), "--out", str(out), "--epochs", "2"]
    result = CliRunner().invoke(main, [*args, "--lr", "1e-2", "--lora-rank", "8", "--gradient-checkpointing"])
    assert result.exit_code == 0, result.output
    assert "loss" in result.output
    from transformers import AutoModelForCausalLM

    trained: Any = AutoModelForCausalLM.from_pretrained(out)  # no adapter files: merged
    start: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not any("lora" in n for n, _ in trained.named_parameters())
    changed = [
        n
        for (n, a), (_, b) in zip(trained.named_parameters(), start.named_parameters(), strict=True)
        if not torch.equal(a, b)
    ]
    assert changed and all("embed" not in n and "norm" not in n for n in changed)


def test_one_temperature_for_the_rollouts_and_the_trainers_logprobs(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from openforgerl.cli.train import train_cmd

    opts = TrainOptions(model="m", out=tmp_path, temperature=0.7)
    assert "temperature" not in {f.name for f in dataclasses.fields(TrainerConfig)}  # the run's alone
    assert TrainOptions.from_json(opts.to_json()).temperature == 0.7
    with pytest.raises(TypeError):
        TrainerConfig(temperature=0.7)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="above 0"):
        TrainOptions(model="m", out=tmp_path, temperature=0.0)
    result = CliRunner().invoke(
        train_cmd, ["--model", "m", "--out", str(tmp_path / "r"), "--temperature", "0"]
    )
    assert result.exit_code != 0 and "--temperature" in result.output


def test_train_temperature_drives_the_rollouts_sampling_and_the_trainers_logprobs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A real run: every call of step 1 sampled at --temperature, and the trainer's logprobs of those
    tokens agree with the engine's (no KL between them, importance weights 1); resumed with another
    temperature, step 2 the same at the new one."""
    from click.testing import CliRunner

    from openforgerl.cli.train import train_cmd

    run = tmp_path / "run"
    args = ["--out", str(run), "--group", "2", "--batch-tasks", "1", "--max-tokens", "8", "--max-turns", "1"]
    args += ["--concurrency", "2", "--keep-zero-variance", "--skip-tasks", "995", "--lr", "1e-3"]
    for extra in (
        ["--model", str(tiny_model_dir), "--steps", "1", "--temperature", "0.7"],
        ["--resume", "--steps", "2", "--temperature", "1.3"],
    ):
        result = CliRunner().invoke(train_cmd, [*args, *extra], env={"TQDM_DISABLE": "1"})
        assert result.exit_code == 0, result.output
    assert json.loads((run / loop.RUN_FILE).read_text())["temperature"] == 1.3
    with sqlite3.connect(run / "gateway.db") as db:
        used = db.execute(
            "SELECT r.run_id, c.sampling_used FROM calls c JOIN rollouts r ON r.id = c.rollout_id"
        ).fetchall()
    temps = {(run_id, json.loads(s)["temperature"]) for run_id, s in used}
    assert temps == {("run-step1", 0.7), ("run-step2", 1.3)}
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2] and all(m["updated"] for m in steps)
    for m in steps:  # at another temperature than the engine's these are far off (KL ~0.1 nats)
        assert m["kl_behaviour"] < 1e-3 and m["is_weight_mean"] == pytest.approx(1.0, abs=1e-2)
