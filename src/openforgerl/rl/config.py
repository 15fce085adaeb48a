"""The trainers' and the RL loop's settings (LossConfig, Tuning, TrainerConfig, SFTConfig,
TrainOptions): plain dataclasses in a light module, so the CLI reads their defaults without torch
or veRL. The modules that use them (algos, trainer, sft, loop) re-export them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from openforgerl.sandbox.choice import BackendChoice

if TYPE_CHECKING:
    from openforgerl.rollouts.runner import OnFailure, OnTimeout

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]


@dataclass
class LossConfig:
    """The policy-gradient objective. `loss` names a veRL policy loss; `tis` is truncated importance
    sampling against the behaviour (rollout engine) logprobs: "token", "sequence" or None (off);
    `kl_coef` > 0 adds veRL's `kl_penalty(kl_type)` to a frozen reference model as a loss term."""

    loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    loss_agg_mode: LossAggMode = "token-mean"
    tis: Literal["token", "sequence"] | None = "token"
    tis_threshold: float = 2.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"  # veRL's ActorConfig for these: rl/algos.py actor_config


@dataclass(frozen=True)
class Tuning:
    """Which weights train and how activations are kept."""

    lora_rank: int = 0  # 0: every weight; r > 0: rank-r LoRA adapters on every linear layer (peft)
    lora_alpha: int | None = None  # LoRA scale numerator (default 2 x rank)
    gradient_checkpointing: bool = False  # recompute decoder layers' activations in the backward pass

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be 0 (off) or positive, not {self.lora_rank}")

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @classmethod
    def coerce(cls, value: Tuning | dict[str, Any] | None) -> Tuning:
        return value if isinstance(value, Tuning) else cls(**(value or {}))


@dataclass
class TrainerConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 8192  # padded tokens (rows x longest row) per forward/backward pass
    mini_batches: int = 1  # optimizer updates per pass over the step's samples (PPO mini-batches)
    ppo_epochs: int = 1  # passes over the step's samples (veRL's ppo_epochs)
    estimator: str = "grpo"
    norm_adv_by_std: bool = True
    drop_zero_variance: bool = True
    loss: LossConfig = field(default_factory=LossConfig)
    temperature: float = 1.0  # the rollouts' sampling temperature (TrainOptions sets it to the run's)
    # InstructGPT's PPO-ptx: each update also descends ptx_coef x the SFT loss (mean NLL per loss
    # token, at temperature 1) of ptx_batch demonstrations, drawn afresh per update, so RL keeps
    # what SFT taught while it moves the rest. 0: off (the Trainer then needs no demonstrations).
    ptx_coef: float = 0.0
    ptx_batch: int = 16
    seed: int = 0
    device: str | None = None  # default: cuda when available, else cpu
    tuning: Tuning = field(default_factory=Tuning)
    # Linear learning-rate warm-up over the first N optimizer updates (update k at lr x k / N,
    # counting from 1), then `lr`; the position is saved with the optimizer, so a resume continues it.
    warmup_steps: int = 0
    # After each step's updates, re-score the trained rollouts with the new weights and report how
    # their log-likelihood moved (`update/...` metrics): one extra forward pass, no gradients.
    measure_update: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainerConfig:
        d = dict(d)
        d["loss"] = LossConfig(**d.get("loss", {}))
        d["tuning"] = Tuning.coerce(d.get("tuning"))
        d["betas"] = tuple(d.get("betas", (0.9, 0.999)))
        return cls(**d)


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
    # The learning-rate schedule over the run (transformers' schedulers): linear warm-up for
    # `warmup_steps`, then "constant" or "cosine" decay. A model trained from scratch needs the
    # warm-up to learn attention across a long harness prompt at a useful peak rate.
    schedule: str = "constant"
    warmup_steps: int = 0
    # Validation (fit's `val` samples): their loss every `eval_every` steps (0: before and after only).
    eval_every: int = 0
    # Every weight, or LoRA adapters (merged into the saved model); gradient checkpointing.
    tuning: Tuning = field(default_factory=Tuning)


