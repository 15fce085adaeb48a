"""`openforge export-sft`: recorded conversations as chat rows for SFT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.command("export-sft")
@click.option("--store", "store_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSONL of chat rows.")
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
def export_sft_cmd(
    store_path: str,
    out: str,
    run_id: str | None,
    min_reward: float | None,
    statuses: tuple[str, ...],
    include_side_requests: bool,
) -> None:
    """Recorded conversations (e.g. an upstream teacher's) as chat rows for `openforge sft --data`."""
    import asyncio

    from openforgerl.gateway.export import export_sft
    from openforgerl.store import Store

    async def export() -> Any:
        store = Store(store_path)
        try:
            return await export_sft(
                store,
                Path(out),
                run_id=run_id,
                min_reward=min_reward,
                statuses=statuses,
                include_side_requests=include_side_requests,
            )
        finally:
            await store.close()

    counts = asyncio.run(export())
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(counts.skipped.items()))
    click.echo(
        f"{counts.rows} conversations from {counts.rollouts} rollouts in {out}"
        + (f"; left out: {skipped}" if skipped else "")
    )
