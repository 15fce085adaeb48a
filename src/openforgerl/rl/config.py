"""The trainers' and the RL loop's settings (LossConfig, Tuning, TrainerConfig, SFTConfig,
TrainOptions): plain dataclasses in a light module, so the CLI reads their defaults without torch
or veRL. The modules that use them (algos, trainer, sft, loop) re-export them.

Each setting is declared once, here: its default and its option's help (`setting`); `openforge
train`'s options, run.json (`to_json`/`from_json`) and `--set PATH=VALUE` derive from it."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from openforgerl.engines.base import engine_setting
from openforgerl.rollouts.settings import harness_setting, temperature_setting, timeout_multiplier_setting
from openforgerl.sandbox.choice import BackendChoice
from openforgerl.settings import read, setting, settings_of

if TYPE_CHECKING:
    from openforgerl.rollouts.settings import OnFailure, OnTimeout

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]


@dataclass
class LossConfig:
    """The policy-gradient objective. `loss` names a veRL policy loss; `tis` is truncated importance
    sampling against the behaviour (rollout engine) logprobs: "token", "sequence" or None (off);
    `kl_coef` > 0 adds veRL's `kl_penalty(kl_type)` to a frozen reference model as a loss term."""

    loss: str = setting("vanilla", "veRL policy loss (vanilla, gspo, cispo, ...).")
    clip_ratio_low: float = setting(0.2, "PPO clip: 1 - low.", option="--clip-low")
    clip_ratio_high: float = setting(
        0.2,
        "PPO clip: 1 + high (DAPO's clip-higher: 0.28); acts with more than one update a step.",
        option="--clip-high",
    )
    clip_ratio_c: float = setting(3.0, "Dual-clip bound for negative advantages.")
    loss_agg_mode: LossAggMode = setting(
        "token-mean", "How token losses make the loss (veRL's).", choices=get_args(LossAggMode)
    )
    tis: Literal["token", "sequence"] | None = setting(
        "token",
        "Truncated importance sampling against the behaviour logprobs.",
        choices=("token", "sequence"),
    )
    tis_threshold: float = setting(2.0, "Truncation of the importance weights.")
    kl_coef: float = setting(0.0, "KL to the starting model.")
    # veRL's ActorConfig for these: rl/algos.py actor_config
    kl_type: str = setting("low_var_kl", "veRL's KL estimator (with --kl-coef).")

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in get_args(LossAggMode):
            raise ValueError(f"loss_agg_mode must be one of {', '.join(get_args(LossAggMode))}")
        if self.tis not in ("token", "sequence", None):
            raise ValueError(f"tis must be 'token', 'sequence' or None, not {self.tis!r}")


