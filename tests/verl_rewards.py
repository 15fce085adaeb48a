"""A reward for `make test-verl` (veRL's `reward.custom_reward_function`), not a product reward.

The kit's tiny model scores 0 on every tools-tiny task before training (it has never seen a tool
call), so the task's verifier gives GRPO no signal to learn from and the update would be zero. The
test needs an update that is real: the mean character code of the response (0..1), which differs
between the samples of a group, so GRPO's advantages and the gradient are non-zero. veRL's own
reward loop calls it with the decoded response.
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    text = solution_str or ""
    return sum(min(ord(c), 255) for c in text) / (255.0 * len(text)) if text else 0.0
