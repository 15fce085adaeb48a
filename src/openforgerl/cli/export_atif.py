"""`openforge export-atif`: recorded rollouts as ATIF trajectories (Harbor's trajectory.json)."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.export_sft import export, selection


@click.command("export-atif")
@selection
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="A folder per rollout, its trajectory.json (and trajectory.branch-N.json) inside.",
)
@click.option(
    "--token-ids/--no-token-ids",
    default=True,
    show_default=True,
    help="Each agent step's prompt and completion token ids and logprobs (the bulk of a file).",
)
def export_atif_cmd(store_path: str, out: str, **kw: Any) -> None:
    """Recorded rollouts as ATIF trajectories, for Harbor's viewer and tools (and `openforge sft --data`)."""
    from openforgerl.atif import ATIF_VERSION, export_atif

    export(export_atif, f"{ATIF_VERSION} trajectories", store_path, out, **kw)
