"""The embedded trainer: any Hugging Face causal LM, on the CPU or one GPU, trained on recorded samples.

One training step takes the rollouts of a batch of tasks (G per task: a group), drops groups whose
rewards are all equal (they carry no signal for group-relative estimators) and counts them, gives
every kept rollout an advantage with veRL's estimator, and runs `ppo_epochs` passes of
`mini_batches` AdamW updates over its samples, each accumulated over micro-batches that fit a token
budget, with gradient clipping (the rate warmed up linearly over the first `warmup_steps` updates).
Losses and importance weights come from veRL (`openforgerl.rl.algos`).

Besides veRL's metrics, a step reports the policy's entropy on the trained tokens (from the same
forward pass), the rollout policy's (`sampled_nll`, from the engine's logprobs of every scored
rollout), the PPO ratio when there is more than one update, and with `measure_update`, how the
update moved each trained rollout's log-likelihood (`update/...`: up for positive advantages, down
for negative ones, re-scored with the new weights).

Current logprobs are recomputed on each sample's own input_ids at `temperature` (1: the engine's
logprob contract), on the loss positions only. The behaviour logprobs recorded by the gateway are
the rollout policy; pi_old is the trainer's policy at the start of the step (with one update per
step it equals the current policy, so it is taken from the same forward pass, detached). Only with
more than one update does the PPO clip act: it bounds how far the later updates move from pi_old.

Vision-language models: a sample's `image_digests` are looked up through the policy's image
source (the gateway store's `images_sync`), turned into pixel inputs by the same
`openforgerl.vision.checked_vision_inputs` the engine uses, and fed with the model's 3-D rope positions, so
the recomputed logprobs are those of the prompt the engine saw.

What is trained (`Tuning`): every weight (the default), or LoRA adapters on every linear layer
(`peft`), the base frozen; gradient checkpointing recomputes each decoder layer's activations in the
backward pass (memory for time). A LoRA checkpoint holds the merged weights, which any engine serves,
and the adapter (`adapter/`), which resumes training on the frozen base.

After a step, `save` writes an HF checkpoint (model, tokenizer, optimizer, trainer state) and
`push_weights` loads it into the engine in place, which bumps the policy version the gateway
records on every later call.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from openforgerl import vision
from openforgerl.engines.base import Engine
from openforgerl.images import Image
from openforgerl.rl import algos
from openforgerl.rl.config import TrainerConfig as TrainerConfig
from openforgerl.rl.config import Tuning as Tuning
from openforgerl.rollouts.trajectory import Sample

# digests -> the images among them that are kept (Store.images_sync); unknown digests are absent.
ImageSource = Callable[[Sequence[str]], dict[str, Image]]

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"  # the warm-up's position (updates taken), when there is a warm-up
STATE_FILE = "trainer_state.json"
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapter (peft's format), beside the merged weights


@dataclass
class Rollout:
    """One rollout's samples and reward (None: not scored); `group` is its task."""

    group: str
    reward: float | None
    samples: list[Sample]


def passed(reward: float) -> bool:
    return reward >= 1.0 - 1e-9


def select_groups(
    rollouts: Sequence[Rollout], drop_zero_variance: bool = True
) -> tuple[list[Rollout], dict[str, Any]]:
    """The rollouts worth training on, and counts of what was left out and why."""
    by_group: dict[str, list[Rollout]] = defaultdict(list)
    unscored = 0
    for r in rollouts:
        if r.reward is None:
            unscored += 1
        else:
            by_group[r.group].append(r)
    kept: list[Rollout] = []
    zero_variance = single = 0
    for members in by_group.values():
        if len(members) < 2:
            single += 1  # no group baseline without a second rollout
        elif drop_zero_variance and len({m.reward for m in members}) == 1:
            zero_variance += 1
        else:
            kept.extend(members)
    scored = [r.reward for r in rollouts if r.reward is not None]
    stats = {
        "rollouts": len(rollouts),
        "rollouts_unscored": unscored,
        "groups": len(by_group),
        "groups_kept": len(by_group) - zero_variance - single,
        "groups_dropped_zero_variance": zero_variance,
        "groups_dropped_single": single,
        "reward_mean": sum(scored) / len(scored) if scored else 0.0,
        "pass_rate": sum(passed(x) for x in scored) / len(scored) if scored else 0.0,
    }
    return kept, stats


