"""A tiny real model, made locally: a randomly initialised Qwen2 causal LM with a locally trained
byte-level BPE tokenizer.

`init_model` writes a directory that loads like a hub checkpoint (`AutoTokenizer`,
`AutoModelForCausalLM`, vLLM), with a Qwen2.5-style ChatML template that renders tools, tool calls and
`<think>` reasoning. `init_vision_model` writes a tiny Qwen2-VL (`AutoProcessor`,
`AutoModelForImageTextToText`): the same tokenizer plus the vision tokens, the same template plus
image parts. Nothing is downloaded. `cached_model` builds one per (size, seed, kit version, vision)
under a cache directory, safely from parallel processes.

Models hold MAX_POSITIONS positions unless `max_positions` says otherwise (real agent CLIs send
9k-22k-token prompts: `openforge model init --max-positions 32768`); the config's
`max_position_embeddings` and the tokenizer's `model_max_length` both say it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from openforgerl.modelkit import corpus
from openforgerl.modelkit.builds import build_once, cache_root

__all__ = [
    "ADDED_TOKENS",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "MAX_POSITIONS",
    "MAX_POSITIONS_LIMIT",
    "QWEN2_PATTERN",
    "SIZES",
    "SPECIAL_TOKENS",
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "TOOL_RESPONSE_END",
    "TOOL_RESPONSE_START",
    "VISION_TOKENS",
    "ModelSize",
    "cache_root",
    "cached_model",
    "chat_template",
    "check_max_positions",
    "init_model",
    "init_vision_model",
    "kit_version",
    "vision_chat_template",
]

Size = Literal["tiny", "small"]

ENDOFTEXT = "<|endoftext|>"  # pad (and bos in config, as in Qwen2.5)
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # eos
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
THINK_START, THINK_END = "<think>", "</think>"

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2-VL's vision markers (appended after the text tokens in vision models): an image renders as
# VISION_START, IMAGE_PAD, VISION_END, and the processor repeats IMAGE_PAD once per image token.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# Single ids but not "special": decoding with skip_special_tokens keeps them, so tool calls and
# reasoning stay parseable from decoded text (as with Qwen2.5).
ADDED_TOKENS = (
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
    THINK_START,
    THINK_END,
)

# Qwen2's pre-tokenizer split; AutoTokenizer rebuilds exactly this for model_type=qwen2, so we train with it.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

MAX_POSITIONS = 4096
# The most `max_positions` a kit model accepts: Qwen2.5's longest native context, and already more
# than a CPU prefills in reasonable time.
MAX_POSITIONS_LIMIT = 131072
# Vision models: images are resized to at most MAX_IMAGE_TOKENS tokens (a 28x28 pixel square each):
# a 640x400 screenshot becomes 240 tokens.
PATCH, MERGE = 14, 2
MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS = 256, 4


@dataclass(frozen=True, slots=True)
class ModelSize:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(vocab=8192, hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512),
    "small": ModelSize(vocab=16384, hidden=256, layers=8, heads=4, kv_heads=2, intermediate=1024),
}

_N_CHATS = 1000  # about 1.5 MB of rendered conversations


@cache
def chat_template() -> str:
    """The ChatML template saved with every kit model."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8")


_TEXT_PART = """            {%- elif part.type == "text" %}
                {{- part.text }}
"""


@cache
def vision_chat_template() -> str:
    """The kit template with image parts ({"type": "image"}, as processors take them) rendered as
    Qwen2-VL's placeholder, which the processor expands to the image's token count."""
    template = chat_template()
    if template.count(_TEXT_PART) != 1:
        raise RuntimeError("chat_template.jinja changed: update vision_chat_template's anchor")
    image = (
        '            {%- elif part.type in ("image", "image_url") %}\n'
        f'                {{{{- "{VISION_START}{IMAGE_PAD}{VISION_END}" }}}}\n'
    )
    return template.replace(_TEXT_PART, _TEXT_PART + image)


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    # transformers' own renderer, so the corpus matches apply_chat_template exactly.
    from transformers.utils.chat_template_utils import render_jinja_template

    render: Any = render_jinja_template  # annotated as returning str; it returns (renders, indices)
    rendered, _ = render([messages], tools=tools, chat_template=chat_template())
    return str(rendered[0])


