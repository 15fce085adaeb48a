"""`openforge rollout`: run tasks and write the training samples they produced."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.options import eval_options, refusing_bad_network, rollout_options


@click.command("rollout")
@rollout_options
@click.option("--n", "n", type=int, default=1, show_default=True, help="Rollouts per task.")
def rollout_cmd(n: int, **kw: Any) -> None:
    """Run tasks once (or n times) and write the training samples they produced."""
    from openforgerl.evaluate import run_and_write_trajectories

    names = kw.pop("harness")
    if len(names) > 1:
        raise click.BadParameter("rollout runs one harness (eval compares several)", param_hint="--harness")
    kw["harness"] = names[0]
    opts = eval_options(kw, 1, n, f"runs/rollout-{kw['tasks']}-{kw['harness']}")
    summary = refusing_bad_network(run_and_write_trajectories, opts)
    click.echo(f"{summary['rollouts']} rollouts, {summary['samples']} samples written to {summary['path']}")
