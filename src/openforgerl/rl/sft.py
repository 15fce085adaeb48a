"""`openforge sft`: supervised fine-tuning on recorded trajectories, loss on the assistant's tokens only.

Data: JSONL rows that are either samples (`openforge rollout`'s samples.jsonl: `input_ids` and
`loss_mask`, and `image_digests` for a vision-language model's samples) or chat conversations
(`messages`, optional `tools`; text only), which are tokenised with the student's own chat template;
or trajectories made on the spot by a teacher (`oracle_samples`: the tools-tiny oracle played through
the ReAct harness and recorded by the gateway). Samples with images need an image source (the
gateway store's `images_sync`) to give the trainer their pixels.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from openforgerl.rl import algos
from openforgerl.rl.trainer import ImageSource, MetricsLog, Policy, micro_batches, passed
from openforgerl.trajectory import NO_VERSION, Sample, build_samples, calls_from_json


@dataclass
class SFTConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    epochs: int = 1
    batch_size: int = 16  # sequences per optimizer step
    micro_batch_tokens: int = 8192
    max_grad_norm: float = 1.0
    seed: int = 0
    device: str | None = None


def _sample(
    input_ids: list[int], loss_mask: list[int], source: str = "", image_digests: list[str] | None = None
) -> Sample:
    return Sample(
        rollout_id=source,
        reward=0.0,
        branch_id=0,
        branch_reason="",
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=[0.0] * len(input_ids),
        policy_versions=[NO_VERSION] * len(input_ids),
        image_digests=list(image_digests or []),
    )


def chat_sample(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tokenizer: Any) -> Sample:
    """A conversation as one sequence in the tokenizer's chat template; mask 1 on assistant turns.

    Each assistant turn's tokens are what the template adds between the prompt that asks for it
    (add_generation_prompt) and the conversation that includes it, up to and including the end-of-
    turn token: what the model would sample. The template must render a conversation as a prefix of
    its continuation, as ChatML templates do.
    """

    def ids(msgs: list[dict[str, Any]], prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=prompt, tokenize=True, return_dict=False
        )
        return list(out)

    if any(isinstance(m.get("content"), list) and any(_is_image(p) for p in m["content"]) for m in messages):
        raise ValueError("chat rows with images are not supported: record them through the gateway")
    full = ids(messages, False)
    mask = [0] * len(full)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        # `weight: 0` (OpenAI's fine-tuning convention): a turn kept as context, not trained on.
        if m.get("role") != "assistant" or m.get("weight", 1) == 0:
            continue
        prompt, upto = ids(messages[:i], True), ids(messages[: i + 1], False)
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto:
            raise ValueError(
                f"the chat template does not render turn {i} as an extension of the turns before it"
            )
        end = len(upto)
        if eos in upto[len(prompt) :]:
            end = upto.index(eos, len(prompt)) + 1  # what follows the end-of-turn token is not sampled
        mask[len(prompt) : end] = [1] * (end - len(prompt))
    return _sample(full, mask)


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url", "input_image")


def load_sft_data(path: str | Path, tokenizer: Any) -> list[Sample]:
    """Samples from a JSONL file of sample rows or chat rows (the two may be mixed)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "input_ids" in row:
            if len(row["loss_mask"]) != len(row["input_ids"]):
                raise ValueError(f"{path}:{n}: loss_mask and input_ids differ in length")
            out.append(
                _sample(
                    list(row["input_ids"]),
                    list(row["loss_mask"]),
                    row.get("rollout_id", ""),
                    row.get("image_digests"),
                )
            )
        elif "messages" in row:
            out.append(chat_sample(row["messages"], row.get("tools"), tokenizer))
        else:
            raise ValueError(f"{path}:{n}: a row needs input_ids + loss_mask, or messages")
    return [s for s in out if s.num_loss_tokens]