@cache
def _training_text() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(standard-library sources, rendered synthetic chats); built once per process."""
    stdlib = tuple(corpus.stdlib_text())
    vocab = corpus.word_list("".join(stdlib))
    chats = tuple(_render(c["messages"], c["tools"]) for c in corpus.synthetic_conversations(_N_CHATS, vocab))
    return stdlib, chats


def _train_tokenizer(vocab_size: int) -> Any:
    """Train the byte-level BPE and append the special and added tokens as the last ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    stdlib, chats = _training_text()
    # Keep marker strings out of the merges: they become whole tokens below.
    markers = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS))

    def texts() -> Iterator[str]:
        yield from stdlib
        for chat in chats:
            yield from (part for part in markers.split(chat) if part)

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_extra,
        min_frequency=2,
        # Every byte is in the vocabulary, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    if tok.get_vocab_size() != vocab_size - n_extra:
        raise RuntimeError(f"BPE stopped at {tok.get_vocab_size()} tokens; the corpus is too small")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def check_max_positions(max_positions: int) -> int:
    """`max_positions` if it is a whole number of positions in [1, MAX_POSITIONS_LIMIT]; else ValueError."""
    if isinstance(max_positions, bool) or not isinstance(max_positions, int):
        raise ValueError(f"max_positions must be an integer, not {max_positions!r}")
    if not 1 <= max_positions <= MAX_POSITIONS_LIMIT:
        raise ValueError(f"max_positions must lie in [1, {MAX_POSITIONS_LIMIT}], not {max_positions}")
    return max_positions


def _save_tokenizer(
    raw: Any, out: Path, template: str | None = None, max_positions: int = MAX_POSITIONS
) -> Any:
    """Save through Qwen2Tokenizer, the class AutoTokenizer picks, so load/save is a fixed point."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    with tempfile.TemporaryDirectory() as staging:
        PreTrainedTokenizerFast(
            tokenizer_object=raw,
            bos_token=None,
            eos_token=IM_END,
            pad_token=ENDOFTEXT,
            unk_token=None,
            clean_up_tokenization_spaces=False,
            model_max_length=max_positions,
        ).save_pretrained(staging)
        tok = Qwen2Tokenizer.from_pretrained(staging)
    for loading_detail in ("is_local", "local_files_only"):  # describe the staging load, not the model
        tok.init_kwargs.pop(loading_detail, None)
    tok.chat_template = template or chat_template()
    tok.save_pretrained(out)
    # Qwen2Tokenizer rebuilds its own pipeline; a mismatch with ours would silently change ids.
    _, chats = _training_text()
    probe = chats[0] + " naïve café 日本語 🙂\r\n\t  x"
    if tok.encode(probe) != raw.encode(probe).ids:
        raise RuntimeError("tokenizer ids change after save_pretrained; the pipelines differ")
    return tok


def _build_model(spec: ModelSize, tok: Any, seed: int, max_positions: int = MAX_POSITIONS) -> Any:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    pad, im_end = tok.convert_tokens_to_ids(ENDOFTEXT), tok.convert_tokens_to_ids(IM_END)
    config = Qwen2Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=pad,
        eos_token_id=im_end,
        pad_token_id=pad,
        dtype="float32",
        # 1/sqrt(hidden), not the config's 0.02 (sized for hidden 768+): at 0.02 a 128-wide model's
        # attention logits start near 0 and it takes hundreds of SFT steps to learn to copy a value
        # from a tool response a dozen tokens back; at 1/sqrt(128) it does so within 200 (issue #5).
        initializer_range=spec.hidden**-0.5,
    )
    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[im_end, pad], pad_token_id=pad)
    return model


def _start_build(out: str | Path, size: Size, max_positions: int) -> tuple[ModelSize, Path]:
    """Check a build's size and context, and make its folder: (the size's spec, the folder)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    check_max_positions(max_positions)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return SIZES[size], out