@dataclass(frozen=True)
class Tuning:
    """Which weights train and how activations are kept."""

    lora_rank: int = setting(
        0,
        "Train rank-r LoRA adapters on every linear layer (peft), the base frozen; 0: every weight. "
        "Checkpoints hold the merged model (what engines load) and adapter/.",
        low=0,
    )
    lora_alpha: int | None = setting(None, "LoRA alpha [default: 2 x rank].", low=1)
    gradient_checkpointing: bool = setting(
        False, "Recompute decoder layers' activations in the backward pass: less memory, more time."
    )

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
    """The embedded trainer's settings. Its logprobs' temperature and its seed are the run's
    (TrainOptions.temperature and seed), given to the Trainer beside this config."""

    lr: float = setting(1e-5, "Peak learning rate (AdamW).")
    weight_decay: float = setting(0.0, "AdamW's weight decay.")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's betas (two numbers).")
    max_grad_norm: float = setting(1.0, "Gradient clipping by global norm.")
    micro_batch_tokens: int = setting(
        0,
        "Padded tokens (rows x longest row) per forward/backward pass (0: as many as the model's "
        "size allows in 4 GiB of activations).",
        low=0,
    )
    mini_batches: int = setting(1, "Optimizer updates per pass over a step's samples.", low=1)
    ppo_epochs: int = setting(
        1, "Passes over a step's samples; with more than one update per step the PPO clip acts.", low=1
    )
    estimator: str = setting("grpo", "veRL advantage estimator (grpo, rloo, ...).", option="--algo")
    norm_adv_by_std: bool = setting(True, "GRPO: divide a group's advantages by its reward's std.")
    drop_zero_variance: bool = setting(
        True,
        "Leave out groups whose rewards are all equal (--keep-zero-variance: train on them too).",
        option="--drop-zero-variance/--keep-zero-variance",
    )
    # A near-deterministic student's failed rollouts move far more per token than its passed ones
    # (issue #33: 9-17x), so pushing failures down can outweigh pulling successes up.
    neg_adv_scale: float = setting(
        1.0,
        "Multiply negative advantages by this (1: plain GRPO; 0: train on the passed rollouts alone).",
        low=0.0,
        high=1.0,
    )
    loss: LossConfig = setting(factory=LossConfig)
    # InstructGPT's PPO-ptx: each update also descends ptx_coef x the SFT loss (mean NLL per loss
    # token, at temperature 1) of ptx_batch demonstrations, drawn afresh per update, so RL keeps
    # what SFT taught while it moves the rest. 0: off (the Trainer then needs no demonstrations).
    ptx_coef: float = setting(
        0.0, "Weight of an SFT loss on --ptx-data added to every update (InstructGPT's PPO-ptx).", low=0.0
    )
    ptx_batch: int = setting(16, "Demonstrations in each update's SFT-loss term.", low=1)
    device: str | None = setting(None, "cpu or cuda (default: cuda when available).")
    tuning: Tuning = setting(factory=Tuning)
    # Update k at lr x k / N, counting from 1; the position is saved with the optimizer, so a
    # resume continues it.
    warmup_steps: int = setting(
        0,
        "Linear learning-rate warm-up over the first N optimizer updates (a fresh AdamW's first "
        "steps move every weight by about the lr).",
        low=0,
    )
    # One extra forward pass, no gradients.
    measure_update: bool = setting(
        True,
        "After each step's updates, re-score the trained rollouts with the new weights and report "
        "how their log-likelihood moved (update/... metrics).",
    )
    # The re-scoring is a forward pass over what it re-scores: over every trained rollout it was
    # 23-27% of a SmolLM2 step's trainer time (issue #34); a sample of each sign estimates the same
    # figures for about half of that.
    measure_update_rollouts: int = setting(
        16,
        "With measure_update: re-score at most this many of the step's trained rollouts, half with "
        "positive and half with negative advantages where there are (drawn with the run's seed; 0: all).",
        low=0,
    )
    # The optimizer and the saved checkpoint stay fp32. On a GPU the forward always runs under bf16
    # autocast; on a CPU with AVX512_BF16 "bf16" doubles the matmul peak (benchmarks/rl_throughput.py)
    # at the price of logprobs that differ from a fp32 engine's by ~1e-2 per token, which the
    # importance weights (--tis) correct.
    precision: str = setting(
        "fp32",
        "The trainer's forward passes: fp32, or bf16 autocast over fp32 master weights (a CPU with "
        "AVX512_BF16 or AMX has ~4x the fp32 matmul peak; one without emulates bf16, hundreds of times "
        "slower, and the trainer warns; logprobs then differ from the engine's, which --tis corrects).",
        choices=PRECISIONS,
    )

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
    """`openforge sft`'s settings: its options derive from these fields (config_options.py)."""

    lr: float = setting(
        1e-5, "Peak learning rate (AdamW); a model trained from scratch: 1e-3.", low=0, low_open=True
    )
    weight_decay: float = setting(0.0, "AdamW's weight decay.", low=0)
    epochs: int = setting(3, "Passes over the data.", low=1)
    batch_size: int = setting(16, "Sequences per optimizer step.", low=1)
    micro_batch_tokens: int = setting(
        0,
        "Padded tokens per forward/backward pass (0: as many as the model's size allows in 4 GiB "
        "of activations).",
        low=0,
    )
    max_grad_norm: float = setting(1.0, "Gradient clipping by global norm.", low=0, low_open=True)
    seed: int = setting(0, "Shuffling and initialisation seed.")
    device: str | None = setting(None, "cpu or cuda (default: cuda when available).")
    # A model trained from scratch needs the warm-up to learn attention across a long harness
    # prompt at a useful peak rate.
    schedule: str = setting(
        "constant", "Learning-rate decay after the warm-up.", choices=("constant", "cosine")
    )
    warmup_steps: int = setting(0, "Linear warm-up steps.", low=0)
    eval_every: int = setting(0, "Steps between validation losses (0: before and after only).", low=0)
    tuning: Tuning = setting(factory=Tuning)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SFTConfig:
        """The config of saved (or given) settings, nested `tuning` as a mapping."""
        d = dict(d)
        d["tuning"] = Tuning.coerce(d.get("tuning"))
        return cls(**d)


