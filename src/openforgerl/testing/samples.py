"""Hand-made training samples for tests of the trainer: one prompt, one sampled completion."""

from __future__ import annotations

from openforgerl.rollouts.trajectory import NO_VERSION, Sample


def one_turn_sample(
    prompt: list[int], completion: list[int], logprobs: list[float], rollout_id: str = "r"
) -> Sample:
    """A sample whose loss covers `completion` alone, sampled by policy version 0 with `logprobs`."""
    n = len(completion)
    return Sample(
        rollout_id=rollout_id,
        reward=0.0,
        branch_id=0,
        branch_reason="",
        input_ids=prompt + completion,
        loss_mask=[0] * len(prompt) + [1] * n,
        logprobs=[0.0] * len(prompt) + logprobs,
        policy_versions=[NO_VERSION] * len(prompt) + [0] * n,
    )
