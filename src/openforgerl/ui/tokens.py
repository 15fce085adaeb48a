"""The token view of one rollout: the trajectory builder's samples, decoded when a tokenizer is known."""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openforgerl.rollouts.trajectory import build_samples, calls_from_rows
from openforgerl.store import CallRow
from openforgerl.ui.runs import TrainerTokens

_load_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer  # slow to import: only when a model is known

    return AutoTokenizer.from_pretrained(model_dir)


def decode_pieces(model_dir: Path, ids: Sequence[int]) -> dict[int, str]:
    """The text of each distinct id on its own (a character split over several byte-level tokens
    shows as U+FFFD in each: the ids are still exact)."""
    with _load_lock:  # two requests must not load the same tokenizer twice
        tok = _tokenizer(str(model_dir))
    unique = sorted(set(ids))
    texts = tok.batch_decode([[i] for i in unique], skip_special_tokens=False)
    return dict(zip(unique, texts, strict=True))


def why_split(index: int, branch_reason: str, side_request: str) -> str:
    """Why the trajectory builder started this sample instead of appending to an earlier one."""
    if side_request:
        return f"side request ({side_request}): kept apart from the main conversation"
    if index == 0:
        return "the rollout's first call"
    if branch_reason:
        return f"new branch: {branch_reason}"
    return "its prompt does not start with an earlier sample's exact ids"


def token_view(
    calls: Sequence[CallRow],
    reward: float,
    model_dir: Path | None,
    trainer: dict[int, TrainerTokens],
) -> dict[str, Any]:
    samples = build_samples(calls_from_rows(calls), reward)
    seq_of = {c.id: c.seq for c in calls}
    out = []
    for i, s in enumerate(samples):
        recorded = trainer.get(s.call_ids[0]) if s.call_ids else None
        out.append(
            {
                "index": i,
                "branch_id": s.branch_id,
                "branch_reason": s.branch_reason,
                "side_request": s.side_request,
                "why": why_split(i, s.branch_reason, s.side_request),
                "call_ids": s.call_ids,
                "call_seqs": [seq_of.get(c) for c in s.call_ids],
                "completion_spans": s.completion_spans,
                "truncated": s.truncated,
                "reward": s.reward,
                "input_ids": s.input_ids,
                "loss_mask": s.loss_mask,
                "logprobs": s.logprobs,
                "policy_versions": s.policy_versions,
                "trainer_step": recorded.step if recorded else None,
                "trainer_logprobs": recorded.logprobs if recorded else None,
                "importance_weights": recorded.importance_weights if recorded else None,
            }
        )
    pieces: dict[int, str] = {}
    if model_dir is not None and samples:
        pieces = decode_pieces(model_dir, [t for s in samples for t in s.input_ids])
    return {
        "decoded": bool(pieces),
        "model": str(model_dir) if model_dir else None,
        "pieces": {str(k): v for k, v in pieces.items()},
        "samples": out,
    }