def oracle_samples(
    model_dir: str | Path,
    out: Path,
    *,
    tasks: str = "tools-tiny",
    split: str = "train",
    limit: int | None = None,
    max_turns: int = 8,
    concurrency: int = 8,
    progress: bool = True,
) -> list[Sample]:
    """Teacher trajectories from the ORACLE teacher (tools-tiny): each task run once through the ReAct
    harness with the oracle engine behind the gateway; the rollouts it solved, as merged samples in
    the student's chat template (the gateway renders with `model_dir`'s tokenizer)."""
    from openforgerl.evaluate import EvalOptions, run_rollouts
    from openforgerl.rl.oracle_teacher import OracleTeacherEngine
    from openforgerl.runner import Status
    from openforgerl.tasks import load_tasks

    chosen = load_tasks(tasks, split=split)[:limit]  # type: ignore[arg-type]
    opts = EvalOptions(
        tasks=tasks,
        split=split,
        limit=limit,
        model=str(model_dir),
        out=out,
        concurrency=concurrency,
        max_turns=max_turns,
        progress=progress,
    )
    results, recorded = run_rollouts(opts, OracleTeacherEngine(model_dir, chosen))
    samples = []
    for r in results:
        if r.status == Status.DONE and passed(r.reward or 0.0) and r.gateway_rollout_id in recorded:
            samples += build_samples(calls_from_json(recorded[r.gateway_rollout_id]), 1.0)
    return samples


def write_samples(samples: Sequence[Sample], path: Path) -> None:
    with path.open("w") as f:
        for s in samples:
            row: dict[str, Any] = {
                "input_ids": s.input_ids,
                "loss_mask": s.loss_mask,
                "rollout_id": s.rollout_id,
            }
            if s.image_digests:
                row["image_digests"] = s.image_digests
            f.write(json.dumps(row))
            f.write("\n")


class SFTTrainer:
    def __init__(
        self, model_dir: str | Path, cfg: SFTConfig, image_source: ImageSource | None = None
    ) -> None:
        self.cfg = cfg
        self.policy = Policy(
            model_dir,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            device=cfg.device,
            seed=cfg.seed,
            image_source=image_source,
        )
        self.step = 0

    @torch.no_grad()
    def loss(self, samples: Sequence[Sample]) -> float:
        """Mean negative log-likelihood per loss token (no update)."""
        total = sum(s.num_loss_tokens for s in samples)
        out = 0.0
        for chunk in micro_batches([len(s.input_ids) for s in samples], self.cfg.micro_batch_tokens):
            batch = self.policy.collate([samples[i] for i in chunk])
            out += float(algos.sft_loss(self.policy.logprobs(batch), batch.mask, total))
        return out

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step on `samples` (accumulated over micro-batches)."""
        t0 = time.monotonic()
        total = sum(s.num_loss_tokens for s in samples)
        loss_sum = 0.0
        tokens = 0
        for chunk in micro_batches([len(s.input_ids) for s in samples], self.cfg.micro_batch_tokens):
            batch = self.policy.collate([samples[i] for i in chunk])
            loss = algos.sft_loss(self.policy.logprobs(batch), batch.mask, total)
            loss.backward()
            loss_sum += float(loss.detach())
            tokens += batch.real_tokens
        grad_norm = self.policy.clip_and_step(self.cfg.max_grad_norm)
        self.step += 1
        seconds = time.monotonic() - t0
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": self.cfg.lr,
            "sequences": len(samples),
            "tokens": tokens,
            "loss_tokens": total,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "time/train": seconds,
        }

    def fit(self, samples: Sequence[Sample], out: Path, *, progress: bool = True) -> dict[str, Any]:
        """`epochs` passes over `samples` in shuffled batches; logs to out/metrics.jsonl, saves the
        model and tokenizer (HF format) to `out`."""
        if not samples:
            raise ValueError("no SFT samples with a loss token")
        out.mkdir(parents=True, exist_ok=True)
        log = MetricsLog(out)
        rng = random.Random(self.cfg.seed)
        size = max(1, self.cfg.batch_size)
        first = self.loss(samples)
        t0 = time.monotonic()
        try:
            steps = self.cfg.epochs * -(-len(samples) // size)
            bar = tqdm(total=steps, desc="sft", unit="step", disable=not progress)
            for epoch in range(self.cfg.epochs):
                order = list(samples)
                rng.shuffle(order)
                for i in range(0, len(order), size):
                    metrics = self.train_step(order[i : i + size])
                    log.write(self.step, {"epoch": epoch, **metrics})
                    bar.update(1)
                    bar.set_postfix_str(f"loss {metrics['loss']:.3f}")
            bar.close()
        finally:
            log.close()
        last = self.loss(samples)
        self.policy.model.save_pretrained(out)
        self.policy.save_processor(out)
        return {
            "samples": len(samples),
            "steps": self.step,
            "loss_before": first,
            "loss_after": last,
            "seconds": round(time.monotonic() - t0, 1),
            "model": str(out),
        }
