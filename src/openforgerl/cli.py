"""The `openforge` command."""

from __future__ import annotations

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


if __name__ == "__main__":
    main()
