"""`openforge train`: RL, embedded or on veRL. Its options are TrainOptions' settings (rl/config.py:
each declared there once, with its default and help), derived by config_options.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import click

from openforgerl.cli.options import CLI_HARNESSES, backend_choice, one_harness, sandbox_options
from openforgerl.config_options import apply_settings, config_options, given_settings
from openforgerl.rl.config import NOT_SET, TrainOptions, set_setting
from openforgerl.rl.headroom import CHECK_TASKS

_BACKEND = ("backend", "image", "docker_host", "backend_config")


def _harness(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else one_harness(ctx, param, value)


# What the command adds to some settings' options (the rest is the field's own).
_MORE: dict[str, dict[str, Any]] = {
    "harness": {"callback": _harness, "help_more": f" Agent CLIs: {', '.join(CLI_HARNESSES)}."},
    "headroom_tasks": {"help_more": f" With --check: {CHECK_TASKS} when 0."},
}


@click.command("train", context_settings={"ignore_unknown_options": True})
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
    "--check",
    is_flag=True,
    help="Measure the starting policy's headroom (pass@1, pass@k, tasks with mixed outcomes, sampled "
    "NLL) on --headroom-tasks train tasks, write headroom.json to --out, say whether RL has anything "
    "to work with, and train nothing.",
)
@config_options(TrainOptions, skip=NOT_SET, more=_MORE)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="PATH=VALUE",
    help="A setting of the run by its path in run.json, e.g. trainer.loss.clip_ratio_c=2 (repeatable; "
    "each also has its option above). With --resume it changes the run's, as the options given again do.",
)
@sandbox_options(
    "verl",
    help_more=" verl: veRL's trainer (Ray, GPUs) with CONFIG and Hydra overrides; the options above "
    "do not apply.",
)
@click.argument("verl_args", nargs=-1, type=click.UNPROCESSED, metavar="[CONFIG [OVERRIDES]...]")
def train_cmd(model_dir: str | None, out: str | None, resume: bool, **kw: Any) -> None:
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
        opts = _options(model_dir, Path(out), resume, backend, kw)
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
    model_dir: str | None, out: Path, resume: bool, backend: str, kw: dict[str, Any]
) -> TrainOptions:
    """The run's settings. A fresh run: the defaults, the options given, then --set. With --resume:
    run.json's, then the options given on this command line and --set (each change said)."""
    from openforgerl.rl.loop import load_settings

    ctx = click.get_current_context()
    given = given_settings(TrainOptions, kw, skip=NOT_SET)
    if resume:
        d = load_settings(out)
        if model_dir is not None and model_dir != d["model"]:
            raise ValueError(f"--model: the run in {out} started from {d['model']}; a resumed run keeps it")
    else:
        if model_dir is None:
            raise click.BadParameter("give the starting model directory", param_hint="--model")
        d = TrainOptions(model=model_dir, out=out).to_json()
    before = copy.deepcopy(d)
    choice = backend_choice(kw, backend)  # pops the backend's options
    if not resume or any(
        ctx.get_parameter_source(p) is click.core.ParameterSource.COMMANDLINE for p in _BACKEND
    ):
        d["backend"] = choice.to_json()
    apply_settings(d, given)
    for item in kw.pop("settings"):
        key, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item}: give PATH=VALUE, e.g. trainer.weight_decay=0.01")
        set_setting(d, key.strip(), text)
    opts = TrainOptions.from_json(d)
    if resume:
        for key, (old, new) in _changes(before, opts.to_json()).items():
            click.echo(f"resumed with {key} = {new!r} (was {old!r})", err=True)
    return opts


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
