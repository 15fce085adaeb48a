"""The built-in engine's sampler (`transformers_engine.py`): each row's next token from the last
position's logits, and whether that token ends the row's completion.

Seeded requests sample with their own torch.Generator, so their draws do not depend on batch mates.
Batched float arithmetic can still differ from a solo run in the last bits of the logits; a sample
whose uniform draw lands within that distance of a boundary could flip, which in practice is never.
"""

from __future__ import annotations

from typing import Any

import torch

from openforgerl.engines.base import FinishReason
from openforgerl.engines.transformers_batch import Request
from openforgerl.vision import mask_unsampleable


def sample(
    rows: list[Request], logits: torch.Tensor, unsampleable: torch.Tensor
) -> tuple[list[int], list[float]]:
    """Sample each row's next id; logprobs are under logits / T (raw logits when T == 0).
    `unsampleable`: ids never sampled (a processor's own tokens)."""
    logits = logits.float()
    logits = mask_unsampleable(logits, unsampleable)
    temps = torch.tensor([r.sampling.temperature or 1.0 for r in rows], device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    ids = logp.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if r.sampling.temperature > 0]
    if sampled:
        probs = logp[sampled].exp()
        top_p = torch.tensor([rows[i].sampling.top_p for i in sampled], device=logits.device)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]) & (top_p[:, None] < 1)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        for j, i in enumerate(sampled):
            ids[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    chosen = logp.gather(-1, ids[:, None]).squeeze(-1)
    return ids.tolist(), chosen.tolist()


def end_of(
    row: Request, tok: int, eos_token_ids: frozenset[int], tokenizer: Any
) -> tuple[FinishReason, str | int | None] | None:
    """(finish reason, stop reason) when `tok` ends the row's completion, else None: a stop id (stop
    reason that id), an EOS id (None), a stop string (that string), or the row's token budget."""
    if tok in row.sampling.stop_token_ids:
        return "stop", tok
    if tok in eos_token_ids:
        return "stop", None
    if row.sampling.stop and (stop := _stop_string(row, tokenizer)) is not None:
        return "stop", stop
    if len(row.completion_ids) >= row.max_tokens:
        return "length", None
    return None


def _stop_string(row: Request, tokenizer: Any) -> str | None:
    """The stop string that the newest token completed, if any (earliest in the text wins).

    The whole completion is decoded each step because a token can finish a multi-byte character
    that an earlier decode showed as a replacement character.
    """
    text: str = tokenizer.decode(row.completion_ids, skip_special_tokens=False)
    hits = [(pos, s) for s in row.sampling.stop if s and (pos := text.find(s)) >= 0]
    return min(hits)[1] if hits else None
