"""`python -m openforgerl.demo`: the demo's command line. Its options are DemoConfig's settings
(demo/config.py: each declared there once, with its default and help), derived as `openforge train`'s
are; `--recipe` starts from a named set of them (config.RECIPES)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import click

from openforgerl.config_options import config_options, given_settings
from openforgerl.demo import pipeline
from openforgerl.demo.config import RECIPES, DemoConfig
from openforgerl.run.folder import RunFolder


def viewer_line(out: Path) -> str:
    """The command that opens the run's story in the viewer: its phases, each evaluation, and the
    before/after comparisons."""
    return (
        f"the whole run, phase by phase, and the before/after comparisons: "
        f"openforge view --runs {out} --model {out / 'model'}  (then http://127.0.0.1:8600/#/run/{out.name})"
    )


def demo_config(recipe: str | None, given: dict[str, Any]) -> DemoConfig:
    """DemoConfig's defaults, then the recipe's settings, then the settings given."""
    settings = {**RECIPES.get(recipe or "", {}), **given}
    if "out" in settings:
        settings["out"] = Path(settings["out"])
    return dataclasses.replace(DemoConfig(), **settings)


@click.command(
    "demo",
    help="`make demo`: a student learns tools-tiny from an oracle teacher's trajectories by SFT, then "
    "by GRPO; held-out pass@1 before SFT, after SFT and after RL, paired, in OUT/report.md. Each phase "
    "is skipped when its output exists, so a rerun continues. The phases: openforgerl/demo/pipeline.py.",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--recipe",
    type=click.Choice(sorted(RECIPES)),
    default=None,
    help="Start from a named set of settings: quick (toy sizes, proves the pipeline in minutes), "
    "smollm2 (the pretrained SmolLM2-135M-Instruct student and its measured recipe; `make demo`'s), "
    "tiny (the defaults: the kit's tiny model). Options given beside it win.",
)
@click.option("--quick", is_flag=True, help="The same as --recipe quick.")
@config_options(DemoConfig)
def demo_cmd(recipe: str | None, quick: bool, **kw: Any) -> None:
    if quick and recipe not in (None, "quick"):
        raise click.UsageError(f"--quick is --recipe quick: not with --recipe {recipe}")
    try:
        cfg = demo_config("quick" if quick else recipe, given_settings(DemoConfig, kw))
    except ValueError as e:  # settings that contradict each other
        raise click.UsageError(str(e)) from e
    report = pipeline.run(cfg)
    if cfg.until:
        click.echo(
            f"stopped after {cfg.until}: {', '.join(report['evaluations'])} evaluated; "
            "rerun without --until to go on"
        )
        return
    out = RunFolder(cfg.out)
    click.echo(out.report_md.read_text())
    click.echo(f"report: {out.report_md}; curve: {out.reward_curve}")
    click.echo(viewer_line(cfg.out))
    if not report["evaluations"]:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    demo_cmd.main(args=argv, prog_name="python -m openforgerl.demo")
