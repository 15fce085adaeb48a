"""`openforge gateway`: serve the recording gateway (defaults: GatewayConfig)."""

from __future__ import annotations

import click

from openforgerl.cli.options import upstream_options, upstream_specs
from openforgerl.gateway.config import GatewayConfig


@click.command()
@click.option("--model", "model_dir", required=True, help="HF model directory (tokenizer and chat template).")
@click.option(
    "--engine",
    default=GatewayConfig.engine,
    show_default=True,
    help="builtin (transformers, this process), vllm:URL or sglang:URL.",
)
@click.option("--host", default=GatewayConfig.host, show_default=True)
@click.option("--port", default=GatewayConfig.port, show_default=True, type=int)
@click.option(
    "--public-url",
    default=GatewayConfig.public_url,
    help="Base URL harnesses reach the gateway at (default http://HOST:PORT).",
)
@click.option("--store", default=GatewayConfig.store, show_default=True, help="SQLite file of the records.")
@click.option(
    "--admin-token",
    envvar="OPENFORGE_ADMIN_TOKEN",
    default=GatewayConfig.admin_token,
    help="Token for /admin (random if unset).",
)
@click.option(
    "--temperature",
    type=float,
    default=GatewayConfig.temperature,
    show_default=True,
    help="Overrides the harness's.",
)
@click.option(
    "--top-p", type=float, default=GatewayConfig.top_p, show_default=True, help="Overrides the harness's."
)
@click.option(
    "--max-tokens",
    type=int,
    default=GatewayConfig.max_tokens,
    show_default=True,
    help="Cap and default per call.",
)
@click.option(
    "--max-context",
    type=int,
    default=GatewayConfig.max_context,
    help="Prompt + completion limit (default: the model's context length).",
)
@click.option(
    "--max-inflight",
    type=int,
    default=GatewayConfig.max_inflight,
    show_default=True,
    help="Beyond this: 429.",
)
@click.option(
    "--max-connections-per-peer",
    type=click.IntRange(min=1),
    default=GatewayConfig.max_connections_per_peer,
    show_default=True,
    help="Open connections one client address may hold (all local rollouts share 127.0.0.1).",
)
@click.option(
    "--durability", type=click.Choice(["full", "normal"]), default=GatewayConfig.durability, show_default=True
)
@click.option(
    "--work-threads",
    type=click.IntRange(min=0),
    default=GatewayConfig.work_threads,
    show_default=True,
    help="Threads that parse, render and tokenise requests off the event loop (0: on it, for comparison).",
)
@click.option(
    "--prefix-cache-mb",
    type=click.FloatRange(min=0.0),
    default=GatewayConfig.prefix_cache_mb,
    show_default=True,
    help="The builtin engine's prefix cache (KV of earlier turns and shared system prompts); 0: off.",
)
@upstream_options
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
    from openforgerl.gateway.server import serve

    specs = upstream_specs(upstreams, upstream_key_envs, upstream_timeout)
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
