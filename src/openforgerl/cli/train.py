"""`openforge train`: RL, embedded or on veRL (defaults: TrainOptions, TrainerConfig, LossConfig)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from openforgerl.cli.options import (
    CLI_HARNESSES,
    backend_choice,
    one_harness,
    sandbox_options,
    tuning_options,
)
from openforgerl.rl.config import (
    PRECISIONS,
    LossConfig,
    TrainerConfig,
    TrainOptions,
    set_setting,
    setting_keys,
)
from openforgerl.rl.headroom import CHECK_TASKS


def _same(value: Any) -> Any:
    return value


# Each option of `openforge train` that sets one of run.json's settings: its path there, and how the
# option's value becomes the setting's. The rest of the settings: --set PATH=VALUE.
_SETTINGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    **{
        name: (name, _same)
        for name in (
            "tasks",
            "skip_tasks",
            "group",
            "batch_tasks",
            "temperature",
            "max_gen_batches",
            "headroom_tasks",
            "headroom_k",
            "curriculum",
            "max_tokens",
            "max_turns",
            "harness",
            "max_steps",
            "on_timeout",
            "concurrency",
            "seed",
            "eval_every",
            "eval_limit",
            "engine",
            "overlap",
            "max_lag",
        )
    },
    "ptx_data": ("ptx_data", lambda v: str(Path(v).resolve()) if v else None),
    **{
        name: (f"trainer.{name}", _same)
        for name in (
            "lr",
            "warmup_steps",
            "mini_batches",
            "ppo_epochs",
            "neg_adv_scale",
            "ptx_coef",
            "ptx_batch",
            "device",
            "precision",
        )
    },
    "micro_batch_tokens": ("trainer.micro_batch_tokens", _same),
    "algo": ("trainer.estimator", _same),
    "keep_zero_variance": ("trainer.drop_zero_variance", lambda v: not v),
    **{
        name: (f"trainer.tuning.{name}", _same)
        for name in ("lora_rank", "lora_alpha", "gradient_checkpointing")
    },
    "loss": ("trainer.loss.loss", _same),
    "kl_coef": ("trainer.loss.kl_coef", _same),
    "clip_low": ("trainer.loss.clip_ratio_low", _same),
    "clip_high": ("trainer.loss.clip_ratio_high", _same),
    "tis": ("trainer.loss.tis", lambda v: None if v == "none" else v),
    "tis_threshold": ("trainer.loss.tis_threshold", _same),
}
# Options whose None means "not given": the default, or on --resume the run's.
_UNSET_IS_NONE = ("steps", "engine", "overlap", "max_lag")
_BACKEND = ("image", "docker_host", "backend_config")
# The settings no option above names: --set is how a command line reaches them.
_SET_ONLY = [
    k for k in setting_keys() if k not in {path for path, _ in _SETTINGS.values()} | {"steps", "trainer.seed"}
]


@click.command("train", context_settings={"ignore_unknown_options": True})
@click.option("--tasks", default=TrainOptions.tasks, show_default=True, help="A suite or task file/dir.")
@click.option(
    "--skip-tasks",
    type=click.IntRange(min=0),
    default=TrainOptions.skip_tasks,
    show_default=True,
    help="Leave out the first N train tasks, e.g. the N an SFT teacher solved (sft --teacher --limit N).",
)
@click.option(
    "--model", "model_dir", default=None, help="Starting model dir (HF format); not needed with --resume."
)
@click.option("--out", default=None, type=click.Path(file_okay=False), help="The run folder.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --out from its last checkpoint, with its settings (run.json); an "
    "option given again, or --set, changes that setting (--steps may extend).",
)
@click.option(
    "--steps", type=int, default=None, help=f"Train until this step.  [default: {TrainOptions.steps}]"
)
@click.option(
    "--group", type=int, default=TrainOptions.group, show_default=True, help="Rollouts per task (G)."
)
@click.option(
    "--batch-tasks", type=int, default=TrainOptions.batch_tasks, show_default=True, help="Tasks per step."
)
@click.option("--lr", type=float, default=TrainerConfig.lr, show_default=True)
@click.option(
    "--warmup-steps",
    type=click.IntRange(min=0),
    default=TrainerConfig.warmup_steps,
    show_default=True,
    help="Linear learning-rate warm-up over the first N optimizer updates (a fresh AdamW's first "
    "steps move every weight by about the lr).",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=TrainerConfig.precision,
    show_default=True,
    help="The trainer's forward passes: fp32, or bf16 autocast over fp32 master weights (a CPU with "
    "AVX512_BF16 doubles its matmul peak; logprobs then differ from the engine's, which --tis corrects).",
)
@click.option(
    "--clip-low", type=float, default=LossConfig.clip_ratio_low, show_default=True, help="PPO clip: 1 - low."
)
@click.option(
    "--clip-high",
    type=float,
    default=LossConfig.clip_ratio_high,
    show_default=True,
    help="PPO clip: 1 + high (DAPO's clip-higher: 0.28); acts with more than one update a step.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0.0, min_open=True),
    default=TrainOptions.temperature,
    show_default=True,
    help="Sampling temperature of the rollouts, and of the trainer's logprobs (one setting).",
)
@click.option(
    "--algo",
    default=TrainerConfig.estimator,
    show_default=True,
    help="veRL advantage estimator (grpo, rloo, ...).",
)
@click.option(
    "--loss", default=LossConfig.loss, show_default=True, help="veRL policy loss (vanilla, gspo, cispo, ...)."
)
@click.option(
    "--kl-coef", type=float, default=LossConfig.kl_coef, show_default=True, help="KL to the starting model."
)
@click.option(
    "--tis",
    type=click.Choice(["token", "sequence", "none"]),
    default=LossConfig.tis or "none",
    show_default=True,
    help="Truncated importance sampling against the behaviour logprobs.",
)
@click.option("--tis-threshold", type=float, default=LossConfig.tis_threshold, show_default=True)
@click.option(
    "--mini-batches",
    type=click.IntRange(min=1),
    default=TrainerConfig.mini_batches,
    show_default=True,
    help="Optimizer updates per pass over a step's samples.",
)
@click.option(
    "--ppo-epochs",
    type=click.IntRange(min=1),
    default=TrainerConfig.ppo_epochs,
    show_default=True,
    help="Passes over a step's samples; with more than one update per step the PPO clip acts.",
)
@click.option(
    "--neg-adv-scale",
    type=click.FloatRange(min=0.0, max=1.0),
    default=TrainerConfig.neg_adv_scale,
    show_default=True,
    help="Multiply negative advantages by this (1: plain GRPO; 0: train on the passed rollouts alone).",
)
@click.option(
    "--ptx-data",
    type=click.Path(exists=True),
    default=None,
    help="SFT data (what `openforge sft --data` reads: JSONL or ATIF) for the SFT-loss term of --ptx-coef.",
)
@click.option(
    "--ptx-coef",
    type=click.FloatRange(min=0.0),
    default=TrainerConfig.ptx_coef,
    show_default=True,
    help="Weight of an SFT loss on --ptx-data added to every update (InstructGPT's PPO-ptx).",
)
@click.option(
    "--ptx-batch",
    type=click.IntRange(min=1),
    default=TrainerConfig.ptx_batch,
    show_default=True,
    help="Demonstrations in each update's SFT-loss term.",
)
@click.option(
    "--max-gen-batches",
    type=click.IntRange(min=1),
    default=TrainOptions.max_gen_batches,
    show_default=True,
    help="Dynamic sampling (DAPO): draw up to N batches of --batch-tasks tasks a step until "
    "--batch-tasks groups have mixed rewards, and train on those alone. 1: off.",
)
@click.option(
    "--check",
    is_flag=True,
    help="Measure the starting policy's headroom (pass@1, pass@k, tasks with mixed outcomes, sampled "
    "NLL) on --headroom-tasks train tasks, write headroom.json to --out, say whether RL has anything "
    "to work with, and train nothing.",
)
@click.option(
    "--headroom-tasks",
    type=click.IntRange(min=0),
    default=TrainOptions.headroom_tasks,
    show_default=True,
    help=f"Measure the headroom on N train tasks before the first step (--check: {CHECK_TASKS} when 0). "
    "0: off.",
)
@click.option(
    "--headroom-k",
    type=click.IntRange(min=1),
    default=TrainOptions.headroom_k,
    show_default=True,
    help="Runs per task of the headroom measurement (its pass@k).",
)
@click.option(
    "--curriculum",
    is_flag=True,
    help="Train only on the tasks the headroom measurement (--headroom-tasks) found with mixed "
    "outcomes (pass rate strictly between 0 and 1), each revisited across steps.",
)
@click.option("--micro-batch-tokens", type=int, default=TrainerConfig.micro_batch_tokens, show_default=True)
@click.option("--keep-zero-variance", is_flag=True, help="Train on groups whose rewards are all equal too.")
@click.option(
    "--max-tokens", type=int, default=TrainOptions.max_tokens, show_default=True, help="Per model call."
)
@click.option(
    "--max-turns", type=int, default=TrainOptions.max_turns, show_default=True, help="ReAct harness turns."
)
@click.option(
    "--harness",
    default=TrainOptions.harness,
    show_default=True,
    callback=one_harness,
    help="react: the tool-calling loop; gui: a browser agent on screenshots (web-basic tasks, a "
    "vision-language model from `openforge model init --vision`); or an agent CLI, every turn "
    f"generated by the policy inside it: {', '.join(CLI_HARNESSES)}.",
)
@click.option(
    "--max-steps",
    type=int,
    default=TrainOptions.max_steps,
    help="GUI harness steps (default: the task's, 15).",
)
@click.option(
    "--on-timeout",
    type=click.Choice(["exclude", "zero"]),
    default=TrainOptions.on_timeout,
    show_default=True,
    help="A rollout stopped by its task's time limit: left out of the policy update and counted "
    "(`timed_out` per step), as the machine's load may be why; or trained on with reward 0. A task "
    "with `timeout_is_failure: true` is always a failure. Held-out evaluations score it 0.",
)
@click.option("--concurrency", type=int, default=TrainOptions.concurrency, show_default=True)
@click.option("--seed", type=int, default=TrainOptions.seed, show_default=True)
@click.option(
    "--eval-every",
    type=int,
    default=TrainOptions.eval_every,
    show_default=True,
    help="Held-out pass@1 every N steps.",
)
@click.option(
    "--eval-limit", type=int, default=TrainOptions.eval_limit, help="Only the first N held-out tasks."
)
@click.option("--device", default=TrainerConfig.device, help="cpu or cuda (default: cuda when available).")
@tuning_options
@click.option(
    "--engine",
    default=None,
    help="builtin (transformers, this process) or vllm:URL: a vLLM server started with "
    "VLLM_SERVER_DEV_MODE=1 that reads the run folder at the same path (it reloads each checkpoint "
    "from disk).  "
    f"[default: {TrainOptions.engine}; --resume may change it]",
)
@click.option(
    "--overlap/--no-overlap",
    default=None,
    help="Run the next step's rollouts while this step trains.  "
    f"[default: {'overlap' if TrainOptions.overlap else 'no-overlap'}; --resume may change it]",
)
@click.option(
    "--max-lag",
    type=click.IntRange(min=0),
    default=None,
    help="Policy versions a trained sample may lag the trainer by; with --overlap, also how many "
    "steps ahead rollouts run.  "
    f"[default: {TrainOptions.max_lag}; --resume may change it]",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="PATH=VALUE",
    help="Any other setting of the run, by its path in run.json (repeatable; an option's setting "
    "too): " + ", ".join(_SET_ONLY) + ". With --resume it changes the run's, as the options above "
    "given again do.",
)
@sandbox_options(
    "verl",
    help_more=" verl: veRL's trainer (Ray, GPUs) with CONFIG and Hydra overrides; the options above "
    "do not apply.",
)
@click.argument("verl_args", nargs=-1, type=click.UNPROCESSED, metavar="[CONFIG [OVERRIDES]...]")
def train_cmd(model_dir: str | None, out: str | None, resume: bool, steps: int | None, **kw: Any) -> None:
    """RL: rollouts through an embedded gateway, a trainer step, new weights to the engine, repeat.

    With --backend docker, every rollout in a container (a task in its own image). With --backend
    verl: `openforge train --backend verl qwen3_grpo data.train_files=... ...` runs
    veRL's main_ppo with a shipped config (or a YAML file) and Hydra overrides.
    """
    verl_args = kw.pop("verl_args")
    backend = kw.pop("backend")
    if backend == "verl":
        from openforgerl.integrations.verl.launch import train_on_verl

        if model_dir or out or resume:
            raise click.UsageError(
                "--model/--out/--resume are for the embedded trainer; with veRL use Hydra overrides "
                "(actor_rollout_ref.model.path=..., trainer.default_local_dir=..., trainer.resume_mode=auto)"
            )
        try:
            raise SystemExit(train_on_verl(verl_args))
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    if verl_args:
        raise click.UsageError(
            f"unexpected arguments {' '.join(verl_args)!r} (CONFIG goes with --backend verl)"
        )
    if out is None:
        raise click.BadParameter("give the run folder", param_hint="--out")
    from openforgerl.rl.loop import train

    check = kw.pop("check")
    if check and resume:
        raise click.UsageError("--check measures a starting model: it does not go with --resume")
    try:
        opts = _options(model_dir, Path(out), resume, steps, backend, kw)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    from openforgerl.engines.base import EngineError
    from openforgerl.harnesses.launch import HarnessNotInstalled

    if check:
        _check(opts)
        return
    try:
        summary = train(opts, resume=resume)
    except (FileExistsError, FileNotFoundError, ValueError, EngineError, HarnessNotInstalled) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"{summary['steps']} steps, policy version {summary['policy_version']}; "
        f"checkpoint {summary['checkpoint']}; metrics {summary['metrics']}"
    )


def _options(
    model_dir: str | None, out: Path, resume: bool, steps: int | None, backend: str, kw: dict[str, Any]
) -> TrainOptions:
    """The run's settings. A fresh run: the defaults, every option above, then --set. With
    --resume: run.json's, then the options given on this command line and --set (each change said)."""
    from openforgerl.rl.loop import load_settings

    ctx = click.get_current_context()
    given = {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }
    values = {**kw, "steps": steps}
    sets = values.pop("settings")
    if resume:
        d = load_settings(out)
        if model_dir is not None and model_dir != d["model"]:
            raise ValueError(f"--model: the run in {out} started from {d['model']}; a resumed run keeps it")
    else:
        if model_dir is None:
            raise click.BadParameter("give the starting model directory", param_hint="--model")
        d = TrainOptions(model=model_dir, out=out).to_json()
    before = copy.deepcopy(d)
    choice = backend_choice(values, backend)  # pops the backend's options
    if not resume or given & {"backend", *_BACKEND}:
        d["backend"] = choice.to_json()
    for name, (key, convert) in [*_SETTINGS.items(), ("steps", ("steps", _same))]:
        value = values[name]
        if (resume and name not in given) or (name in _UNSET_IS_NONE and value is None):
            continue
        _put(d, key, convert(value))
        if name == "seed":
            _put(d, "trainer.seed", value)  # the trainer's seed follows the run's
    for item in sets:
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item}: give PATH=VALUE, e.g. trainer.weight_decay=0.01")
        set_setting(d, key.strip(), text)
    opts = TrainOptions.from_json(d)
    if resume:
        for key, (old, new) in _changes(before, opts.to_json()).items():
            click.echo(f"resumed with {key} = {new!r} (was {old!r})", err=True)
    return opts


def _put(d: dict[str, Any], key: str, value: Any) -> None:
    *path, name = key.split(".")
    for part in path:
        d = d[part]
    d[name] = value


def _changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    out: dict[str, tuple[Any, Any]] = {}
    for key, value in new.items():
        was = old.get(key)
        if isinstance(value, dict) and isinstance(was, dict) and key != "settings":
            out |= _changes(was, value, f"{prefix}{key}.")
        elif was != value and not (isinstance(was, list) and tuple(was) == value):
            out[prefix + key] = (was, value)
    return out


def _check(opts: TrainOptions) -> None:
    """`train --check`: the starting policy's headroom, printed and written to headroom.json."""
    from openforgerl.engines.base import EngineError
    from openforgerl.harnesses.launch import HarnessNotInstalled
    from openforgerl.rl.headroom import HEADROOM_FILE, check

    try:
        h = check(opts)
    except (FileNotFoundError, ValueError, EngineError, HarnessNotInstalled) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(h.table())
    for line in h.verdict:
        click.echo(f"- {line}")
    click.echo(f"written to {opts.out / HEADROOM_FILE}")
