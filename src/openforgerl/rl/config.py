"""The trainers' and the RL loop's settings (LossConfig, Tuning, TrainerConfig, SFTConfig,
TrainOptions): plain dataclasses in a light module, so the CLI reads their defaults without torch
or veRL. The modules that use them (algos, trainer, sft, loop) re-export them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

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

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in get_args(LossAggMode):
            raise ValueError(f"loss_agg_mode must be one of {', '.join(get_args(LossAggMode))}")
        if self.tis not in ("token", "sequence", None):
            raise ValueError(f"tis must be 'token', 'sequence' or None, not {self.tis!r}")


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


PRECISIONS = ("fp32", "bf16")


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
    # Negative advantages are multiplied by this (1: plain GRPO; 0: the passing rollouts alone). A
    # near-deterministic student's failed rollouts move far more per token than its passed ones
    # (issue #33: 9-17x), so pushing failures down can outweigh pulling successes up.
    neg_adv_scale: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
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
    # The forward passes' precision: "fp32", or "bf16" autocast over fp32 master weights (the
    # optimizer and the saved checkpoint stay fp32). On a GPU the forward always runs under bf16
    # autocast; on a CPU with AVX512_BF16 "bf16" doubles the matmul peak (benchmarks/rl_throughput.py)
    # at the price of logprobs that differ from a fp32 engine's by ~1e-2 per token, which the
    # importance weights (--tis) correct.
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if not 0.0 <= self.neg_adv_scale <= 1.0:
            raise ValueError(f"neg_adv_scale must be in [0, 1], not {self.neg_adv_scale:g}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")

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
    # The rollouts' sampling temperature, and so the trainer's logprobs' (rl/loop.py hands it to
    # both): one setting, since importance weights need the distribution the rollouts sampled from.
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
    # A curriculum from that measurement: the steps draw only from the measured tasks whose pass rate
    # was strictly between 0 and 1 (the groups with a signal), so each is revisited across steps.
    # Needs headroom_tasks > 0.
    curriculum: bool = False
    backend: BackendChoice = field(default_factory=BackendChoice)  # where the rollouts' sandboxes run
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        if self.curriculum and self.headroom_tasks < 1:
            raise ValueError("curriculum draws from the headroom measurement's tasks: set headroom_tasks")
        if self.on_timeout not in ("exclude", "zero"):
            raise ValueError(f"on_timeout must be 'exclude' or 'zero', not {self.on_timeout!r}")
        if self.temperature <= 0:
            raise ValueError(
                f"RL samples its rollouts: the temperature must be above 0, not {self.temperature:g}"
            )

    def to_json(self) -> dict[str, Any]:
        """run.json: every setting once."""
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainOptions:
        d = run_settings(d)
        d["out"] = Path(d["out"])
        d["trainer"] = TrainerConfig.from_dict(d["trainer"])
        d["backend"] = BackendChoice.from_json(d.get("backend"))  # a run from before --backend: local
        return cls(**d)


def run_settings(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of run.json's settings with every value once: a `trainer.temperature` (run.json
    written before it was left out) must be the run's `temperature`, and goes; another is refused,
    since the trainer's logprobs take the rollouts' temperature."""
    d = {**d, "trainer": dict(d.get("trainer", {}))}
    trainer_t = d["trainer"].pop("temperature", None)
    run_t = d.get("temperature", TrainOptions.temperature)
    if trainer_t is not None and trainer_t != run_t:
        raise ValueError(
            f"run.json: trainer.temperature {trainer_t:g} is not the run's temperature {run_t:g}; the "
            "trainer's logprobs take the rollouts' temperature: remove trainer.temperature and set "
            "temperature alone (--temperature)"
        )
    return d


# Settings that `set_setting` does not change: named by their own options, or derived.
NOT_SET = {
    "model": "--model",
    "out": "--out",
    "backend": "--backend, --image, --docker-host, --backend-config",
    "trainer.temperature": "temperature (--temperature): the trainer's is the run's",
}
_NESTED: dict[str, type] = {"trainer": TrainerConfig, "loss": LossConfig, "tuning": Tuning}


def setting_keys() -> list[str]:
    """Every setting `set_setting` takes, by its dotted path in run.json."""

    def keys(cls: type, prefix: str) -> list[str]:
        out: list[str] = []
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if f.name in _NESTED and f.type == _NESTED[f.name].__name__:
                out += keys(_NESTED[f.name], key + ".")
            elif key not in NOT_SET:
                out.append(key)
        return out

    return keys(TrainOptions, "")


def set_setting(d: dict[str, Any], key: str, text: str) -> None:
    """Set the setting at dotted `key` (`trainer.loss.clip_ratio_c`) of run.json's `d` from `text`,
    read as its field's type (a number, true/false, none where the field may be None, a JSON list
    for a tuple). The TrainOptions made from `d` checks the value further."""
    if key in NOT_SET or key.split(".")[0] in NOT_SET:
        raise ValueError(f"{key} is not set this way: use {NOT_SET.get(key) or NOT_SET[key.split('.')[0]]}")
    if key not in setting_keys():
        raise ValueError(f"{key} is no setting of a run; the settings: {', '.join(setting_keys())}")
    *path, name = key.split(".")
    cls: type = TrainOptions
    for part in path:
        cls = _NESTED[part]
        d = d.setdefault(part, {})
    kind = str(next(f.type for f in dataclasses.fields(cls) if f.name == name))
    d[name] = _read(kind, text, key)


def _read(kind: str, text: str, key: str) -> Any:
    low = text.strip().lower()
    if "None" in kind and low in ("none", "null"):
        return None
    try:
        if kind.startswith("bool"):
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError("true or false")
            return low in ("true", "1", "yes", "on")
        if kind.startswith("tuple"):
            items = json.loads(text)
            if not isinstance(items, list) or not all(isinstance(x, int | float) for x in items):
                raise ValueError("a JSON list of numbers")
            return [float(x) for x in items]
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError as exc:
        raise ValueError(f"{key}={text}: not {kind} ({exc})") from exc
    return text
