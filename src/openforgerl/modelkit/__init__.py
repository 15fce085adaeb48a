"""A tiny real model, made locally: a randomly initialised Qwen2 causal LM with a locally trained
byte-level BPE tokenizer.

`init_model` writes a directory that loads like a hub checkpoint (`AutoTokenizer`,
`AutoModelForCausalLM`, vLLM), with a Qwen2.5-style ChatML template that renders tools, tool calls and
`<think>` reasoning. Nothing is downloaded. `cached_model` builds one per (size, seed, kit version)
under a cache directory, safely from parallel processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from openforgerl.modelkit import corpus

__all__ = [
    "ADDED_TOKENS",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "QWEN2_PATTERN",
    "SIZES",
    "SPECIAL_TOKENS",
    "THINK_END",
    "THINK_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "TOOL_RESPONSE_END",
    "TOOL_RESPONSE_START",
    "ModelSize",
    "cache_root",
    "cached_model",
    "chat_template",
    "init_model",
    "kit_version",
]

Size = Literal["tiny", "small"]

ENDOFTEXT = "<|endoftext|>"  # pad (and bos in config, as in Qwen2.5)
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # eos
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
THINK_START, THINK_END = "<think>", "</think>"

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
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


def _save_tokenizer(raw: Any, out: Path) -> Any:
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
            model_max_length=MAX_POSITIONS,
        ).save_pretrained(staging)
        tok = Qwen2Tokenizer.from_pretrained(staging)
    for loading_detail in ("is_local", "local_files_only"):  # describe the staging load, not the model
        tok.init_kwargs.pop(loading_detail, None)
    tok.chat_template = chat_template()
    tok.save_pretrained(out)
    # Qwen2Tokenizer rebuilds its own pipeline; a mismatch with ours would silently change ids.
    _, chats = _training_text()
    probe = chats[0] + " naïve café 日本語 🙂\r\n\t  x"
    if tok.encode(probe) != raw.encode(probe).ids:
        raise RuntimeError("tokenizer ids change after save_pretrained; the pipelines differ")
    return tok


def _build_model(spec: ModelSize, tok: Any, seed: int) -> Any:
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
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=pad,
        eos_token_id=im_end,
        pad_token_id=pad,
        dtype="float32",
    )
    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[im_end, pad], pad_token_id=pad)
    return model


def init_model(out: str | Path, size: Size = "tiny", seed: int = 0) -> Path:
    """Build a tokenizer and a randomly initialised Qwen2ForCausalLM into `out`; return `out` as a Path.

    The tokenizer depends only on `size` (and the Python version, whose standard library it is trained
    on); weights depend on `size` and `seed`. Same inputs on the same machine give byte-identical files.
    """
    import torch

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    spec = SIZES[size]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _save_tokenizer(_train_tokenizer(spec.vocab), out)
    model = _build_model(spec, tok, seed)
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


def cache_root() -> Path:
    """`$OPENFORGE_CACHE`, or ~/.cache/openforgerl."""
    env = os.environ.get("OPENFORGE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "openforgerl"


def cached_model(size: Size = "tiny", seed: int = 0) -> Path:
    """Path of a built model under `cache_root()/models/`, building it on first use.

    A lock file serialises builders across processes; the build goes to a scratch directory that is
    renamed into place, so readers never see a half-written model.
    """
    models = cache_root() / "models"
    final = models / f"{size}-{seed}-{kit_version()}"
    if final.is_dir():  # only ever created by an atomic rename of a finished build
        return final
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.is_dir():  # another process built it while we waited
                return final
            scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=models))
            try:
                init_model(scratch, size, seed)
                # mkdtemp makes 0700; sandboxed workers under other uids must be able to read the model.
                scratch.chmod(0o755)
                for file in scratch.iterdir():
                    file.chmod(0o644)
                scratch.rename(final)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final
