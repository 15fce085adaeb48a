"""`openforge export-sft`: recorded conversations as chat rows for SFT. `selection` and `export` are
what every export of recorded rollouts shares (export-atif too): which rollouts, and the store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

F = Callable[..., Any]


def selection(fn: F) -> F:
    """The options that pick the recorded rollouts an export writes."""
    options = [
        click.option("--store", "store_path", required=True, type=click.Path(dir_okay=False, exists=True)),
        click.option("--run", "run_id", default=None, help="Only this run's rollouts."),
        click.option("--min-reward", type=float, default=None, help="Only rollouts rewarded at least this."),
        click.option(
            "--status",
            "statuses",
            multiple=True,
            default=("closed",),
            show_default=True,
            help="Rollout statuses to export (repeatable).",
        ),
        click.option(
            "--include-side-requests", is_flag=True, help="Also titles, routers and other side calls."
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def export(write: Callable[..., Any], what: str, store_path: str, out: str, **kw: Any) -> None:
    """`write(store, Path(out), Selection(the selection's options), **the others)` on the store,
    then one line: how many `what` it wrote, from how many rollouts, and what it left out."""
    from openforgerl.gateway.export import Selection
    from openforgerl.store import Store

    chosen = Selection(**{name: kw.pop(name) for name in Selection.__dataclass_fields__})

    async def run() -> Any:
        store = Store(store_path)
        try:
            return await write(store, Path(out), chosen, **kw)
        finally:
            await store.close()

    counts = asyncio.run(run())
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(counts.skipped.items()))
    click.echo(
        f"{counts.rows} {what} from {counts.rollouts} rollouts in {out}"
        + (f"; left out: {skipped}" if skipped else "")
    )


@click.command("export-sft")
@selection
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSONL of chat rows.")
def export_sft_cmd(store_path: str, out: str, **kw: Any) -> None:
    """Recorded conversations (e.g. an upstream teacher's) as chat rows for `openforge sft --data`."""
    from openforgerl.gateway.export import export_sft

    export(export_sft, "conversations", store_path, out, **kw)
