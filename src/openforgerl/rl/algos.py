"""The RL algorithm pieces, taken from veRL (`verl.trainer.ppo.core_algos`, `rollout_corr_helper`).

Nothing here re-derives an estimator or a loss: this module only shapes our data into veRL's
tensors and calls its registered functions by name, so every estimator and policy loss veRL has
(and any a user registers with `core_algos.register_adv_est` / `register_policy_loss`) is usable.

Shapes: per-token tensors are (batch, length) and aligned with the token they score; `mask` is
the loss mask (1 on tokens the policy sampled). Advantages are outcome advantages: one reward per
rollout, grouped by task, one scalar advantage per rollout shared by all of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos, rollout_corr_helper
from verl.workers.config import ActorConfig
from verl.workers.config import PolicyLossConfig as VerlPolicyLossConfig

from openforgerl.rl.config import LossAggMode as LossAggMode
from openforgerl.rl.config import LossConfig as LossConfig

# veRL's estimators that need only one outcome reward per rollout (and the group index). GAE needs
# a critic, ReMax a greedy baseline, GDPO several reward keys, the optimal-token baselines the
# actor's per-token statistics: those do not fit an outcome-reward trainer.
OUTCOME_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)


def policy_loss_names() -> list[str]:
    """Every policy loss registered in veRL (vanilla PPO clip, gspo, cispo, ...)."""
    return sorted(core_algos.POLICY_LOSS_REGISTRY)


def outcome_advantages(
    rewards: Sequence[float],
    groups: Sequence[str],
    estimator: str = "grpo",
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> list[float]:
    """One advantage per rollout from veRL's estimator `estimator`; `groups[i]` names rollout i's group
    (the G rollouts of one task). `norm_adv_by_std=False` is Dr.GRPO (GRPO estimators only)."""
    if estimator not in OUTCOME_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r}: choose from {', '.join(OUTCOME_ESTIMATORS)}")
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} group ids")
    if not rewards:
        return []
    fn = core_algos.get_adv_estimator_fn(estimator)
    kwargs: dict[str, Any] = {
        # One "token" per rollout: outcome estimators sum token rewards, so the shape is all they need.
        "token_level_rewards": torch.tensor(rewards, dtype=torch.float32)[:, None],
        "response_mask": torch.ones(len(rewards), 1),
        "index": np.array(groups, dtype=object),
        "epsilon": epsilon,
        "config": AlgoConfig(norm_adv_by_std_in_grpo=norm_adv_by_std),
    }
    if estimator in ("grpo", "grpo_vectorized", "grpo_passk"):
        kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std
    advantages, _returns = fn(**kwargs)
    return [float(a) for a in advantages[:, 0]]


@dataclass(frozen=True)
class MiniBatchSize:
    """The optimizer step's whole batch, so that micro-batch losses add up to its mean (veRL's
    `global_batch_info`): loss tokens and sequences with at least one loss token."""

    tokens: int
    sequences: int


def actor_config(cfg: LossConfig, group_size: int) -> Any:
    """veRL's ActorConfig carrying these settings (its policy losses read them from it)."""
    if cfg.loss not in core_algos.POLICY_LOSS_REGISTRY:
        raise ValueError(f"policy loss {cfg.loss!r}: choose from {', '.join(policy_loss_names())}")
    return ActorConfig(
        strategy="embedded",
        rollout_n=group_size,
        use_dynamic_bsz=True,  # micro-batches by token budget; no fixed micro-batch size
        clip_ratio=cfg.clip_ratio_low,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        policy_loss=VerlPolicyLossConfig(loss_mode=cfg.loss),
        use_kl_loss=cfg.kl_coef > 0,
        kl_loss_coef=cfg.kl_coef,
        kl_loss_type=cfg.kl_type,
    )


def importance_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated IS weights pi_old / pi_behaviour (None when `cfg.tis` is off) and veRL's off-policy
    metrics (`rollout_corr/...`: KL, perplexities, weight statistics) either way."""
    proto, _mask, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_logprobs.detach(),
        rollout_log_prob=behaviour_logprobs,
        response_mask=mask,
        rollout_is=cfg.tis,
        rollout_is_threshold=cfg.tis_threshold,
    )
    weights = None if proto is None else proto.batch["rollout_is_weights"]
    return weights, metrics


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    actor_config: Any,
    batch: MiniBatchSize,
    *,
    is_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the mini-batch loss: veRL's policy loss (+ KL to the reference).

    The loss is normalised by the whole mini-batch (`batch`), so gradients accumulated over its
    micro-batches equal the gradient of the mini-batch loss.
    """
    actor_config.global_batch_info.update(
        dp_size=1, batch_num_tokens=batch.tokens, global_batch_size=batch.sequences
    )
    loss_fn = core_algos.get_policy_loss_fn(actor_config.policy_loss.loss_mode)
    pg_loss, pg_metrics = loss_fn(
        old_log_prob=old_logprobs,
        log_prob=logprobs,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=actor_config.loss_agg_mode,
        config=actor_config,
        rollout_is_weights=is_weights,
    )
    metrics = {k: float(v) for k, v in pg_metrics.items()}
    metrics["actor/pg_loss"] = float(pg_loss.detach())
    loss = pg_loss
    if ref_logprobs is not None:
        kl_penalty: Any = core_algos.kl_penalty  # annotated with FloatTensor; any float tensor works
        kl = kl_penalty(logprobs, ref_logprobs, actor_config.kl_loss_type)
        kl_loss = core_algos.agg_loss(
            loss_mat=kl,
            loss_mask=mask,
            loss_agg_mode=actor_config.loss_agg_mode,
            **actor_config.global_batch_info,
        )
        loss = loss + actor_config.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = float(kl_loss.detach())
    return loss, metrics


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, batch_tokens: int) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens, as this micro-batch's share of the token mean
    over `batch_tokens` (veRL's `agg_loss`, token-mean)."""
    return core_algos.agg_loss(
        loss_mat=-logprobs, loss_mask=mask, loss_agg_mode="token-mean", batch_num_tokens=batch_tokens
    )