@dataclass
class TrainOptions:
    """`openforge train`'s settings (run.json): the run's, with the trainer's nested."""

    model: str  # the starting model directory (HF format)
    out: Path  # the run folder
    tasks: str = setting("tools-tiny", "A suite or task file/dir.")
    split: str = setting("train", "The tasks' split RL draws from.")
    skip_tasks: int = setting(
        0,
        "Leave out the first N train tasks, e.g. the N an SFT teacher solved (sft --teacher --limit N).",
        low=0,
    )
    harness: str = harness_setting()
    steps: int = setting(10, "Train until this step.", low=0)
    group: int = setting(4, "Rollouts per task (G).", low=1)
    batch_tasks: int = setting(4, "Tasks per step.", low=1)
    max_tokens: int = setting(128, "Per model call.", low=1)
    max_turns: int = setting(8, "ReAct harness turns.", low=1)
    max_steps: int | None = setting(None, "GUI harness steps (default: the task's, 15).", low=1)
    max_context: int | None = setting(
        None, "Prompt + completion tokens (default: the model's own context length).", low=1
    )
    concurrency: int = setting(8, "Rollouts in flight.", low=1)
    # One setting for both, since importance weights need the distribution the rollouts sampled
    # from: rl/loop.py hands it to the gateway and to the Trainer.
    temperature: float = temperature_setting(1.0, "the rollouts, and of the trainer's logprobs (one setting)")
    on_failure: OnFailure = setting(
        "zero",
        "Score of a rollout whose harness crashed (or timed out, with --on-timeout zero).",
        choices=("zero", "drop", "verify"),
    )
    # On a loaded machine the wall clock penalises load, not the policy.
    on_timeout: OnTimeout = setting(
        "exclude",
        "A rollout stopped by its task's time limit: left out of the policy update and counted "
        "(`timed_out` per step), as the machine's load may be why; or trained on with reward 0. A task "
        "with `timeout_is_failure: true` is always a failure. Held-out evaluations score it 0.",
        choices=("exclude", "zero"),
    )
    timeout_multiplier: float = timeout_multiplier_setting()
    seed: int = setting(0, "The run's seed: the tasks each step draws, the trainer's.")
    eval_every: int = setting(0, "Held-out pass@1 every N steps (greedy, one run per task; 0: never).", low=0)
    eval_split: str = setting("heldout", "The held-out evaluation's split.")
    eval_limit: int | None = setting(None, "Only the first N held-out tasks.", low=1)
    keep_checkpoints: int = setting(2, "Checkpoints kept (the newest).", low=1)
    progress: bool = setting(True, "Progress bars.")
    overlap: bool = setting(False, "Run the next step's rollouts while this step trains.")
    max_lag: int = setting(
        1,
        "Policy versions a trained sample may lag the trainer by; with --overlap, also how many "
        "steps ahead rollouts run.",
        low=0,
    )
    engine: str = engine_setting(
        "; a vllm:URL server must be started with VLLM_SERVER_DEV_MODE=1 and read the run folder at the "
        "same path (it reloads each checkpoint from disk)"
    )
    ptx_data: str | None = setting(
        None,
        "SFT data (what `openforge sft --data` reads: JSONL or ATIF) for the SFT-loss term of --ptx-coef.",
        path=True,
    )
    # veRL's filter_groups, max_num_gen_batches. 1: every group goes to the trainer (which drops
    # the equal-reward ones).
    max_gen_batches: int = setting(
        1,
        "Dynamic sampling (DAPO): draw up to N batches of --batch-tasks tasks a step until "
        "--batch-tasks groups have mixed rewards, and train on those alone. 1: off.",
        low=1,
    )
    # rl/headroom.py: what the starting policy leaves RL to learn (headroom.json).
    headroom_tasks: int = setting(
        0, "Measure the headroom on N train tasks before the first step of a fresh run. 0: off.", low=0
    )
    headroom_k: int = setting(8, "Runs per task of the headroom measurement (its pass@k).", low=1)
    # The groups with a signal, so each is revisited across steps.
    curriculum: bool = setting(
        False,
        "Train only on the tasks the headroom measurement (--headroom-tasks) found with mixed "
        "outcomes (pass rate strictly between 0 and 1), each revisited across steps.",
    )
    backend: BackendChoice = setting(factory=BackendChoice)  # where the rollouts' sandboxes run
    trainer: TrainerConfig = setting(factory=TrainerConfig)

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