@dataclass
class TrainOptions:
    model: str  # the starting model directory (HF format)
    out: Path  # the run folder
    tasks: str = "tools-tiny"
    split: str = "train"
    skip_tasks: int = 0  # leave out the split's first N tasks (e.g. the N an SFT teacher solved)
    harness: str = "react"  # react (tool calls) or gui (a browser on screenshots: web-basic, a VLM policy)
    steps: int = 10
    group: int = 4  # rollouts per task (G)
    batch_tasks: int = 4  # tasks per step
    max_tokens: int = 128  # per model call
    max_turns: int = 8
    max_steps: int | None = None  # the gui harness's step limit (None: the task's, 15 in web-basic)
    max_context: int | None = None  # prompt + completion; None: the model's own context length
    concurrency: int = 8
    temperature: float = 1.0
    on_failure: OnFailure = "zero"  # a harness that crashed (or timed out, with on_timeout "zero")
    # A rollout stopped by the task's wall clock: "exclude" leaves it out of the policy update
    # (counted per step), since on a loaded machine the clock penalises load, not the policy;
    # "zero" trains on it as a failure. A task with `timeout_is_failure` is always a failure.
    on_timeout: OnTimeout = "exclude"
    seed: int = 0
    eval_every: int = 0  # held-out evaluation every N steps (0: never), greedy, one run per task
    eval_split: str = "heldout"
    eval_limit: int | None = None
    keep_checkpoints: int = 2
    progress: bool = True
    overlap: bool = False  # rollouts of the next step(s) run while this one trains
    max_lag: int = 1  # policy versions a trained sample may lag behind the trainer (and prefetch depth)
    engine: str = "builtin"  # builtin, vllm:URL or sglang:URL (see the module docstring)
    # SFT samples (the JSONL `openforge sft` reads) for the trainer's ptx term (trainer.ptx_coef).
    ptx_data: str | None = None
    # DAPO's dynamic sampling (veRL's filter_groups, max_num_gen_batches): above 1, a step draws
    # up to this many batches of batch_tasks tasks, until batch_tasks groups have mixed rewards,
    # and trains on those alone. 1: one batch, every group goes to the trainer (which drops the
    # equal-reward ones).
    max_gen_batches: int = 1
    # Headroom (rl/headroom.py): before the first step of a fresh run, k runs of this many train
    # tasks measure what the starting policy leaves RL to learn (headroom.json). 0: off.
    headroom_tasks: int = 0
    headroom_k: int = 8
    backend: BackendChoice = field(default_factory=BackendChoice)  # where the rollouts' sandboxes run
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        # One sampling temperature for the run: the trainer's logprobs must be of the distribution
        # the rollouts sampled from, or every importance weight is off. The trainer takes the run's;
        # a trainer set apart to another (not its default) is a contradiction, said at once.
        if self.trainer.temperature not in (self.temperature, TrainerConfig.temperature):
            raise ValueError(
                f"the trainer's temperature {self.trainer.temperature:g} is not the rollouts' "
                f"{self.temperature:g}: set the run's temperature alone (--temperature)"
            )
        if self.on_timeout not in ("exclude", "zero"):
            raise ValueError(f"on_timeout must be 'exclude' or 'zero', not {self.on_timeout!r}")
        if self.temperature <= 0:
            raise ValueError(
                f"RL samples its rollouts: the temperature must be above 0, not {self.temperature:g}"
            )
        self.trainer = dataclasses.replace(self.trainer, temperature=self.temperature)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainOptions:
        d = dict(d)
        d["out"] = Path(d["out"])
        d["trainer"] = TrainerConfig.from_dict(d["trainer"])
        d["backend"] = BackendChoice.from_json(d.get("backend"))  # a run from before --backend: local
        return cls(**d)
