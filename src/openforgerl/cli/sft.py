"""`openforge sft`: supervised fine-tuning. Its training options are SFTConfig's settings (rl/config.py),
derived by config_options.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from openforgerl.cli.options import CLI_HARNESSES, backend_choice, one_harness, sandbox_options
from openforgerl.config_options import apply_settings, config_options, given_settings
from openforgerl.rl.config import SFTConfig
from openforgerl.run.folder import RunFolder


@click.command("sft")
@click.option(
    "--data",
    type=click.Path(exists=True),
    default=None,
    help="JSONL: samples or chats (export-sft's rows; with images, the student must be a VLM); or ATIF "
    "trajectories: a trajectory.json, or a folder searched for trajectory*.json.",
)
@click.option(
    "--teacher", type=click.Choice(["oracle"]), default=None, help="Make the data with this teacher."
)
@click.option(
    "--tasks",
    default="tools-tiny",
    show_default=True,
    help="The teacher's tasks (train split): tools-tiny, tools-tiny-faults, claw-basic.",
)
@click.option(
    "--harness",
    default="react",
    show_default=True,
    callback=one_harness,
    help="With --teacher: the harness it acts in, through that harness's own tools and format "
    f"(react or an agent CLI: {', '.join(CLI_HARNESSES)}).",
)
@click.option("--limit", type=int, default=None, help="Only the first N tasks (with --teacher).")
@click.option(
    "--show-work/--no-show-work",
    default=True,
    show_default=True,
    help="With --teacher: it notes the values it reads and writes out its computation.",
)
@click.option("--model", "model_dir", required=True, help="The student model dir (HF format).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Where the trained model goes.")
@click.option(
    "--val-data",
    type=click.Path(exists=True),
    default=None,
    help="Data like --data, never trained on: its loss is logged (val_loss) and summarised.",
)
@config_options(SFTConfig)
@sandbox_options(help_more=" With --teacher.")
def sft_cmd(
    data: str | None,
    teacher: str | None,
    tasks: str,
    limit: int | None,
    model_dir: str,
    out: str,
    val_data: str | None,
    show_work: bool,
    harness: str,
    **kw: Any,
) -> None:
    """SFT on recorded trajectories (loss on the assistant's tokens only)."""
    cfg = SFTConfig.from_dict(apply_settings({}, given_settings(SFTConfig, kw)))
    backend = backend_choice(kw)
    from openforgerl.rl.sft import SFTTrainer, load_sft_data, oracle_samples, write_samples
    from openforgerl.rollouts.trajectory import Sample

    if (data is None) == (teacher is None):
        raise click.UsageError("give exactly one of --data FILE.jsonl|ATIF or --teacher oracle")
    out_dir = Path(out)
    if data is not None:
        # Rows are checked (and their images decoded) before the student's weights are loaded.
        try:
            loaded = load_sft_data(data, model_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        trainer = SFTTrainer(model_dir, cfg, image_source=loaded.image_source)
        samples = list(loaded)
    else:
        from openforgerl.harnesses.launch import HarnessNotInstalled
        from openforgerl.rl.oracle_teacher import ORACLE_SUITES

        if tasks not in ORACLE_SUITES:
            known = " and ".join(ORACLE_SUITES)
            raise click.BadParameter(f"the oracle teacher knows {known} only", param_hint="--tasks")
        trainer = SFTTrainer(model_dir, cfg)
        try:
            samples = oracle_samples(
                model_dir,
                RunFolder(out_dir).teacher.path,
                tasks=tasks,
                limit=limit,
                show_work=show_work,
                harness=harness,
                backend=backend,
            )
        except HarnessNotInstalled as exc:
            raise click.ClickException(str(exc)) from exc
        out_dir.mkdir(parents=True, exist_ok=True)
        teacher_file = RunFolder(out_dir).teacher.samples
        write_samples(samples, teacher_file)
        click.echo(f"oracle teacher: {len(samples)} trajectories in {teacher_file}")
    val: list[Sample] = []
    if val_data is not None:
        try:
            val = list(load_sft_data(val_data, model_dir))
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    summary = trainer.fit(samples, out_dir, val=val)
    line = f"{summary['steps']} steps on {summary['samples']} samples: loss {summary['loss_before']:.3f} -> "
    line += f"{summary['loss_after']:.3f}"
    if val:
        line += f", val loss {summary['val_loss_before']:.3f} -> {summary['val_loss_after']:.3f}"
    click.echo(f"{line}; model in {summary['model']}")