# The trainer's settings that are the run's (older run.json files hold them twice, in `trainer`).
THE_RUNS = ("temperature", "seed")


def run_settings(d: dict[str, Any]) -> dict[str, Any]:
    """A copy of run.json's settings with every value once: `trainer.temperature` and
    `trainer.seed` (run.json written before they were the run's alone) go. A temperature other than
    the run's is refused (the trainer's logprobs must be of the rollouts' distribution: the run
    never had one); another seed is replaced by the run's, and said."""
    d = {**d, "trainer": dict(d.get("trainer", {}))}
    temperature = d["trainer"].pop("temperature", None)
    run_t = d.get("temperature", TrainOptions.temperature)
    if temperature is not None and temperature != run_t:
        raise ValueError(
            f"run.json: trainer.temperature {temperature:g} is not the run's temperature {run_t:g}; the "
            "trainer's logprobs take the rollouts' temperature: remove trainer.temperature and set "
            "temperature alone (--temperature)"
        )
    seed = d["trainer"].pop("seed", None)
    run_seed = d.get("seed", TrainOptions.seed)
    if seed is not None and seed != run_seed:
        warnings.warn(
            f"run.json: trainer.seed {seed} is not the run's seed {run_seed}; the trainer now takes "
            f"the run's seed ({run_seed}): set seed alone (--seed)",
            stacklevel=2,
        )
    return d


# Settings that `set_setting` does not change: named by their own options, or the run's.
NOT_SET = {
    "model": "--model",
    "out": "--out",
    "backend": "--backend, --image, --docker-host, --backend-config",
    **{f"trainer.{name}": f"{name} (--{name}): the trainer's is the run's" for name in THE_RUNS},
}


def setting_keys() -> list[str]:
    """Every setting `set_setting` takes (each also has its option), by its dotted path in run.json."""
    return [s.key for s in settings_of(TrainOptions, skip=NOT_SET)]


def set_setting(d: dict[str, Any], key: str, text: str) -> None:
    """Set the setting at dotted `key` (`trainer.loss.clip_ratio_c`) of run.json's `d` from `text`,
    read as its field's type (a number, true/false, none where the field may be None, a JSON list
    for a tuple). The TrainOptions made from `d` checks the value further."""
    if key in NOT_SET or key.split(".")[0] in NOT_SET:
        raise ValueError(f"{key} is not set this way: use {NOT_SET.get(key) or NOT_SET[key.split('.')[0]]}")
    found = {s.key: s for s in settings_of(TrainOptions, skip=NOT_SET)}
    if key not in found:
        raise ValueError(f"{key} is no setting of a run; the settings: {', '.join(found)}")
    *path, name = key.split(".")
    for part in path:
        d = d.setdefault(part, {})
    d[name] = read(found[key].kind, text, key)
