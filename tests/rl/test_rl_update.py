"""What one trainer step does to the policy: sequences with a positive advantage gain likelihood,
negative ones lose it, groups it did not train on barely move; the check is shown to catch a
flipped advantage sign and a loss mask one position off. Also the step's entropy and update
metrics, and the learning-rate warm-up across a resume."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import openforgerl.rl.policy as policy_module
from openforgerl.engines.base import SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.rl import algos
from openforgerl.rl.trainer import Rollout, Trainer, TrainerConfig
from openforgerl.testing.samples import one_turn_sample

TRAINED_PROMPTS = ["Read a.txt and b.txt.", "List the files.", "What is 2 + 3?", "Hello there"]
UNTRAINED_PROMPTS = ["Write notes.md.", "Open the browser."]
REWARDS = [1.0, 0.0, 1.0, 0.0]  # per group: two rollouts up, two down
LR = 1e-3


@pytest.fixture(scope="module")
def sampled(tiny_model_dir: Path) -> dict[str, list[tuple[list[int], list[int], list[float]]]]:
    """Per prompt, len(REWARDS) completions the engine sampled (prompt, completion, logprobs)."""
    engine = TransformersEngine(tiny_model_dir)

    async def go() -> dict[str, list[Any]]:
        await engine.start()
        try:
            out = {}
            for text in TRAINED_PROMPTS + UNTRAINED_PROMPTS:
                prompt = engine.tokenizer.encode(text)
                params = [SamplingParams(temperature=1.0, max_tokens=12, seed=k) for k in range(len(REWARDS))]
                results = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
                out[text] = [(prompt, r.completion_ids, r.logprobs) for r in results]
            return out
        finally:
            await engine.close()

    return asyncio.run(go())


def _rollouts(sampled: dict[str, list[Any]]) -> tuple[list[Rollout], list[Rollout]]:
    """Fresh rollouts: the trained groups (mixed rewards) and the untrained ones (equal rewards,
    which the trainer drops)."""
    trained = [
        Rollout(text, reward, [one_turn_sample(p, c, lp, f"{text}-{k}")])
        for text in TRAINED_PROMPTS
        for k, ((p, c, lp), reward) in enumerate(zip(sampled[text], REWARDS, strict=True))
    ]
    untrained = [
        Rollout(text, 1.0, [one_turn_sample(p, c, lp, f"{text}-{k}")])
        for text in UNTRAINED_PROMPTS
        for k, (p, c, lp) in enumerate(sampled[text])
    ]
    return trained, untrained


@dataclasses.dataclass
class Moves:
    """Per rollout: (advantage, change of its summed loss-token logprob, loss tokens)."""

    trained: list[tuple[float, float, int]]
    untrained: list[tuple[float, int]]
    metrics: dict[str, Any]


Sabotage = Callable[[pytest.MonkeyPatch], None]


def one_step(
    model_dir: Path,
    sampled: dict[str, list[Any]],
    sabotage: Sabotage | None = None,
    cfg: TrainerConfig | None = None,
) -> Moves:
    """One optimizer step on the trained groups (with `sabotage` applied while it trains), each
    rollout's log-likelihood re-scored with the new weights and compared with before."""
    trained, untrained = _rollouts(sampled)
    trainer = Trainer(model_dir, cfg or TrainerConfig(lr=LR), group_size=len(REWARDS))
    everything = [r.samples[0] for r in trained + untrained]
    before = trainer.sequence_logprobs(everything)
    advantages = algos.outcome_advantages([r.reward or 0.0 for r in trained], [r.group for r in trained])
    with pytest.MonkeyPatch.context() as mp:
        if sabotage is not None:
            sabotage(mp)
        metrics = trainer.train_step(trained + untrained)
    after = trainer.sequence_logprobs(everything)
    change = [b - a for a, b in zip(before, after, strict=True)]
    n = len(trained)
    return Moves(
        trained=[(adv, change[i], trained[i].samples[0].num_loss_tokens) for i, adv in enumerate(advantages)],
        untrained=[(change[n + i], r.samples[0].num_loss_tokens) for i, r in enumerate(untrained)],
        metrics=metrics,
    )


def direction_failures(moves: Moves) -> list[str]:
    """Why the step did not move the policy the way the advantages say ([] when it did)."""
    failures = []
    signed = [(adv, c) for adv, c, _ in moves.trained if adv != 0]
    agreement = sum(adv * c > 0 for adv, c in signed) / len(signed)
    if agreement < 0.9:
        failures.append(f"only {agreement:.0%} of the trained rollouts moved the way their advantage says")
    pos = [c for adv, c in signed if adv > 0]
    neg = [c for adv, c in signed if adv < 0]
    if sum(pos) / len(pos) <= 0:
        failures.append(f"positive-advantage rollouts lost likelihood on average ({sum(pos) / len(pos):.4f})")
    if sum(neg) / len(neg) >= 0:
        failures.append(
            f"negative-advantage rollouts gained likelihood on average ({sum(neg) / len(neg):.4f})"
        )
    trained_move = sum(abs(c) / n for _, c, n in moves.trained) / len(moves.trained)
    untrained_move = sum(abs(c) / n for c, n in moves.untrained) / len(moves.untrained)
    if untrained_move >= 0.25 * trained_move:
        failures.append(f"untrained rollouts moved {untrained_move:.4f}/token, trained {trained_move:.4f}")
    return failures


