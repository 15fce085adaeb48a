"""The policy under training: a Hugging Face causal LM (or vision-language model), its tokenizer,
AdamW and its learning-rate warm-up, and logprobs on the loss positions of recorded samples
(`Policy`), in micro-batches that fit a token budget (`micro_batches`; leading tokens every row
shares run once: `common_prefix`). The embedded trainer (`trainer.py`) and SFT (`sft.py`) train one.

Current logprobs are recomputed on each sample's own input_ids at `temperature` (1: the engine's
logprob contract), on the loss positions only.

Vision-language models: a sample's `image_digests` are looked up through the policy's image
source (the gateway store's `images_sync`), turned into pixel inputs by the same
`openforgerl.vision.checked_vision_inputs` the engine uses, and fed with the model's 3-D rope positions, so
the recomputed logprobs are those of the prompt the engine saw.

What is trained (`Tuning`): every weight (the default), or LoRA adapters on every linear layer
(`peft`), the base frozen; gradient checkpointing recomputes each decoder layer's activations in the
backward pass (memory for time). A LoRA checkpoint holds the merged weights, which any engine serves,
and the adapter (`adapter/`), which resumes training on the frozen base.
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from openforgerl import vision
from openforgerl.images import Image
from openforgerl.rl import algos
from openforgerl.rl.config import Tuning
from openforgerl.rollouts.trajectory import Sample

# digests -> the images among them that are kept (Store.images_sync); unknown digests are absent.
ImageSource = Callable[[Sequence[str]], dict[str, Image]]

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"  # the warm-up's position (updates taken), when there is a warm-up
STATE_FILE = "trainer_state.json"
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapter (peft's format), beside the merged weights


# Activations one forward/backward keeps for a micro-batch (full fine-tuning, fp32): its token budget
# when none is set. SmolLM2-135M at 8,192 padded tokens peaked at 17.2 GB of RSS (2.3 MB a token,
# the LM head's 49,152-wide logits included) and, beside the engine, was OOM-killed on a 23.5 GB
# machine; one 1,400-token row at a time peaked at 5.6 GB in the same time.
ACTIVATION_BYTES = 4 << 30
AUTO_BUDGET_MAX = 8192


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (oneDNN's bf16 GEMM: AVX512_BF16 or AMX
    on x86, BF16 on Arm); elsewhere torch emulates bf16, far slower than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def auto_micro_batch_tokens(config: Any) -> int:
    """Padded tokens whose activations fit ACTIVATION_BYTES: per token, about 34 hidden-sized and 4
    intermediate-sized fp32 vectors per decoder layer and 6 vocabulary-sized ones at the head
    (logits, their scaling, softmax and gradients), an estimate a little above what was measured."""
    text = getattr(config, "text_config", None) or config
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    floats = text.num_hidden_layers * (34 * hidden + 4 * intermediate) + 6 * text.vocab_size
    return max(256, min(AUTO_BUDGET_MAX, ACTIVATION_BYTES // (4 * floats)))


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
class Collated:
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
) -> Collated:
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
    return Collated(
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
        precision: str = "fp32",
    ) -> None:
        """`adapter_dir`: a saved LoRA adapter to continue training on `model_dir` (the frozen base);
        `warmup_steps`: the rate rises linearly to `lr` over that many updates (`clip_and_step`);
        `precision`: "bf16" runs the forward under bf16 autocast on a CPU too (a GPU always does)."""
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
        # fp32 master weights everywhere; on a GPU (or with precision "bf16") the forward runs under
        # bf16 autocast.
        self.bf16 = precision == "bf16" or self.device.type == "cuda"
        if self.bf16 and self.device.type == "cpu" and not cpu_has_native_bf16():
            # Without AVX512_BF16, AMX or Arm's BF16, oneDNN has no bf16 GEMM and torch falls back to
            # a scalar loop: a 2048^2 bf16 matmul took 67 s against 0.14 s in fp32 on an AVX2 EPYC.
            warnings.warn(
                "precision bf16: this CPU has no native bf16 matmul (AVX512_BF16, AMX or Arm BF16), so "
                "bf16 autocast is emulated and runs hundreds of times slower than fp32; use fp32",
                RuntimeWarning,
                stacklevel=2,
            )
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

    def micro_batches(self, samples: Sequence[Sample], budget: int = 0) -> list[list[int]]:
        """`samples` split into micro-batches within `budget` padded tokens (0: the model's
        `auto_micro_batch_tokens`), a shared prefix counted once."""
        shared = common_prefix(samples) if self._shares_prefix else 0
        budget = budget or auto_micro_batch_tokens(self.model.config)
        return micro_batches([len(s.input_ids) for s in samples], budget, shared)

    @property
    def _shares_prefix(self) -> bool:
        # A vision-language model's M-RoPE positions and pixels go in whole; a checkpointed layer
        # drops the KV cache it is given (transformers), so with checkpointing each row runs whole.
        return self.processor is None and not self.tuning.gradient_checkpointing

    def collate(self, samples: Sequence[Sample]) -> Collated:
        batch = _collate(samples, self.pad_id, self.device, share_prefix=self._shares_prefix)
        if self.processor is not None:
            batch.vision = self._vision(samples, batch)
        elif any(s.image_digests for s in samples):
            raise ValueError("samples with images, but the policy model takes no images")
        return batch

    def _vision(self, samples: Sequence[Sample], batch: Collated) -> dict[str, torch.Tensor]:
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

    def logprobs(self, batch: Collated, model: Any = None, temperature: float | None = None) -> torch.Tensor:
        """(B, P) logprobs of the targets at `temperature` (default: `self.temperature`), with
        gradients enabled."""
        logits = self._logits(batch, model, temperature)
        picked = logits.gather(-1, batch.targets[..., None]).squeeze(-1)
        return picked - logits.logsumexp(-1)

    def logprobs_and_entropy(
        self, batch: Collated, model: Any = None, temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs`, and the (B, P) entropy (nats, detached) of the whole next-token distribution
        at each position, from the same forward pass."""
        logits = self._logits(batch, model, temperature)
        lse = logits.logsumexp(-1)
        picked = logits.gather(-1, batch.targets[..., None]).squeeze(-1)
        return picked - lse, _entropy(logits.detach(), lse.detach())

    def _logits(self, batch: Collated, model: Any, temperature: float | None) -> torch.Tensor:
        """(B, P, V) float32 logits on the loss positions, divided by the temperature, with the
        tokens the engine never samples masked out."""
        model = model or self.model
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)
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
    def sample_logprobs(self, samples: Sequence[Sample], budget: int = 0) -> list[list[float]]:
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
        over micro-batches within `budget` padded tokens (0: the model's), and the real tokens they held; with
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
