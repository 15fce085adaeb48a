"""What the tests of training inside a harness share: each CLI's marks in its prompts, the calls a
run's gateway recorded, and a one-turn training sample."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from openforgerl.rollouts.trajectory import NO_VERSION, Sample
from openforgerl.store.sqlite import CallRow, Store

# Per harness: a phrase of its system prompt, its shell tool's declaration, how it ends a task.
HARNESS_MARKS = {
    "mini-swe-agent": ("Please solve this issue", '"name": "bash"', "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
    "pi": ("operating inside pi", '"name": "read"', '"name": "write"'),
}


def recorded_calls(db: Path) -> list[CallRow]:
    """Every call the run's gateway recorded, rollout by rollout, in order."""
    with sqlite3.connect(db) as conn:
        ids = [r[0] for r in conn.execute("SELECT DISTINCT rollout_id FROM calls")]

    async def read() -> list[CallRow]:
        store = Store(db)
        try:
            return [row for rid in ids for row in await store.calls(rid)]
        finally:
            await store.close()

    return asyncio.run(read())


def sample_of(prompt: list[int], completion: list[int], logprobs: list[float]) -> Sample:
    return Sample(
        rollout_id="r",
        reward=0.0,
        branch_id=0,
        branch_reason="",
        input_ids=prompt + completion,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        logprobs=[0.0] * len(prompt) + logprobs,
        policy_versions=[NO_VERSION] * len(prompt) + [0] * len(completion),
    )
