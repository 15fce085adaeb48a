"""`openforge gc`: remove the sandboxes that crashed runs left behind."""

from __future__ import annotations

import click

from openforgerl.cli.options import backend_options, kubernetes_config


@click.command()
@click.option("--backend", type=click.Choice(["kubernetes", "docker"]), required=True)
@backend_options
@click.option("--run", "run_id", default=None, help="Remove this run's sandboxes, whatever its heartbeat.")
@click.option(
    "--older-than",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds without a heartbeat after which a run counts as crashed.",
)
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def gc(
    backend: str,
    backend_config: str | None,
    namespace: str | None,
    kubeconfig: str | None,
    context: str | None,
    run_id: str | None,
    older_than: float,
    dry_run: bool,
) -> None:
    """Remove the sandboxes that crashed runs left behind, found by their labels."""
    import asyncio

    if backend == "kubernetes":
        from openforgerl.sandbox.kubernetes import collect_garbage

        cfg = kubernetes_config(backend_config, namespace, kubeconfig, context)
        found = asyncio.run(
            collect_garbage(
                cfg.namespace,
                kubeconfig=cfg.kubeconfig,
                context=cfg.context,
                run=run_id,
                older_than_s=older_than,
                dry_run=dry_run,
            )
        )
    else:
        from openforgerl.sandbox.docker import collect_garbage as docker_garbage

        found = docker_garbage(run=run_id, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for item in found:
        click.echo(f"{verb} {item.kind}/{item.name} (run {item.run})")
    click.echo(f"{len(found)} {'objects' if len(found) != 1 else 'object'} {verb}")
