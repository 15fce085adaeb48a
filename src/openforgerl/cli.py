"""The `openforge` command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="openforgerl")
def main() -> None:
    """OpenForgeRL: train agents inside the harnesses they really run in."""


@main.group()
def model() -> None:
    """Make and inspect models."""


@model.command("init")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Directory to write the model to."
)
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def model_init(out: str, size: str, seed: int) -> None:
    """Make a tiny real model locally: BPE tokenizer, chat template, Qwen2 weights (no hub)."""
    from openforgerl.modelkit import init_model

    path = init_model(out, size=size, seed=seed)  # type: ignore[arg-type]
    click.echo(f"model written to {path}")


@main.command()
@click.option("--model", "model_dir", required=True, help="HF model directory (tokenizer and chat template).")
@click.option(
    "--engine",
    default="builtin",
    show_default=True,
    help="builtin (transformers, this process), vllm:URL or sglang:URL.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--public-url", default="", help="Base URL harnesses reach the gateway at (default http://HOST:PORT)."
)
@click.option("--store", default="openforge.db", show_default=True, help="SQLite file of the records.")
@click.option(
    "--admin-token", envvar="OPENFORGE_ADMIN_TOKEN", default="", help="Token for /admin (random if unset)."
)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="Overrides the harness's.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Overrides the harness's.")
@click.option("--max-tokens", type=int, default=1024, show_default=True, help="Cap and default per call.")
@click.option("--max-context", type=int, default=4096, show_default=True, help="Prompt + completion limit.")
@click.option("--max-inflight", type=int, default=1024, show_default=True, help="Beyond this: 429.")
@click.option("--durability", type=click.Choice(["full", "normal"]), default="full", show_default=True)
def gateway(
    model_dir: str,
    engine: str,
    host: str,
    port: int,
    public_url: str,
    store: str,
    admin_token: str,
    temperature: float,
    top_p: float,
    max_tokens: int,
    max_context: int,
    max_inflight: int,
    durability: str,
) -> None:
    """Serve the recording gateway: an OpenAI-compatible endpoint per rollout."""
    from openforgerl.gateway.server import GatewayConfig, serve

    serve(
        GatewayConfig(
            model=model_dir,
            engine=engine,
            host=host,
            port=port,
            public_url=public_url,
            store=store,
            admin_token=admin_token,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            max_context=max_context,
            max_inflight=max_inflight,
            durability=durability,
        )
    )


@main.group()
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

    from openforgerl.harnesses import HARNESSES, HarnessError, get

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


@main.command()
@click.option("--cache", type=click.Path(file_okay=False), default=None, help="Harness install folder.")
def doctor(cache: str | None) -> None:
    """What this machine has for running rollouts: runtimes, sandboxing, installed harnesses."""
    import platform
    import shutil
    from pathlib import Path

    from openforgerl.harnesses import HARNESSES, get

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


def _rollout_options(fn: Any) -> Any:
    """Options shared by `eval` and `rollout`."""
    options = [
        click.option("--tasks", required=True, help="A suite (tools-tiny, claw-basic) or task file/dir."),
        click.option("--harness", default="react", show_default=True, help="The harness to run tasks with."),
        click.option("--split", default=None, help="Only tasks of this split (train, heldout, test)."),
        click.option("--limit", type=int, default=None, help="Only the first N tasks."),
        click.option("--model", "model_dir", default=None, help="Model dir served by an embedded gateway."),
        click.option("--gateway", "gateway_url", default=None, help="A running gateway's URL instead."),
        click.option("--admin-token", envvar="OPENFORGE_ADMIN_TOKEN", default="", help="With --gateway."),
        click.option("--concurrency", type=int, default=4, show_default=True),
        click.option("--max-tokens", type=int, default=256, show_default=True, help="Per model call."),
        click.option("--max-turns", type=int, default=12, show_default=True, help="ReAct harness turns."),
        click.option(
            "--on-failure",
            type=click.Choice(["zero", "drop", "verify"]),
            default="zero",
            show_default=True,
            help="Score of a rollout whose harness crashed or timed out.",
        ),
        click.option("--out", type=click.Path(file_okay=False), default=None, help="Run folder."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _eval_options(kw: dict[str, Any], k: int, n: int | None, default_out: str) -> Any:
    from openforgerl.evaluate import EvalOptions
    from openforgerl.modelkit import cached_model

    model_dir = kw.pop("model_dir")
    if model_dir is None and kw["gateway_url"] is None:
        model_dir = str(cached_model("tiny", 0))
        click.echo(f"no --model or --gateway: serving the tiny local model {model_dir}", err=True)
    return EvalOptions(
        tasks=kw["tasks"],
        harness=kw["harness"],
        k=k,
        n=n,
        split=kw["split"],
        limit=kw["limit"],
        model=model_dir,
        gateway=kw["gateway_url"],
        admin_token=kw["admin_token"],
        concurrency=kw["concurrency"],
        max_tokens=kw["max_tokens"],
        max_turns=kw["max_turns"],
        on_failure=kw["on_failure"],
        out=Path(kw["out"] or default_out),
    )


@main.command("eval")
@_rollout_options
@click.option("--k", "k", type=int, default=1, show_default=True, help="pass@k and pass^k for k = 1..K.")
@click.option("--n", "n", type=int, default=None, help="Runs per task (n >= k; default k).")
def eval_cmd(k: int, n: int | None, **kw: Any) -> None:
    """Run tasks n times each; report pass@k, pass^k and mean reward with 95% confidence intervals."""
    from openforgerl.evaluate import run_eval

    if n is not None and n < k:
        raise click.BadParameter(f"--n ({n}) must be at least --k ({k})", param_hint="--n")
    opts = _eval_options(kw, k, n, f"runs/eval-{kw['tasks']}-{kw['harness']}")
    report = run_eval(opts)
    click.echo((opts.out / "report.md").read_text())
    click.echo(f"report: {opts.out / 'report.json'} and {opts.out / 'report.md'}")
    if report["scored"] == 0:
        raise SystemExit(1)


@main.command("rollout")
@_rollout_options
@click.option("--n", "n", type=int, default=1, show_default=True, help="Rollouts per task.")
def rollout_cmd(n: int, **kw: Any) -> None:
    """Run tasks once (or n times) and write the training samples they produced."""
    from openforgerl.evaluate import run_and_write_trajectories

    opts = _eval_options(kw, 1, n, f"runs/rollout-{kw['tasks']}-{kw['harness']}")
    summary = run_and_write_trajectories(opts)
    click.echo(f"{summary['rollouts']} rollouts, {summary['samples']} samples written to {summary['path']}")


if __name__ == "__main__":
    main()