def init_model(
    out: str | Path, size: Size = "tiny", seed: int = 0, *, max_positions: int = MAX_POSITIONS
) -> Path:
    """Build a tokenizer and a randomly initialised Qwen2ForCausalLM into `out`; return `out` as a Path.

    The tokenizer depends only on `size` (and the Python version, whose standard library it is trained
    on); weights depend on `size` and `seed`. Same inputs on the same machine give byte-identical files.
    `max_positions` is the context the model and tokenizer declare (rotary positions, so the weights
    do not depend on it).
    """
    import torch

    spec, out = _start_build(out, size, max_positions)
    tok = _save_tokenizer(_train_tokenizer(spec.vocab), out, max_positions=max_positions)
    model = _build_model(spec, tok, seed, max_positions)
    model.to(torch.float32).save_pretrained(out)
    return out


def init_vision_model(
    out: str | Path, size: Size = "tiny", seed: int = 0, *, max_positions: int = MAX_POSITIONS
) -> Path:
    """Build a tiny Qwen2VLForConditionalGeneration with its processor into `out`; return `out`.

    The language model has the dimensions of `size`'s text model (its vocabulary plus the four vision
    tokens), the vision encoder two small blocks; the image processor keeps an image within
    MAX_IMAGE_TOKENS tokens. The template is the text models' with image parts. Loads with
    AutoModelForImageTextToText, AutoTokenizer and `openforgerl.vision.load_processor` (AutoProcessor
    too where torchvision is installed).
    """
    import torch
    from tokenizers import AddedToken
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec, out = _start_build(out, size, max_positions)
    raw = _train_tokenizer(spec.vocab)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    template = vision_chat_template()
    tok = _save_tokenizer(raw, out, template, max_positions)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*VISION_TOKENS, ENDOFTEXT, IM_END)}
    pixel = (PATCH * MERGE) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_IMAGE_TOKENS * pixel,
        max_pixels=MAX_IMAGE_TOKENS * pixel,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    # No Qwen2VLProcessor: it needs a video processor, hence torchvision (see openforgerl.vision).
    image_processor.save_pretrained(out)
    head_dim = spec.hidden // spec.heads
    third = head_dim // 2 // 3  # M-RoPE splits the rotary half into temporal, height, width sections
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads,
            "max_position_embeddings": max_positions,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 2 - 2 * third, third, third],
            },
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
        },
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": spec.hidden,
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen2VLForConditionalGeneration(config)
    pad, im_end = ids[ENDOFTEXT], ids[IM_END]
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[im_end, pad], pad_token_id=pad)
    model.to(torch.float32).save_pretrained(out)
    return out


@cache
def kit_version() -> str:
    """Short hash of everything a built model depends on: this package's files and the toolchain."""
    h = hashlib.sha256()
    package = resources.files(__package__)
    for name in ("__init__.py", "corpus.py", "chat_template.jinja", "stdlib_files.txt"):
        h.update(package.joinpath(name).read_bytes())
    h.update(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
    for dist in ("torch", "transformers", "tokenizers"):
        h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:12]


def cached_model(
    size: Size = "tiny", seed: int = 0, *, vision: bool = False, max_positions: int = MAX_POSITIONS
) -> Path:
    """Path of a built model under `cache_root()/models/`, building it on first use (with `vision`,
    the tiny Qwen2-VL of `init_vision_model`; with `max_positions`, a model of that context, cached
    apart from the default's). Safe from parallel processes (`builds.build_once`).
    """
    check_max_positions(max_positions)
    context = "" if max_positions == MAX_POSITIONS else f"-ctx{max_positions}"
    final = cache_root() / "models" / f"{size}{'-vl' if vision else ''}{context}-{seed}-{kit_version()}"
    build = init_vision_model if vision else init_model
    # The default's build call is unchanged (tests stand in for init_model).
    context_kw = {} if max_positions == MAX_POSITIONS else {"max_positions": max_positions}
    return build_once(final, lambda scratch: build(scratch, size, seed, **context_kw))