def sampled_nll(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """`sampled_nll`: the mean negative behaviour logprob (the engine's) per loss token over every
    scored rollout, trained or not: an estimate of the rollout policy's entropy. Empty without tokens."""
    total = tokens = 0.0
    for r in rollouts:
        if r.reward is None:
            continue
        for s in r.samples:
            for m, lp in zip(s.loss_mask, s.logprobs, strict=False):
                if m:
                    total -= lp
                    tokens += 1
    return {"sampled_nll": total / tokens} if tokens else {}


def _ratio_stats(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean (over loss tokens), max and min of the PPO ratio pi / pi_old."""
    on = mask > 0
    if not bool(on.any()):
        return {}
    ratio = log_ratio[on].exp()
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "ratio_min": float(ratio.min()),
    }


def micro_batches(lengths: Sequence[int], budget: int, shared: int = 0) -> list[list[int]]:
    """Indices grouped so that each micro-batch's padded tokens stay within `budget` (a longer row
    goes alone): rows x longest row, or, when every row opens with the same `shared` tokens that run
    once, shared + rows x (longest row - shared).

    Rows are taken longest first, so each micro-batch pads little.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and shared + (len(out[-1]) + 1) * (lengths[out[-1][0]] - shared) <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def common_prefix(samples: Sequence[Sample]) -> int:
    """How many leading tokens all samples share, short of the first loss position and of every
    sample's last token (each row keeps a suffix to run); 0 when that is too short to be worth
    running once."""
    with_loss = [s for s in samples if 1 in s.loss_mask]
    if len(samples) < 2 or not with_loss:
        return 0
    first = samples[0].input_ids
    n = min(len(s.input_ids) - 1 for s in samples)
    n = min(n, *(s.loss_mask.index(1) - 1 for s in with_loss))
    for s in samples:
        n = next((k for k in range(n) if s.input_ids[k] != first[k]), n)
    return n if n >= SHARED_PREFIX_MIN else 0


@dataclass
class _Collated:
    """A micro-batch on the loss positions only: (B, P) tensors, P = positions any row trains on."""

    ids: torch.Tensor  # (B, L)
    attention: torch.Tensor  # (B, L)
    positions: torch.Tensor  # (P,) logits at these positions predict the token after them
    targets: torch.Tensor  # (B, P)
    mask: torch.Tensor  # (B, P) float
    behaviour: torch.Tensor  # (B, P)
    advantages: torch.Tensor  # (B, P)
    real_tokens: int
    # Leading tokens every row shares (the harness's system prompt, a group's task): the forward pass
    # runs them once and the rows continue from their KV cache. 0: each row runs whole.
    shared: int = 0
    # Vision-language models: position_ids (3, B, L), and pixel_values + image_grid_thw of the rows'
    # images in row order when any row has images; empty for text models.
    vision: dict[str, torch.Tensor] = field(default_factory=dict)


def _collate(
    samples: Sequence[Sample], pad_id: int, device: torch.device, share_prefix: bool = True
) -> _Collated:
    width = max(len(s.input_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    # Shifted by one: column t is the prediction of token t + 1 from the logits at t.
    mask = torch.zeros((n, width - 1))
    behaviour = torch.zeros((n, width - 1))
    for row, s in enumerate(samples):
        k = len(s.input_ids)
        ids[row, :k] = torch.tensor(s.input_ids)
        attention[row, :k] = 1
        mask[row, : k - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        behaviour[row, : k - 1] = torch.tensor(s.logprobs[1:])
    positions = mask.any(0).nonzero().squeeze(-1)
    shared = common_prefix(samples) if share_prefix else 0
    advantages = torch.tensor([s.advantage or 0.0 for s in samples])[:, None].expand(n, len(positions))
    return _Collated(
        ids=ids.to(device),
        attention=attention.to(device),
        positions=positions.to(device),
        targets=ids[:, positions + 1].to(device),
        mask=mask[:, positions].to(device),
        behaviour=behaviour[:, positions].to(device),
        advantages=advantages.contiguous().to(device),
        real_tokens=int(attention.sum()),
        shared=shared,
    )


SHARED_PREFIX_MIN = 32  # below this, running the prefix apart saves less than it costs
_ENTROPY_CHUNK = 1 << 24  # logits per chunk of the entropy's temporaries (64 MiB in float32)


@torch.no_grad()
def _entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last axis, given its logsumexp: lse - E_p[logits],
    taken over chunks of rows so that the temporaries stay small beside the logits."""
    flat, norm = logits.reshape(-1, logits.shape[-1]), lse.reshape(-1)
    out = torch.empty_like(norm)
    rows = max(1, _ENTROPY_CHUNK // max(flat.shape[-1], 1))
    for k in range(0, flat.shape[0], rows):
        chunk = flat[k : k + rows]
        p = (chunk - norm[k : k + rows, None]).exp_()
        out[k : k + rows] = norm[k : k + rows] - (p * chunk).sum(-1)
    return out.reshape(lse.shape)


def _with_lora(model: Any, tuning: Tuning, adapter_dir: str | Path | None) -> Any:
    """`model` frozen under LoRA adapters on every linear layer but the LM head (peft): new ones
    (B = 0, so the function is unchanged), or those saved in `adapter_dir`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    config = LoraConfig(
        r=tuning.lora_rank,
        lora_alpha=tuning.lora_alpha if tuning.lora_alpha is not None else 2 * tuning.lora_rank,
        lora_dropout=0.0,  # dropout would make recomputed logprobs differ from the engine's
        target_modules="all-linear",
        bias="none",
    )
    return get_peft_model(model, config)


class Policy:
    """A causal LM under training: model, tokenizer, AdamW, and logprobs on loss positions.

    `image_source` fetches the images of samples that have any (vision-language models only)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        temperature: float = 1.0,
        device: str | None = None,
        seed: int = 0,
        image_source: ImageSource | None = None,
        tuning: Tuning | None = None,
        adapter_dir: str | Path | None = None,
        warmup_steps: int = 0,
    ) -> None:
        """`adapter_dir`: a saved LoRA adapter to continue training on `model_dir` (the frozen base);
        `warmup_steps`: the rate rises linearly to `lr` over that many updates (`clip_and_step`)."""
        from transformers import AutoTokenizer

        self.tuning = tuning or Tuning()
        if adapter_dir is not None and not self.tuning.lora:
            raise ValueError("an adapter to resume needs LoRA tuning (lora_rank > 0)")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(seed)
        self.processor = vision.load_processor(model_dir) if vision.is_vision_model(model_dir) else None
        self.image_source = image_source
        self.tokenizer: Any = (
            self.processor.tokenizer if self.processor else AutoTokenizer.from_pretrained(model_dir)
        )
        # fp32 master weights everywhere; on a GPU the forward runs under bf16 autocast.
        self.model: Any = vision.load_model(model_dir).to(self.device)
        base = self.model
        if self.tuning.gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.tuning.lora:
            self.model = _with_lora(base, self.tuning, adapter_dir)
        # Eval mode while training too: dropout would make the recomputed logprobs differ from the
        # engine's for the same weights, which the importance weights would read as off-policy.
        self.model.eval()
        if self.tuning.gradient_checkpointing:
            # transformers checkpoints a decoder layer only when that layer is in training mode; the
            # flag is set on those layers alone, so dropout below them stays off.
            for module in base.modules():
                if getattr(module, "gradient_checkpointing", False):
                    module.training = True
        self.temperature = temperature
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters only
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
        )
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if warmup_steps > 0:
            # Update k (from 0) runs at lr x (k + 1) / warmup_steps: the first one already moves.
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda k: min(1.0, (k + 1) / warmup_steps)
            )
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self._keeps_logits = "logits_to_keep" in inspect.signature(base.forward).parameters
        self._unsampleable = torch.tensor(vision.unsampleable_token_ids(self.model), dtype=torch.long)

    def micro_batches(self, samples: Sequence[Sample], budget: int) -> list[list[int]]:
        """`samples` split into micro-batches within `budget` padded tokens, a shared prefix counted once."""
        shared = common_prefix(samples) if self._shares_prefix else 0
        return micro_batches([len(s.input_ids) for s in samples], budget, shared)

    @property
    def _shares_prefix(self) -> bool:
        # A vision-language model's M-RoPE positions and pixels go in whole; a checkpointed layer
        # drops the KV cache it is given (transformers), so with checkpointing each row runs whole.
        return self.processor is None and not self.tuning.gradient_checkpointing

    def collate(self, samples: Sequence[Sample]) -> _Collated:
        batch = _collate(samples, self.pad_id, self.device, share_prefix=self._shares_prefix)
        if self.processor is not None:
            batch.vision = self._vision(samples, batch)
        elif any(s.image_digests for s in samples):
            raise ValueError("samples with images, but the policy model takes no images")
        return batch

    def _vision(self, samples: Sequence[Sample], batch: _Collated) -> dict[str, torch.Tensor]:
        """Pixel inputs (as the engine computed them) and M-RoPE positions of a micro-batch."""
        assert self.processor is not None
        wanted = list(dict.fromkeys(d for s in samples for d in s.image_digests))
        found: dict[str, Image] = {}
        if wanted:
            if self.image_source is None:
                raise ValueError("samples with images, but the policy has no image source")
            found = self.image_source(wanted)
            missing = [d for d in wanted if d not in found]
            if missing:
                raise ValueError(
                    f"{len(missing)} images of the samples are not in the image source: {missing[:3]}"
                )
        parts = []
        for s in samples:
            inputs = vision.checked_vision_inputs(
                self.processor, s.input_ids, [found[d] for d in s.image_digests]
            )
            if inputs is not None:
                parts.append(inputs)
        out = {}
        if parts:
            out = {
                k: torch.cat([p[k] for p in parts]).to(self.device)
                for k in ("pixel_values", "image_grid_thw")
            }
        position_ids, _ = vision.rope_positions(
            self.model, batch.ids, batch.attention, out.get("image_grid_thw"), self.processor.image_token_id
        )
        out["position_ids"] = position_ids
        return out

    def logprobs(self, batch: _Collated, model: Any = None, temperature: float | None = None) -> torch.Tensor:
        """(B, P) logprobs of the targets at `temperature` (default: `self.temperature`), with
        gradients enabled."""
        logits = self._logits(batch, model, temperature)
        picked = logits.gather(-1, batch.targets[..., None]).squeeze(-1)
        return picked - logits.logsumexp(-1)

    def logprobs_and_entropy(
        self, batch: _Collated, model: Any = None, temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs`, and the (B, P) entropy (nats, detached) of the whole next-token distribution
        at each position, from the same forward pass."""
        logits = self._logits(batch, model, temperature)
        lse = logits.logsumexp(-1)
        picked = logits.gather(-1, batch.targets[..., None]).squeeze(-1)
        return picked - lse, _entropy(logits.detach(), lse.detach())

    def _logits(self, batch: _Collated, model: Any, temperature: float | None) -> torch.Tensor:
        """(B, P, V) float32 logits on the loss positions, divided by the temperature, with the
        tokens the engine never samples masked out."""
        model = model or self.model
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        skip = batch.shared
        inputs: dict[str, Any] = {"input_ids": batch.ids, "attention_mask": batch.attention, **batch.vision}
        if skip:
            # The shared prefix runs once, its KV cache is repeated for every row (gradients flow back
            # through the repeat), and only the rows' own tokens run per row.
            with autocast:
                cache = model(input_ids=batch.ids[:1, :skip], use_cache=True).past_key_values
            cache.batch_repeat_interleave(batch.ids.shape[0])
            inputs.update(input_ids=batch.ids[:, skip:], past_key_values=cache, use_cache=False)
        with autocast:
            if self._keeps_logits:
                # Only the loss positions go through the LM head: on small models that is half the FLOPs.
                logits = model(**inputs, logits_to_keep=batch.positions - skip).logits
            else:
                logits = model(**inputs).logits[:, batch.positions - skip]
        logits = logits.float() / (self.temperature if temperature is None else temperature)
        return vision.mask_unsampleable(logits, self._unsampleable)  # the engine never samples these

    @torch.no_grad()
    def sample_logprobs(self, samples: Sequence[Sample], budget: int = 8192) -> list[list[float]]:
        """Per sample, the logprob of every token given the ones before it (0.0 for the first token
        and where the loss mask is 0), aligned with input_ids like `Sample.logprobs`."""
        out: list[list[float]] = [[0.0] * len(s.input_ids) for s in samples]
        for chunk in self.micro_batches(samples, budget):
            batch = self.collate([samples[i] for i in chunk])
            lp = self.logprobs(batch)
            for row, i in enumerate(chunk):
                for col, pos in enumerate(batch.positions.tolist()):
                    if batch.mask[row, col]:
                        out[i][pos + 1] = float(lp[row, col])
        return out

    def sft_loss(
        self, samples: Sequence[Sample], budget: int, backward_scale: float | None = None
    ) -> tuple[float, int]:
        """The SFT loss of `samples` (mean negative log-likelihood per loss token, at temperature 1)
        over micro-batches within `budget` padded tokens, and the real tokens they held; with
        `backward_scale`, the gradient of backward_scale x that loss is accumulated as well."""
        total = sum(s.num_loss_tokens for s in samples)
        loss_sum, tokens = 0.0, 0
        for chunk in self.micro_batches(samples, budget):
            batch = self.collate([samples[i] for i in chunk])
            loss = algos.sft_loss(self.logprobs(batch, temperature=1.0), batch.mask, total)
            if backward_scale is not None:
                (backward_scale * loss).backward()
            loss_sum += float(loss.detach())
            tokens += batch.real_tokens
        return loss_sum, tokens

    def clip_and_step(self, max_grad_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return float(norm)

    @property
    def lr(self) -> float:
        """The rate the next update runs at."""
        return float(self.optimizer.param_groups[0]["lr"])

    def save(self, path: Path, state: dict[str, Any]) -> None:
        """An HF checkpoint plus optimizer and trainer state, written aside then renamed into place."""
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_model(tmp)
        if self.tuning.lora:
            self.model.save_pretrained(tmp / ADAPTER_DIR)  # peft writes the adapter alone
        torch.save(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if self.scheduler is not None:
            torch.save(self.scheduler.state_dict(), tmp / SCHEDULER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)

    def save_model(self, path: Path) -> None:
        """A servable model directory: the weights (LoRA merged into a copy) and the tokenizer."""
        if self.tuning.lora:
            merged = copy.deepcopy(self.model).merge_and_unload()
            if self.tuning.gradient_checkpointing:
                merged.gradient_checkpointing_disable()
            merged.save_pretrained(path)
            del merged
        else:
            self.model.save_pretrained(path)
        self.save_processor(path)

    def save_processor(self, path: Path) -> None:
        """The tokenizer (and a VLM's image processor): what makes `path` a servable model directory."""
        self.tokenizer.save_pretrained(path)
        if self.processor is not None:
            self.processor.image_processor.save_pretrained(path)

    def load_optimizer(self, path: Path) -> None:
        """The optimizer state saved in `path`, and the warm-up's position when one was saved (a
        checkpoint saved without a warm-up starts it afresh)."""
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location=self.device))
        if self.scheduler is not None:
            if (path / SCHEDULER_FILE).is_file():
                self.scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE))
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr  # the optimizer's saved rate is that of the run it came from


class _Metrics:
    """Micro-batch metrics folded into one step: sums, extremes, or means weighted by loss tokens."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.extremes: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for k, v in metrics.items():
            if not math.isfinite(v):
                continue
            if k.endswith("_max"):
                self.extremes[k] = max(v, self.extremes.get(k, v))
            elif k.endswith("_min"):
                self.extremes[k] = min(v, self.extremes.get(k, v))
            elif k == "loss" or k.endswith("_loss"):  # each micro-batch holds its share of the mini-batch's
                self.sums[k] += v
            else:
                self.sums[k] += v * weight
                self.weights[k] += weight

    def result(self, updates: int) -> dict[str, float]:
        out = dict(self.extremes)
        for k, v in self.sums.items():
            out[k] = v / self.weights[k] if k in self.weights else v / max(updates, 1)
        return out


class Trainer:
    """RL on groups of rollouts. `step` counts training steps taken (with or without an update),
    `policy_version` the updates: the version of the weights the trainer holds."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        *,
        group_size: int,
        reference_dir: str | Path | None = None,
        image_source: ImageSource | None = None,
        demonstrations: Sequence[Sample] = (),
        adapter_dir: str | Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.demonstrations = [s for s in demonstrations if s.num_loss_tokens]
        if cfg.ptx_coef > 0 and not self.demonstrations:
            raise ValueError("ptx_coef > 0 needs demonstrations (SFT samples) to take the SFT loss on")
        self.policy = Policy(
            model_dir,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=cfg.betas,
            temperature=cfg.temperature,
            device=cfg.device,
            seed=cfg.seed,
            image_source=image_source,
            tuning=cfg.tuning,
            adapter_dir=adapter_dir,
            warmup_steps=cfg.warmup_steps,
        )
        self.actor_config = algos.actor_config(cfg.loss, group_size)
        self.reference: Any = None
        if cfg.loss.kl_coef > 0:
            self.reference = vision.load_model(reference_dir or model_dir)
            self.reference.to(self.policy.device).eval().requires_grad_(False)
        self.step = 0
        self.policy_version = 0

    @classmethod
    def resume(
        cls,
        checkpoint: Path,
        cfg: TrainerConfig,
        *,
        group_size: int,
        reference_dir: str | Path,
        image_source: ImageSource | None = None,
        demonstrations: Sequence[Sample] = (),
    ) -> Trainer:
        """The trainer as `save` left it: weights, optimizer, step and policy version. A LoRA run
        continues its saved adapter on the frozen base, `reference_dir` (the run's starting model)."""
        adapter = checkpoint / ADAPTER_DIR
        lora = cfg.tuning.lora and adapter.is_dir()
        trainer = cls(
            reference_dir if lora else checkpoint,
            cfg,
            adapter_dir=adapter if lora else None,
            group_size=group_size,
            reference_dir=reference_dir,
            image_source=image_source,
            demonstrations=demonstrations,
        )
        trainer.policy.load_optimizer(checkpoint)
        state = json.loads((checkpoint / STATE_FILE).read_text())
        trainer.step, trainer.policy_version = int(state["step"]), int(state["policy_version"])
        return trainer

    def train_step(self, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        """One step on a batch of groups; returns its metrics (`updated` False when nothing was left
        to train on, in which case the weights did not change)."""
        t0 = time.monotonic()
        kept, metrics = select_groups(rollouts, self.cfg.drop_zero_variance)
        advantages = algos.outcome_advantages(
            [float(r.reward or 0.0) for r in kept],
            [r.group for r in kept],
            self.cfg.estimator,
            norm_adv_by_std=self.cfg.norm_adv_by_std,
        )
        samples: list[Sample] = []
        for r, adv in zip(kept, advantages, strict=True):
            for s in r.samples:
                s.advantage = adv
                if s.num_loss_tokens:
                    samples.append(s)
        versions = [v for s in samples if (v := s.min_policy_version) is not None]
        metrics.update(
            samples=len(samples),
            advantage_abs_mean=sum(abs(a) for a in advantages) / len(advantages) if advantages else 0.0,
            staleness_max=self.policy_version - min(versions) if versions else 0,
            groups_zero_variance_fraction=metrics["groups_dropped_zero_variance"] / max(metrics["groups"], 1),
        )
        metrics.update(sampled_nll(rollouts))
        metrics["time/prepare"] = time.monotonic() - t0
        self.step += 1
        metrics["updated"] = bool(samples)
        if samples:
            out, before = self._update(samples)
            metrics.update(out)
            self.policy_version += 1
            if self.cfg.measure_update:
                t1 = time.monotonic()
                metrics.update(self._update_effect(kept, advantages, before))
                metrics["time/measure_update"] = time.monotonic() - t1
        metrics["policy_version"] = self.policy_version
        return metrics

    @torch.no_grad()
    def sequence_logprobs(self, samples: Sequence[Sample]) -> list[float]:
        """Per sample, the summed logprobs of its loss tokens under the current weights, at the
        trainer's temperature (micro-batched like training)."""
        out = [0.0] * len(samples)
        for chunk in self.policy.micro_batches(samples, self.cfg.micro_batch_tokens):
            batch = self.policy.collate([samples[i] for i in chunk])
            sums = (self.policy.logprobs(batch) * batch.mask).sum(-1)
            for row, i in enumerate(chunk):
                out[i] = float(sums[row])
        return out

    def _update_effect(
        self, kept: Sequence[Rollout], advantages: Sequence[float], before: dict[int, float]
    ) -> dict[str, float]:
        """How the step's updates moved each trained rollout's log-likelihood (summed over its loss
        tokens): mean change per rollout and per token for positive and negative advantages, and the
        fraction of rollouts (advantage != 0) that moved the way their advantage says."""
        trained = [
            (r, a) for r, a in zip(kept, advantages, strict=True) if any(s.num_loss_tokens for s in r.samples)
        ]
        samples = [s for r, _ in trained for s in r.samples if s.num_loss_tokens]
        after = dict(zip(map(id, samples), self.sequence_logprobs(samples), strict=True))
        moves: dict[str, list[tuple[float, int]]] = {"pos": [], "neg": []}
        agree = signed = 0
        for r, adv in trained:
            own = [s for s in r.samples if s.num_loss_tokens]
            change = sum(after[id(s)] - before[id(s)] for s in own)
            if adv != 0:
                moves["pos" if adv > 0 else "neg"].append((change, sum(s.num_loss_tokens for s in own)))
                signed += 1
                agree += change * adv > 0
        out: dict[str, float] = {}
        for sign, rows in moves.items():
            if rows:
                out[f"update/logp_change_{sign}"] = sum(c for c, _ in rows) / len(rows)
                out[f"update/logp_change_{sign}_per_token"] = sum(c for c, _ in rows) / sum(
                    n for _, n in rows
                )
        if signed:
            out["update/direction_agreement"] = agree / signed
        return out

    def _update(self, samples: list[Sample]) -> tuple[dict[str, float], dict[int, float]]:
        """The step's optimizer updates on `samples`: their metrics, and each sample's summed
        loss-token logprob before them (keyed by id()), for `_update_effect`."""
        cfg = self.cfg
        rng = random.Random(cfg.seed * 100_003 + self.step)
        n_mini = max(1, min(cfg.mini_batches, len(samples)))
        minis = []
        for _ in range(max(1, cfg.ppo_epochs)):  # each pass reshuffles the samples into mini-batches
            order = list(range(len(samples)))
            rng.shuffle(order)
            minis += [[samples[i] for i in order[k::n_mini]] for k in range(n_mini)]
        old: dict[int, torch.Tensor] = {}
        before: dict[int, float] = {}
        t0 = time.monotonic()
        if len(minis) > 1:  # later updates need pi_old from before the first one
            old = self._old_logprobs(samples)
            for s in samples:
                mask = torch.tensor(s.loss_mask[1:], dtype=torch.float32, device=old[id(s)].device)
                before[id(s)] = float((old[id(s)] * mask).sum())
        t_old = time.monotonic() - t0
        agg = _Metrics()
        grad_norms, lrs = [], []
        ptx_losses: list[float] = []
        tokens = loss_tokens = padded = 0
        t1 = time.monotonic()
        for mini in minis:
            size = algos.MiniBatchSize(
                tokens=sum(s.num_loss_tokens for s in mini),
                sequences=sum(1 for s in mini if s.num_loss_tokens),
            )
            for chunk in self.policy.micro_batches(mini, cfg.micro_batch_tokens):
                rows = [mini[i] for i in chunk]
                batch = self.policy.collate(rows)
                lp, entropy = self.policy.logprobs_and_entropy(batch)
                weight = float(batch.mask.sum())
                extra = {"entropy": float((entropy * batch.mask).sum()) / max(weight, 1.0)}
                if old:
                    old_lp = self._gather_old(old, rows, batch)
                    extra.update(_ratio_stats(lp.detach() - old_lp, batch.mask))
                else:
                    old_lp = lp.detach()
                    for s, total in zip(rows, (old_lp * batch.mask).sum(-1).tolist(), strict=True):
                        before[id(s)] = total
                is_weights, corr = algos.importance_weights(old_lp, batch.behaviour, batch.mask, cfg.loss)
                ref_lp = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref_lp = self.policy.logprobs(batch, self.reference)
                loss, m = algos.policy_loss(
                    lp,
                    old_lp,
                    batch.advantages,
                    batch.mask,
                    self.actor_config,
                    size,
                    is_weights=is_weights,
                    ref_logprobs=ref_lp,
                )
                loss.backward()
                if ref_lp is not None:
                    m["kl_ref"] = float(((lp.detach() - ref_lp) * batch.mask).sum()) / max(weight, 1.0)
                agg.add({**m, **corr, **extra, "loss": float(loss.detach())}, weight)
                tokens += batch.real_tokens
                padded += batch.ids.numel()
                loss_tokens += int(weight)
            if cfg.ptx_coef > 0:
                ptx_losses.append(self._ptx_backward(rng))
            lrs.append(self.policy.lr)
            grad_norms.append(self.policy.clip_and_step(cfg.max_grad_norm))
        t_train = time.monotonic() - t1
        out = agg.result(len(minis))
        out.update(
            {
                # Short names for the dashboards; veRL's own keys stay beside them.
                "clip_fraction": out.get("actor/pg_clipfrac", 0.0),
                "kl_behaviour": out.get("rollout_corr/kl", 0.0),
                "is_weight_mean": out.get("rollout_corr/rollout_is_mean", 1.0),
                "is_weight_min": out.get("rollout_corr/rollout_is_min", 1.0),
                "is_weight_max": out.get("rollout_corr/rollout_is_max", 1.0),
                "grad_norm": sum(grad_norms) / len(grad_norms),
                "lr": sum(lrs) / len(lrs),  # the mean over the step's updates (warm-up)
                "optimizer_steps": len(minis),
                "tokens": tokens,
                "tokens_padded": padded,
                "loss_tokens": loss_tokens,
                "tokens_per_s": tokens / t_train if t_train else 0.0,
                "time/old_logprobs": t_old,
                "time/train": t_train,
            }
        )
        if ptx_losses:
            out["ptx_loss"] = sum(ptx_losses) / len(ptx_losses)
        return out, before

    def _ptx_backward(self, rng: random.Random) -> float:
        """Accumulate ptx_coef x the SFT loss of `ptx_batch` demonstrations; returns the SFT loss."""
        batch_size = min(self.cfg.ptx_batch, len(self.demonstrations))
        demos = rng.sample(self.demonstrations, batch_size)
        return self.policy.sft_loss(demos, self.cfg.micro_batch_tokens, self.cfg.ptx_coef)[0]

    @torch.no_grad()
    def _old_logprobs(self, samples: list[Sample]) -> dict[int, torch.Tensor]:
        """pi_old per sample (keyed by id()), aligned with input_ids[1:]."""
        out: dict[int, torch.Tensor] = {}
        for chunk in self.policy.micro_batches(samples, self.cfg.micro_batch_tokens):
            rows = [samples[i] for i in chunk]
            batch = self.policy.collate(rows)
            lp = self.policy.logprobs(batch)
            for row, s in enumerate(rows):
                full = torch.zeros(len(s.input_ids) - 1, device=lp.device)
                keep = batch.positions < len(s.input_ids) - 1
                full[batch.positions[keep]] = lp[row, keep]
                out[id(s)] = full
        return out

    @staticmethod
    def _gather_old(old: dict[int, torch.Tensor], rows: list[Sample], batch: _Collated) -> torch.Tensor:
        out = torch.zeros_like(batch.mask)
        for row, s in enumerate(rows):
            keep = batch.positions < len(s.input_ids) - 1
            out[row, keep] = old[id(s)][batch.positions[keep]]
        return out

    def state(self, **extra: Any) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "config": dataclasses.asdict(self.cfg),
            **extra,
        }

    def save(self, path: Path, **extra: Any) -> None:
        self.policy.save(path, self.state(**extra))

    async def push_weights(self, engine: Engine, checkpoint: Path) -> int:
        """Load `checkpoint` (from `save`) into the engine in place; returns the engine's new version."""
        return await engine.load_weights(str(checkpoint))


def iter_checkpoints(root: Path) -> Iterator[tuple[int, Path]]:
    """(step, path) of every finished checkpoint under `root` (named step-NNNNNN), oldest first."""
    if not root.is_dir():
        return
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit() and (p / STATE_FILE).is_file():
            found.append((int(p.name[5:]), p))
    yield from sorted(found)


class MetricsLog:
    """metrics.jsonl in the run dir (one JSON object per step, with a `step` key), mirrored to
    TensorBoard when the `tensorboard` package is installed."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: TensorBoard is not a dependency
            pass
        else:
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def steps(self) -> set[int]:
        """Steps already logged (to complete, not repeat, the log after a crash)."""
        if not self.path.is_file():
            return set()
        done = set()
        for line in self.path.read_text().splitlines():
            try:
                done.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash
        return done

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        with self.path.open("ab+") as f:
            torn = False
            if f.seek(0, 2):
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"
            # A line cut short by a crash stays on its own line, so it never spoils this one.
            f.write((b"\n" if torn else b"") + json.dumps({"step": step, **metrics}).encode() + b"\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
