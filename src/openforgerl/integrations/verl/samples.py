"""A merged training sample as veRL's (prompt, response) pair, within veRL's length limits.

veRL splits every sequence into a prompt and a response. Ours: the prompt is every token before
the first sampled token; the response is the rest, with `response_mask` 1 exactly on sampled
tokens and 0 on what the harness and tools added between turns, and `response_logprobs` the
behaviour logprobs there (0.0 where the mask is 0). Over the limits (`rollout.prompt_length`,
`rollout.response_length`) a sample is cut, never refused: the prompt loses its oldest tokens
(as veRL's own loops do), the response its last ones, and the sample says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from openforgerl.rollouts.trajectory import Sample


@dataclass(frozen=True, slots=True)
class VerlSequence:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    prompt_truncated: int = 0  # tokens dropped from the start of the prompt
    response_truncated: int = 0  # tokens dropped from the end of the response

    @property
    def truncated(self) -> bool:
        return bool(self.prompt_truncated or self.response_truncated)


def split_sample(sample: Sample, prompt_length: int, response_length: int) -> VerlSequence | None:
    """The sample as veRL's prompt/response, or None when it holds no sampled token."""
    if prompt_length < 1 or response_length < 1:
        raise ValueError(f"lengths must be positive: prompt {prompt_length}, response {response_length}")
    try:
        first = sample.loss_mask.index(1)
    except ValueError:
        return None
    prompt = sample.input_ids[:first]
    response = sample.input_ids[first:]
    mask = sample.loss_mask[first:]
    logprobs = sample.logprobs[first:]
    cut_prompt = max(0, len(prompt) - prompt_length)
    prompt = prompt[cut_prompt:]
    keep = min(len(response), response_length)
    # A cut response ends on its last sampled token: trailing tool output has no loss and no reward use.
    while keep > 0 and mask[keep - 1] == 0:
        keep -= 1
    return VerlSequence(
        prompt_ids=list(prompt),
        response_ids=list(response[:keep]),
        response_mask=list(mask[:keep]),
        response_logprobs=[float(x) for x in logprobs[:keep]],
        prompt_truncated=cut_prompt,
        response_truncated=len(response) - keep,
    )
