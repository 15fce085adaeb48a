"""`openforge doctor`: what this machine has for running rollouts."""

from __future__ import annotations

import click

from openforgerl.cli.options import backend_options, kubernetes_config


def _tool_version(argv: list[str]) -> str:
    import shutil
    import subprocess

    if shutil.which(argv[0]) is None:
        return "missing"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unusable ({exc})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if done.returncode == 0 and lines else f"unusable (exit {done.returncode})"


@click.command()
@click.option("--cache", type=click.Path(file_okay=False), default=None, help="Harness install folder.")
@click.option(
    "--backend",
    type=click.Choice(["kubernetes", "docker"]),
    default=None,
    help="Also check this sandbox backend: access, permissions, and what is missing.",
)
@backend_options
def doctor(
    cache: str | None,
    backend: str | None,
    backend_config: str | None,
    namespace: str | None,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """What this machine has for running rollouts: runtimes, sandboxing, installed harnesses."""
    import platform
    import shutil
    from pathlib import Path

    from openforgerl.harnesses.adapters import HARNESSES, get

    click.echo(f"python   {platform.python_version()}")
    click.echo(f"node     {_tool_version(['node', '--version'])}")
    click.echo(f"npm      {_tool_version(['npm', '--version'])}")
    bwrap = shutil.which("bwrap") or "missing (the local sandbox falls back to plain subprocesses)"
    click.echo(f"bwrap    {bwrap}")
    adapters = [get(name, Path(cache) if cache else None) for name in HARNESSES]
    click.echo(f"harnesses in {adapters[0].cache_dir}:")
    click.echo(f"  {'name':<16}{'dialect':<18}{'pinned':<12}installed")
    for adapter in adapters:
        found = adapter.check()
        state = found.installed if found.ok else f"missing: {found.missing}"
        click.echo(f"  {adapter.name:<16}{adapter.dialect:<18}{adapter.version:<12}{state}")
    if backend is None:
        return
    if backend == "kubernetes":
        from openforgerl.sandbox.kubernetes import KubernetesBackend

        check = KubernetesBackend(kubernetes_config(backend_config, namespace, kubeconfig, context)).check()
    else:
        from openforgerl.sandbox.docker import DockerBackend, DockerConfig

        check = DockerBackend(DockerConfig(run_id="doctor", image="none")).check()
    click.echo(f"backend  {check.backend}: isolation {check.isolation}, limits {check.limits}")
    for what, detail in check.available.items():
        click.echo(f"  ok       {what}: {detail}")
    for what, detail in check.missing.items():
        click.echo(f"  MISSING  {what}: {detail}")
    if check.missing:
        raise SystemExit(1)