def negated_advantages(mp: pytest.MonkeyPatch) -> None:
    """The advantage sign flipped: the step reinforces the failures."""
    real = algos.outcome_advantages
    mp.setattr(algos, "outcome_advantages", lambda *a, **k: [-x for x in real(*a, **k)])


def mask_one_position_off(mp: pytest.MonkeyPatch) -> None:
    """The loss mask aligned with input_ids instead of the next-token predictions: each loss token
    is scored by the logits at its own position (the forgotten shift)."""
    real = policy_module._collate

    def collate(*a: Any, **k: Any) -> Any:
        batch = real(*a, **k)
        return dataclasses.replace(batch, targets=batch.ids[:, batch.positions])

    mp.setattr(policy_module, "_collate", collate)


def test_one_step_moves_each_rollout_the_way_its_advantage_says(tiny_model_dir: Path, sampled: Any) -> None:
    moves = one_step(tiny_model_dir, sampled)
    assert direction_failures(moves) == []
    m = moves.metrics
    assert m["groups_dropped_zero_variance"] == len(UNTRAINED_PROMPTS)
    assert m["groups_zero_variance_fraction"] == pytest.approx(2 / 6)
    # The trainer's own measurement agrees with the test's.
    signed = [(adv, c) for adv, c, _ in moves.trained if adv != 0]
    assert m["update/direction_agreement"] == pytest.approx(sum(a * c > 0 for a, c in signed) / len(signed))
    pos = [c for adv, c in signed if adv > 0]
    assert m["update/logp_change_pos"] == pytest.approx(sum(pos) / len(pos), abs=1e-3)
    assert m["update/logp_change_pos_per_token"] > 0 > m["update/logp_change_neg_per_token"]
    assert m["update/logp_change_neg"] < 0 and m["time/measure_update"] >= 0


