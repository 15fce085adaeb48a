"""`openforge verl-data`: veRL dataset rows for `openforge train --backend verl`."""

from __future__ import annotations

import click


@click.command("verl-data")
@click.option(
    "--tasks",
    required=True,
    help="A suite (tools-tiny, tools-tiny-faults, claw-basic, web-basic) or task file/dir.",
)
@click.option("--split", default=None, help="Only tasks of this split (train, heldout, test).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="FILE.parquet or FILE.jsonl.")
def verl_data_cmd(tasks: str, split: str | None, limit: int | None, out: str) -> None:
    """Write veRL dataset rows (one per task) for `openforge train --backend verl`."""
    from openforgerl.integrations.verl.data import dataset_rows, write_rows

    try:
        rows = dataset_rows(tasks, split, limit)
        path = write_rows(rows, out)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{len(rows)} rows -> {path}")
