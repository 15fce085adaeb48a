"""`openforge harness`: install the agent CLIs that rollouts run in."""

from __future__ import annotations

import click


@click.group()
def harness() -> None:
    """Install the agent CLIs that rollouts run in (pinned versions)."""


@harness.command("install")
@click.argument("name")
@click.option(
    "--cache",
    type=click.Path(file_okay=False),
    default=None,
    help="Install folder (default $OPENFORGE_HARNESS_CACHE or ~/.cache/openforgerl/harnesses).",
)
def harness_install(name: str, cache: str | None) -> None:
    """Install harness NAME, or `all` of them, at its pinned version (skipped when already there)."""
    import time
    from pathlib import Path

    from openforgerl.harnesses.adapters import HARNESSES, HarnessError, get

    if name != "all" and name not in HARNESSES:
        raise click.BadParameter(f"one of {', '.join(HARNESSES)} or all", param_hint="NAME")
    failed = []
    for each in HARNESSES if name == "all" else [name]:
        adapter = get(each, Path(cache) if cache else None)
        if adapter.check().ok:
            click.echo(f"{each} {adapter.version}: already installed in {adapter.cache_dir}")
            continue
        click.echo(f"{each} {adapter.version}: installing into {adapter.cache_dir} ...")
        start = time.monotonic()
        try:
            adapter.install()
        except HarnessError as exc:
            failed.append(each)
            click.echo(f"{each}: FAILED: {exc}", err=True)
            continue
        found = adapter.check()
        if not found.ok:
            failed.append(each)
        status = "ok" if found.ok else f"FAILED: {found.missing}"
        click.echo(f"{each} {found.installed or '-'}: {status} ({time.monotonic() - start:.0f} s)")
    if failed:
        raise click.ClickException(f"not installed: {', '.join(failed)}")