def test_the_update_is_measured_on_a_sample_of_each_sign(tiny_model_dir: Path, sampled: Any) -> None:
    """With `measure_update_rollouts` below the step's trained rollouts, the trainer re-scores that
    many, half of each sign, and its means of each sign lie within what the test measured for the
    rollouts of that sign; by default (16) it re-scores all 16 of this step."""
    moves = one_step(tiny_model_dir, sampled, cfg=TrainerConfig(lr=LR, measure_update_rollouts=4))
    m = moves.metrics
    assert m["update/measured_rollouts"] == 4 < len(moves.trained)
    pos = [c for adv, c, _ in moves.trained if adv > 0]
    neg = [c for adv, c, _ in moves.trained if adv < 0]
    # Two of each sign: their mean lies between the least and the most the test saw of that sign.
    assert min(pos) - 1e-3 <= m["update/logp_change_pos"] <= max(pos) + 1e-3
    assert min(neg) - 1e-3 <= m["update/logp_change_neg"] <= max(neg) + 1e-3
    assert m["update/direction_agreement"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert one_step(tiny_model_dir, sampled).metrics["update/measured_rollouts"] == len(moves.trained)


@pytest.mark.filterwarnings("ignore:precision bf16")  # emulated where the CPU lacks bf16 (the next test)
def test_bf16_autocast_on_the_cpu_keeps_the_update_right_and_the_weights_fp32(
    tiny_model_dir: Path, sampled: Any
) -> None:
    """precision "bf16": the forward runs in bf16 on the CPU (its logprobs differ from the fp32
    engine's, so the importance weights are no longer exactly 1, but stay close), the master weights
    stay fp32, and the step still moves every rollout the way its advantage says."""
    with pytest.raises(ValueError, match="precision"):
        TrainerConfig(precision="fp16")
    moves = one_step(tiny_model_dir, sampled, cfg=TrainerConfig(lr=LR, precision="bf16"))
    assert direction_failures(moves) == []
    m = moves.metrics
    assert m["is_weight_min"] < 1.0 < m["is_weight_max"]  # bf16 rounding, seen by the IS weights
    assert 0.8 < m["is_weight_min"] and m["is_weight_max"] < 1.25
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=LR, precision="bf16"), group_size=len(REWARDS))
    assert {p.dtype for p in trainer.policy.model.parameters()} == {torch.float32}


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_a_bf16_matmul_is_said_to_be_emulated(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A CPU without AVX512_BF16, AMX or Arm BF16 emulates bf16 hundreds of times slower than fp32:
    asking for it there warns, and only there."""
    monkeypatch.setattr(policy_module, "cpu_has_native_bf16", lambda: native)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Trainer(tiny_model_dir, TrainerConfig(lr=LR, precision="bf16"), group_size=len(REWARDS))
        Trainer(tiny_model_dir, TrainerConfig(lr=LR), group_size=len(REWARDS))
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(said) == (0 if native else 1) and all("emulated" in m for m in said)


@pytest.mark.parametrize("sabotage", [negated_advantages, mask_one_position_off])
def test_the_direction_check_catches_a_broken_update(
    tiny_model_dir: Path, sampled: Any, sabotage: Sabotage
) -> None:
    assert direction_failures(one_step(tiny_model_dir, sampled, sabotage)) != []


def test_neg_adv_scale_shrinks_only_the_negative_advantages(tiny_model_dir: Path, sampled: Any) -> None:
    """`neg_adv_scale` multiplies the negative advantages alone; at 0 the failed rollouts carry no
    gradient, so they barely move while the passed ones still gain likelihood."""
    from openforgerl.rl.trainer import scale_negative

    assert scale_negative([1.5, -0.5, 0.0, -2.0], 0.25) == [1.5, -0.125, 0.0, -0.5]
    with pytest.raises(ValueError, match="neg_adv_scale"):
        TrainerConfig(neg_adv_scale=1.5)
    plain = one_step(tiny_model_dir, sampled)
    trained, untrained = _rollouts(sampled)
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=LR, neg_adv_scale=0.0), group_size=len(REWARDS))
    everything = [r.samples[0] for r in trained]
    before = trainer.sequence_logprobs(everything)
    m = trainer.train_step(trained + untrained)
    after = trainer.sequence_logprobs(everything)
    pos = [b - a for r, a, b in zip(trained, before, after, strict=True) if r.reward == 1.0]
    neg = [b - a for r, a, b in zip(trained, before, after, strict=True) if r.reward == 0.0]
    assert min(pos) > 0
    # Without their own gradient the failures move far less than under plain GRPO.
    plain_neg = [c for adv, c, _ in plain.trained if adv < 0]
    assert sum(map(abs, neg)) < 0.5 * sum(map(abs, plain_neg))
    assert m["advantage_abs_mean"] < plain.metrics["advantage_abs_mean"]


def test_step_metrics_report_entropy_sampled_nll_and_the_ppo_ratio(
    tiny_model_dir: Path, sampled: Any
) -> None:
    """The entropy of the trained tokens lies in (0, log V] and, the samples being the policy's own,
    near their mean negative logprob; the PPO ratio is reported only when there is more than one
    update, and turning `measure_update` off leaves the `update/` metrics out."""
    trained, untrained = _rollouts(sampled)
    trainer = Trainer(tiny_model_dir, TrainerConfig(lr=LR), group_size=len(REWARDS))
    vocab = trainer.policy.model.config.vocab_size
    m = trainer.train_step(trained + untrained)
    assert 0 < m["entropy"] <= math.log(vocab)
    assert m["sampled_nll"] == pytest.approx(m["entropy"], rel=0.1)
    assert 0 <= m["update/direction_agreement"] <= 1
    assert not any(k.startswith("ratio_") for k in m)

    trained, untrained = _rollouts(sampled)
    cfg = TrainerConfig(lr=LR, mini_batches=2, ppo_epochs=2, measure_update=False)
    m = Trainer(tiny_model_dir, cfg, group_size=len(REWARDS)).train_step(trained + untrained)
    assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"] and m["ratio_min"] < 1 < m["ratio_max"]
    assert not any(k.startswith("update/") for k in m) and "time/measure_update" not in m


def test_warmup_ramps_the_rate_over_the_first_updates_and_survives_a_resume(
    tiny_model_dir: Path, sampled: Any, tmp_path: Path
) -> None:
    """Update k of the first N runs at lr x k / N, then lr; a resumed trainer picks up where the
    saved one stopped (the rate and the weights the same as an uninterrupted run's)."""
    cfg = TrainerConfig(lr=LR, warmup_steps=3, measure_update=False)

    def step(trainer: Trainer) -> float:
        trained, _ = _rollouts(sampled)
        return float(trainer.train_step(trained)["lr"])

    straight = Trainer(tiny_model_dir, cfg, group_size=len(REWARDS))
    lrs = [step(straight) for _ in range(4)]
    assert lrs == pytest.approx([LR / 3, 2 * LR / 3, LR, LR])

    first = Trainer(tiny_model_dir, cfg, group_size=len(REWARDS))
    assert [step(first) for _ in range(2)] == pytest.approx(lrs[:2])
    first.save(tmp_path / "ckpt")
    resumed = Trainer.resume(tmp_path / "ckpt", cfg, group_size=len(REWARDS), reference_dir=tiny_model_dir)
    assert [step(resumed) for _ in range(2)] == pytest.approx(lrs[2:])
    for a, b in zip(straight.policy.model.parameters(), resumed.policy.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_entropy_in_chunks_equals_the_categoricals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked entropy (lse - E_p[logits]) matches torch's Categorical, masked tokens included."""
    logits = torch.randn(3, 5, 11) * 3
    logits[..., 4] = -1e9  # a token the engine never samples
    monkeypatch.setattr(policy_module, "_ENTROPY_CHUNK", 2 * 11)  # two rows per chunk
    got = policy_module._entropy(logits, logits.logsumexp(-1))
    assert torch.allclose(got, torch.distributions.Categorical(logits=logits).entropy(), atol=1e-5)
