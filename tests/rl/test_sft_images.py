"""SFT on image trajectories, end to end: a GUI-style episode with screenshots recorded by a real
gateway in front of the tiny Qwen2-VL, `openforge export-sft`, `load_sft_data` and `openforge sft`.

The contract: a chat row tokenises for a VLM student to the ids the gateway recorded for the same
conversation (same image token runs, same assistant mask, `weight: 0` history untrained), the
trainer computes the pixels of the original screenshots from the row alone, and the trained
checkpoint is a VLM directory the engine serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from click.testing import CliRunner
from openai import OpenAI

from openforgerl.cli import main
from openforgerl.engines.base import SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.images import Image
from openforgerl.rendering import VisionRenderer, renderer_for
from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data
from openforgerl.rollouts.trajectory import Sample, build_samples, calls_from_json
from openforgerl.vision import load_processor, vision_inputs
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway
from tests.vlm_helpers import screenshot

SYSTEM = "You operate a web browser. Call one tool per step."
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }
    for name, desc, props in [
        ("click", "Click a point.", {"x": {"type": "integer"}, "y": {"type": "integer"}}),
        ("answer", "Give the final answer.", {"text": {"type": "string"}}),
    ]
]
CLICK = '<tool_call>\n{"name": "click", "arguments": {"x": 40, "y": 60}}\n</tool_call>'
ANSWER = "The cart holds 3 items."


@dataclass
class Episode:
    rows: Path  # export-sft's output
    shots: list[Image]  # the screenshots the harness sent, in order
    recorded: Sample  # the gateway's training sample of the episode
    first_prompt: list[int]  # the first call's prompt ids, as the gateway gave them to the engine


def image_part(im: Image) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": im.data_url()}}


def observation(im: Image, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [image_part(im), {"type": "text", "text": text}]}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def runs(ids: list[int], token: int) -> list[int]:
    out: list[int] = []
    for i, t in enumerate(ids):
        if t == token:
            if i and ids[i - 1] == token:
                out[-1] += 1
            else:
                out.append(1)
    return out


def trained_text(tokenizer: Any, s: Sample) -> str:
    return str(tokenizer.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]))


@pytest.fixture(scope="module")
def episode(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Episode]:
    """A GUI agent's episode as gui_agent sends it (screenshots as image_url data URLs in user
    messages, one tool call per step), after a few-shot example the rollout did not generate."""
    tmp = tmp_path_factory.mktemp("episode")
    # Different sizes: each image's placeholder run has its own length.
    shots = [screenshot(224, 168, 1), screenshot(280, 196, 2), screenshot(168, 224, 3)]
    answers = iter([CLICK, ANSWER])
    engine = ScriptEngine(tiny_vlm_dir, lambda prompt: next(answers))
    with running_gateway(tiny_vlm_dir, tmp, engine, max_tokens=64) as gw:
        rollout = new_rollout(gw)
        client = OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0)
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            observation(shots[0], "Example task: open the wiki."),
            {"role": "assistant", "content": "I open the wiki."},
            observation(shots[1], "Task: how many items are in the cart?"),
        ]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        [call] = first.choices[0].message.tool_calls or []
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "clicked"},
            observation(shots[2], "The page after the action."),
        ]
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == ANSWER
        rid = rollout["rollout_id"]
        r = httpx.post(f"{gw.url}/admin/rollouts/{rid}/close", json={"reward": 1.0}, headers=gw.admin_headers)
        assert r.status_code == 200, r.text
        calls = calls_of(gw, rid)
        rows = tmp / "rows.jsonl"
        store = str(gw.gateway.core.store.path)
        result = CliRunner().invoke(main, ["export-sft", "--store", store, "--out", str(rows)])
        assert result.exit_code == 0, result.output
    [recorded] = build_samples(calls_from_json({"rollout_id": rid, "calls": calls}), 1.0)
    yield Episode(rows, shots, recorded, calls[0]["prompt_ids"])


def test_exported_image_rows_tokenise_to_what_the_gateway_recorded(
    episode: Episode, tiny_vlm_dir: Path
) -> None:
    [row] = [json.loads(line) for line in episode.rows.read_text().splitlines()]
    assert [m["role"] for m in row["messages"]] == [
        *["system", "user", "assistant", "user", "assistant", "tool", "user", "assistant"]
    ]
    data = load_sft_data(episode.rows, tiny_vlm_dir)
    [s] = data
    gw = episode.recorded
    # The gateway's sample ends with the last sampled token; the template closes the turn with a
    # newline after it, which is not trained on.
    n = len(gw.input_ids)
    assert s.input_ids[:n] == gw.input_ids
    assert s.loss_mask[:n] == gw.loss_mask
    assert len(s.input_ids) - n <= 1 and not any(s.loss_mask[n:])
    assert s.image_digests == gw.image_digests == [im.digest for im in episode.shots]

    processor = load_processor(tiny_vlm_dir)
    assert runs(s.input_ids, processor.image_token_id) == [processor.image_tokens(im) for im in episode.shots]
    # Only the rollout's own answers are trained on; the few-shot example (weight 0) is context.
    assert trained_text(processor.tokenizer, s) == f"{CLICK}<|im_end|>{ANSWER}<|im_end|>"
    assert "I open the wiki." in processor.tokenizer.decode(s.input_ids)

    # The rows' images travel with the samples, byte for byte.
    found = data.image_source([*s.image_digests, "0" * 64])
    assert {d: im.data for d, im in found.items()} == {im.digest: im.data for im in episode.shots}


def test_the_trainer_sees_the_original_pixels_and_sft_lowers_the_loss(
    episode: Episode, tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    processor = load_processor(tiny_vlm_dir)
    data = load_sft_data(episode.rows, processor)
    cfg = SFTConfig(lr=3e-3, epochs=4, batch_size=1, device="cpu")
    trainer = SFTTrainer(tiny_vlm_dir, cfg, image_source=data.image_source)
    batch = trainer.policy.collate(list(data))
    expected = vision_inputs(processor, episode.shots)
    for key in ("pixel_values", "image_grid_thw"):
        assert sha(batch.vision[key]) == sha(expected[key]), key

    summary = trainer.fit(data, tmp_path / "student", progress=False)
    assert summary["steps"] == 4
    assert summary["loss_after"] < summary["loss_before"] - 0.5


def test_a_text_only_student_is_told_to_use_a_vlm(
    episode: Episode, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as err:
        load_sft_data(episode.rows, tiny_model_dir)
    message = str(err.value)
    assert f"{episode.rows}:1:" in message and "3 images" in message
    assert "openforge model init --vision" in message

    out = tmp_path / "student"
    args = ["sft", "--data", str(episode.rows), "--model", str(tiny_model_dir), "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert "openforge model init --vision" in result.output and f"{episode.rows}:1:" in result.output
    assert not out.exists()  # refused before any training


@pytest.mark.parametrize(
    ("part", "error"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "data URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "image"),
        ({"type": "input_audio", "input_audio": {"data": ""}}, "input_audio"),
    ],
)
def test_rows_with_unusable_parts_name_the_row(
    tiny_vlm_dir: Path, tmp_path: Path, part: dict[str, Any], error: str
) -> None:
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A picture."},
        ]
    }
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(ok) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=error) as err:
        load_sft_data(rows, tiny_vlm_dir)
    assert f"{rows}:2:" in str(err.value)


def test_cli_sft_on_image_rows_writes_a_vlm_the_engine_serves(
    episode: Episode, tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText, Qwen2VLForConditionalGeneration

    out = tmp_path / "student"
    args = ["sft", "--data", str(episode.rows), "--model", str(tiny_vlm_dir), "--out", str(out)]
    args += ["--epochs", "3", "--lr", "3e-3", "--batch-size", "1", "--device", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    printed = re.search(r"3 steps on 1 samples: loss ([\d.]+) -> ([\d.]+)", result.output)
    assert printed, result.output

    model = AutoModelForImageTextToText.from_pretrained(out)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    # The processor, tokenizer and chat template came along: the checkpoint tokenises the rows as
    # the student did, so it can be served (and trained on again) as it was.
    processor = load_processor(out)
    assert [processor.image_tokens(im) for im in episode.shots] == [
        load_processor(tiny_vlm_dir).image_tokens(im) for im in episode.shots
    ]
    assert isinstance(renderer_for(out), VisionRenderer)
    data = load_sft_data(episode.rows, out)
    assert [s.input_ids for s in data] == [s.input_ids for s in load_sft_data(episode.rows, tiny_vlm_dir)]
    # Reloaded, it is the trained model: its loss on the rows is the one the command printed last.
    reloaded = SFTTrainer(out, SFTConfig(device="cpu"), image_source=data.image_source)
    assert reloaded.loss(data) == pytest.approx(float(printed[2]), abs=2e-3)
    assert float(printed[2]) < float(printed[1]) - 0.5

    # The engine serves it with the screenshots.
    async def first_action() -> list[int]:
        engine = TransformersEngine(out, max_batch_size=1)
        await engine.start()
        try:
            got = await engine.generate(
                episode.first_prompt, SamplingParams(max_tokens=4, seed=0), images=episode.shots[:2]
            )
        finally:
            await engine.close()
        return got.completion_ids

    assert len(asyncio.run(first_action())) >= 1
