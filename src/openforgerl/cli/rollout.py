"""`openforge rollout`: run tasks and write the training samples they produced."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.options import eval_options, refusing_bad_network, rollout_options
from openforgerl.eval_options import EvalOptions


@click.command("rollout")
@rollout_options(skip=("k",))
def rollout_cmd(**kw: Any) -> None:
    """Run tasks once (or n times) and write the training samples they produced."""
    from openforgerl.evaluate import run_and_write_trajectories

    names = kw["harness"] or [EvalOptions.harness]
    if len(names) > 1:
        raise click.BadParameter("rollout runs one harness (eval compares several)", param_hint="--harness")
    opts = eval_options(kw, f"runs/rollout-{kw['tasks']}-{names[0]}", skip=("k",))
    summary = refusing_bad_network(run_and_write_trajectories, opts)
    click.echo(f"{summary['rollouts']} rollouts, {summary['samples']} samples written to {summary['path']}")
