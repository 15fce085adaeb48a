"""`openforge export-atif`: recorded rollouts as ATIF trajectories (Harbor's trajectory.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.command("export-atif")
@click.option("--store", "store_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="A folder per rollout, its trajectory.json (and trajectory.branch-N.json) inside.",
)
@click.option("--run", "run_id", default=None, help="Only this run's rollouts.")
@click.option("--min-reward", type=float, default=None, help="Only rollouts rewarded at least this.")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    default=("closed",),
    show_default=True,
    help="Rollout statuses to export (repeatable).",
)
@click.option("--include-side-requests", is_flag=True, help="Also titles, routers and other side calls.")
@click.option(
    "--token-ids/--no-token-ids",
    default=True,
    show_default=True,
    help="Each agent step's prompt and completion token ids and logprobs (the bulk of a file).",
)
def export_atif_cmd(
    store_path: str,
    out: str,
    run_id: str | None,
    min_reward: float | None,
    statuses: tuple[str, ...],
    include_side_requests: bool,
    token_ids: bool,
) -> None:
    """Recorded rollouts as ATIF trajectories, for Harbor's viewer and tools (and `openforge sft --data`)."""
    import asyncio

    from openforgerl.atif import ATIF_VERSION, export_atif
    from openforgerl.store import Store

    async def export() -> Any:
        store = Store(store_path)
        try:
            return await export_atif(
                store,
                Path(out),
                run_id=run_id,
                min_reward=min_reward,
                statuses=statuses,
                include_side_requests=include_side_requests,
                token_ids=token_ids,
            )
        finally:
            await store.close()

    counts = asyncio.run(export())
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(counts.skipped.items()))
    click.echo(
        f"{counts.rows} {ATIF_VERSION} trajectories from {counts.rollouts} rollouts in {out}"
        + (f"; left out: {skipped}" if skipped else "")
    )
