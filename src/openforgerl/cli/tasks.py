"""`openforge tasks check`: a task set's verifiers against their reference solutions, no model."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.options import backend_choice, sandbox_options


@click.group()
def tasks() -> None:
    """Work with task sets (YAML/JSONL task files, Harbor and Terminal-Bench task folders)."""


@tasks.command("check")
@click.argument("source")
@click.option("--split", default=None, help="Only tasks of this split (train, heldout, test).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@sandbox_options()
@click.option(
    "--network",
    type=click.Choice(["none", "host"]),
    default="none",
    show_default=True,
    help="What the sandboxes reach: nothing, or the host's network (tasks whose tests install "
    "packages); a task with allow_internet = false gets none either way.",
)
@click.option("--concurrency", type=int, default=2, show_default=True)
def check_cmd(
    source: str,
    split: str | None,
    limit: int | None,
    network: str,
    concurrency: int,
    **kw: Any,
) -> None:
    """Check every task of SOURCE (a task file or folder, a suite, harbor:DIR): its verifier must fail
    on the untouched workspace and pass twice after the reference solution, without changing the
    workspace. One line per task, then a summary; exit 1 when any task fails."""
    import asyncio

    from openforgerl.rollouts.check import TaskCheck, TaskChecker, summary
    from openforgerl.tasks import TaskError, load_tasks

    backend = backend_choice(kw)

    try:
        chosen = load_tasks(source, split=split)[:limit]  # type: ignore[arg-type]
    except TaskError as exc:
        raise click.ClickException(str(exc)) from exc
    if not chosen:
        raise click.ClickException(f"no tasks in {source}" + (f" (split {split})" if split else ""))
    checker = TaskChecker(backend.make("tasks-check"), network="host" if network == "host" else "none")

    def report(result: TaskCheck) -> None:
        click.echo(result.line())

    results = asyncio.run(checker.check_all(chosen, concurrency=concurrency, on_done=report))
    click.echo(summary(results))
    if not all(r.ok for r in results):
        raise SystemExit(1)
