"""`openforge view`: the trace viewer."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("view")
@click.option("--store", type=click.Path(dir_okay=False), default=None, help="A gateway store (SQLite).")
@click.option("--runs", type=click.Path(file_okay=False), default=None, help="A folder of run folders.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False), default=None, help="Tokenizer dir.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8600, show_default=True, type=int)
@click.option(
    "--token", envvar="OPENFORGE_VIEW_TOKEN", default="", help="Asked of every request; needed off loopback."
)
@click.option(
    "--create-indexes",
    is_flag=True,
    help="Open the stores read-write once to add the viewer's indexes (fast sorting at 100k+ rollouts).",
)
def view(
    store: str | None,
    runs: str | None,
    model_dir: str | None,
    host: str,
    port: int,
    token: str,
    create_indexes: bool,
) -> None:
    """Browse runs, rollouts, turns and tokens in a web UI (read-only; loopback unless given a token)."""
    from openforgerl.ui import ViewerConfig, build_app, is_loopback, serve

    if store is None and runs is None:
        runs = "runs"
        if not Path(runs).is_dir():
            raise click.UsageError("give --store PATH and/or --runs DIR (no ./runs folder here)")
    if not is_loopback(host) and not token:
        raise click.UsageError(f"--host {host} is not loopback: give --token (or OPENFORGE_VIEW_TOKEN)")
    cfg = ViewerConfig(
        store=Path(store) if store else None,
        runs=Path(runs) if runs else None,
        model=Path(model_dir) if model_dir else None,
        token=token,
        create_indexes=create_indexes,
    )
    try:
        app = build_app(cfg)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    click.echo(f"OpenForgeRL viewer on http://{shown}:{port}/" + (f"?token={token}" if token else ""))
    serve(app, host, port)
