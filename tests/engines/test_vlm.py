"""Vision-language models end to end at the tensor level: the tiny Qwen2-VL, the renderer's image
placeholders, token memory with screenshots, the engine's pixels and logprobs against the trainer's,
a GRPO step on image samples with the weights pushed back, and images through the SGLang wire."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from click.testing import CliRunner

from openforgerl.cli import main
from openforgerl.conversation import Message, Tool, ToolCall
from openforgerl.engines.base import EngineError, SamplingParams
from openforgerl.engines.sglang import SGLangEngine
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.images import Image
from openforgerl.rendering import ChatRenderer, TokenMemory, VisionRenderer, renderer_for
from openforgerl.rl.trainer import Policy, Rollout, Trainer, TrainerConfig
from openforgerl.rollouts.trajectory import RecordedCall, Sample, build_samples
from openforgerl.testing.scripted_engine import ScriptedEngine
from openforgerl.vision import image_token_counts, load_processor, unsampleable_token_ids, vision_inputs
from tests.engine_helpers import fake_server, run_sglang, until
from tests.vlm_helpers import screenshot, tiny_vlm

LOGPROB_TOL = 1e-3  # the engine's batched float32 forward against the trainer's, as for text
PAD = "<|image_pad|>"


def user(text: str, *images: Image) -> Message:
    return Message(role="user", content=text, images=list(images))


def runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the runs of `token` in `ids`."""
    out: list[int] = []
    prev = False
    for t in ids:
        if t == token:
            if prev:
                out[-1] += 1
            else:
                out.append(1)
        prev = t == token
    return out


def vision_renderer(model_dir: Path) -> VisionRenderer:
    renderer = renderer_for(model_dir)
    assert isinstance(renderer, VisionRenderer)
    return renderer


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def source(*images: Image) -> Any:
    by = {im.digest: im for im in images}
    return lambda digests: {d: by[d] for d in digests if d in by}


def sample_of(prompt: list[int], images: list[Image], completion: list[int], logprobs: list[float]) -> Sample:
    call = RecordedCall(
        call_id=1,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=logprobs,
        policy_version=0,
        image_digests=[im.digest for im in images],
    )
    [s] = build_samples([call], 0.0)
    return s


def record_forward(model: Any) -> list[dict[str, Any]]:
    """Wrap `model.forward` to keep the vision tensors of every call."""
    seen: list[dict[str, Any]] = []
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen.append({k: kwargs[k].clone() for k in ("pixel_values", "image_grid_thw") if k in kwargs})
        return original(*args, **kwargs)

    model.forward = forward
    return seen


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_dir: Path) -> Iterator[tuple[TransformersEngine, asyncio.AbstractEventLoop]]:
    engine = TransformersEngine(tiny_vlm_dir, max_batch_size=4, batch_wait_ms=20)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    yield engine, loop
    loop.run_until_complete(engine.close())
    loop.close()


def test_model_init_vision_writes_a_loadable_tiny_qwen2_vl(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLForConditionalGeneration

    out = tmp_path / "vlm"
    result = CliRunner().invoke(main, ["model", "init", "--vision", str(out)])
    assert result.exit_code == 0, result.output
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    assert model.config.get_text_config().max_position_embeddings >= 4096
    tok = AutoTokenizer.from_pretrained(out)
    for t in ("<|vision_start|>", "<|vision_end|>", PAD, "<|im_end|>", "<tool_call>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert model.config.image_token_id == tok.convert_tokens_to_ids(PAD)
    assert model.get_input_embeddings().num_embeddings == len(tok)

    # A 640x400 screenshot stays within a few hundred image tokens; the count from its size alone
    # (what the gateway uses) is the count from its processed pixels (what the model gets).
    processor = load_processor(out)
    shot = screenshot(640, 400)
    [n] = image_token_counts(processor, vision_inputs(processor, [shot])["image_grid_thw"])
    assert 16 <= n <= 256 and processor.image_tokens(shot) == n

    # The template renders tools, tool calls, tool results and one placeholder per image.
    tool = Tool(name="click", description="Click a point", parameters={"type": "object", "properties": {}})
    messages = [
        user("Open the cart", shot, screenshot(seed=1)),
        Message(
            role="assistant", content="", tool_calls=[ToolCall(id="c1", name="click", arguments={"x": 1})]
        ),
        Message(role="tool", content="clicked", tool_call_id="c1"),
    ]
    text = renderer_for(out).render(messages, [tool])
    assert text.count(f"<|vision_start|>{PAD}<|vision_end|>") == 2
    assert '"name": "click"' in text and "<tool_call>" in text and "<tool_response>\nclicked" in text


def test_renderer_expands_each_image_to_its_token_count(tiny_vlm_dir: Path, tiny_model_dir: Path) -> None:
    renderer = vision_renderer(tiny_vlm_dir)
    assert isinstance(renderer, VisionRenderer) and renderer.takes_images
    text_renderer = renderer_for(tiny_model_dir)
    assert isinstance(text_renderer, ChatRenderer) and not text_renderer.takes_images

    shots = [screenshot(640, 400, 1), screenshot(100, 60, 2), screenshot(300, 500, 3)]
    plan = TokenMemory(renderer).plan([user("compare these", *shots[:2]), user("and this", shots[2])], [])
    assert plan.images == shots
    grid = vision_inputs(renderer.processor, shots)["image_grid_thw"]
    expected = image_token_counts(renderer.processor, grid)
    assert runs(plan.prompt_ids, renderer.image_token_id) == expected
    assert len(set(expected)) == 3  # three sizes, three counts: the runs are not all alike by chance
    # Text that spells the placeholder cannot smuggle an image run in.
    with pytest.raises(ValueError, match="placeholders"):
        renderer.encode(renderer.render([user(f"see {PAD}", shots[0])], []), shots[:1])


def test_token_memory_extends_across_turns_with_two_screenshots(tiny_vlm_dir: Path) -> None:
    renderer = vision_renderer(tiny_vlm_dir)
    memory = TokenMemory(renderer)
    s1, s2 = screenshot(320, 200, 1), screenshot(320, 200, 2)
    turn1 = [Message(role="system", content="You operate a browser."), user("Step 1", s1)]
    plan1 = memory.plan(turn1, [])
    reply = Message(role="assistant", content="I will click.")
    completion = [*renderer.encode("I will click."), renderer.turn_end_id]
    memory.commit(plan1, 1, completion, reply, turn_end=True)

    turn2 = [*turn1, reply, user("Step 2", s2)]
    plan2 = memory.plan(turn2, [])
    assert plan2.parent is not None and plan2.miss_reason == ""
    assert plan2.prompt_ids[: plan2.prefix_len] == plan1.prompt_ids + completion
    assert plan2.images == [s1, s2]
    # The extension is exactly the fresh encoding of the whole conversation with both images.
    assert plan2.prompt_ids == renderer.encode(renderer.render(turn2, []), [s1, s2])
    assert len(runs(plan2.prompt_ids, renderer.image_token_id)) == 2

    # The same conversation with another first screenshot (same size, so the same ids) is another branch.
    other = memory.plan([turn1[0], user("Step 1", screenshot(320, 200, 9)), reply, user("Step 2", s2)], [])
    assert other.parent is None and "message 1 differs" in other.miss_reason


def test_engine_and_trainer_feed_the_same_pixels_and_agree_on_logprobs(
    vlm_engine: tuple[TransformersEngine, asyncio.AbstractEventLoop], tiny_vlm_dir: Path
) -> None:
    engine, loop = vlm_engine
    renderer = vision_renderer(tiny_vlm_dir)
    shot, late_shot, other_shot = screenshot(320, 200, 4), screenshot(224, 140, 6), screenshot(320, 200, 5)
    image_plan = TokenMemory(renderer).plan([user("Where is the cart?", shot)], [])
    text_plan = TokenMemory(renderer).plan([user("Say hello, then stop.")], [])
    late_plan = TokenMemory(renderer).plan([user("And here?", late_shot)], [])
    engine_seen = record_forward(engine._model)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=3)
    joined = engine.stats["joined"]

    async def batched() -> list[Any]:
        # An image row and a text row prefilled together (left-padded, each with its rope delta) ...
        first = asyncio.gather(
            engine.generate(image_plan.prompt_ids, params, images=image_plan.images),
            engine.generate(text_plan.prompt_ids, SamplingParams(temperature=1.0, max_tokens=40, seed=3)),
        )
        assert await until(lambda: engine.stats["running"] > 0)
        # ... and another image row joining the running batch mid-decode.
        late = await engine.generate(late_plan.prompt_ids, params, images=late_plan.images)
        return [*await first, late]

    image_result, text_result, late_result = loop.run_until_complete(batched())
    assert engine.stats["joined"] > joined
    engine_pixels = [s for s in engine_seen if s]
    assert len(engine_pixels) == 2  # the two prefills with images carried pixels; decode steps none

    policy = Policy(tiny_vlm_dir, lr=1e-3, image_source=source(shot, late_shot, other_shot))
    trainer_seen = record_forward(policy.model)
    cases = [
        (image_plan, [shot], image_result),
        (late_plan, [late_shot], late_result),
        (text_plan, [], text_result),
    ]
    for plan, images, result in cases:
        sample = sample_of(plan.prompt_ids, images, result.completion_ids, result.logprobs)
        n = len(plan.prompt_ids)
        assert policy.sample_logprobs([sample])[0][n:] == pytest.approx(result.logprobs, abs=LOGPROB_TOL)
    trainer_pixels = [s for s in trainer_seen if s]
    assert len(trainer_pixels) == 2
    for seen_by_engine, seen_by_trainer in zip(engine_pixels, trainer_pixels, strict=True):
        for key in ("pixel_values", "image_grid_thw"):
            assert digest(seen_by_engine[key]) == digest(seen_by_trainer[key]), key

    # And both are the model's own: its forward over the whole sequence, positions computed by itself.
    n = len(image_plan.prompt_ids)
    ids = torch.tensor([image_plan.prompt_ids + image_result.completion_ids])
    with torch.no_grad():
        logits = policy.model(
            input_ids=ids,
            mm_token_type_ids=(ids == renderer.image_token_id).int(),
            **vision_inputs(renderer.processor, [shot]),
        ).logits[0, n - 1 : -1]
    reference = logits.log_softmax(-1).gather(-1, ids[0, n:, None]).squeeze(-1).tolist()
    assert reference == pytest.approx(image_result.logprobs, abs=LOGPROB_TOL)

    # The pixels matter: the same ids with another screenshot score the completion differently.
    swapped = sample_of(
        image_plan.prompt_ids, [other_shot], image_result.completion_ids, image_result.logprobs
    )
    elsewhere = policy.sample_logprobs([swapped])[0][n:]
    assert max(abs(a - b) for a, b in zip(elsewhere, image_result.logprobs, strict=True)) > 10 * LOGPROB_TOL


def test_processor_only_tokens_are_never_sampled_and_the_trainer_masks_them_alike(
    vlm_engine: tuple[TransformersEngine, asyncio.AbstractEventLoop], tiny_vlm_dir: Path
) -> None:
    """A sampled <|image_pad|> would break the next prompt's image runs; tilt the model towards
    the processor-only tokens and check the engine never emits one, with the trainer's logprobs
    still equal to the engine's (both mask the same ids)."""
    engine, loop = vlm_engine
    renderer = vision_renderer(tiny_vlm_dir)
    banned = unsampleable_token_ids(engine._model)
    assert renderer.image_token_id in banned and len(banned) >= 3
    shot = screenshot(224, 140, 2)
    plan = TokenMemory(renderer).plan([user("Click the cart.", shot)], [])
    policy = Policy(tiny_vlm_dir, lr=1e-3, image_source=source(shot))

    def tilt(model: Any) -> Any:
        # Output logits + 30 on the banned ids: unmasked, they would take nearly all the mass.
        def hook(_module: Any, _inputs: Any, logits: torch.Tensor) -> torch.Tensor:
            return logits.index_add(
                -1, torch.tensor(banned), torch.full((*logits.shape[:-1], len(banned)), 30.0)
            )

        return model.lm_head.register_forward_hook(hook)

    handles = [tilt(engine._model), tilt(policy.model)]
    try:
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=1)
        result = loop.run_until_complete(engine.generate(plan.prompt_ids, params, images=plan.images))
        assert len(result.completion_ids) > 0 and not set(result.completion_ids) & set(banned)
        sample = sample_of(plan.prompt_ids, [shot], result.completion_ids, result.logprobs)
        n = len(plan.prompt_ids)
        assert policy.sample_logprobs([sample])[0][n:] == pytest.approx(result.logprobs, abs=LOGPROB_TOL)
    finally:
        for h in handles:
            h.remove()


def test_engine_refuses_images_it_cannot_place(
    vlm_engine: tuple[TransformersEngine, asyncio.AbstractEventLoop], tiny_vlm_dir: Path, tiny_model_dir: Path
) -> None:
    engine, loop = vlm_engine
    renderer = vision_renderer(tiny_vlm_dir)
    shot = screenshot(320, 200, 6)
    plan = TokenMemory(renderer).plan([user("look", shot)], [])
    params = SamplingParams(max_tokens=2)
    with pytest.raises(EngineError, match="placeholder"):  # ids expanded for one image, two images given
        loop.run_until_complete(engine.generate(plan.prompt_ids, params, images=[shot, shot]))
    with pytest.raises(EngineError, match="placeholder"):  # placeholders without their image
        loop.run_until_complete(engine.generate(plan.prompt_ids, params))

    text_engine = TransformersEngine(tiny_model_dir)

    async def text_only() -> None:
        await text_engine.start()
        try:
            await text_engine.generate([1, 2, 3], params, images=[shot])
        finally:
            await text_engine.close()

    with pytest.raises(EngineError, match="takes no images"):
        asyncio.run(text_only())


def test_grpo_step_on_image_samples_then_the_engine_serves_the_new_weights(tmp_path: Path) -> None:
    model_dir = tiny_vlm(tmp_path)
    renderer = vision_renderer(model_dir)
    shots = [screenshot(224, 140, 7), screenshot(224, 140, 8)]
    plans = [TokenMemory(renderer).plan([user("Which button?", s)], []) for s in shots]
    engine = TransformersEngine(model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11)

    async def sample_all() -> list[Any]:
        await engine.start()
        return [await engine.generate(p.prompt_ids, params, images=p.images) for p in plans]

    loop = asyncio.new_event_loop()
    try:
        results = loop.run_until_complete(sample_all())
        samples = [
            sample_of(p.prompt_ids, p.images, r.completion_ids, r.logprobs)
            for p, r in zip(plans, results, strict=True)
        ]
        trainer = Trainer(model_dir, TrainerConfig(lr=5e-3), group_size=2, image_source=source(*shots))
        before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
        metrics = trainer.train_step([Rollout("t", 1.0, [samples[0]]), Rollout("t", 0.0, [samples[1]])])
        assert metrics["updated"] is True
        assert metrics["is_weight_min"] == pytest.approx(1.0, abs=1e-2)  # engine and trainer agree
        after = trainer.policy.model.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert any(k.startswith("model.visual.") for k in changed)  # the image tokens were trained through
        assert any(k.startswith("model.language_model.") for k in changed)

        trainer.save(tmp_path / "ckpt", metrics=metrics)
        assert loop.run_until_complete(trainer.push_weights(engine, tmp_path / "ckpt")) == 1
        fresh = loop.run_until_complete(engine.generate(plans[0].prompt_ids, params, images=plans[0].images))
        assert fresh.policy_version == 1
        new = sample_of(plans[0].prompt_ids, plans[0].images, fresh.completion_ids, fresh.logprobs)
        n = len(plans[0].prompt_ids)
        assert trainer.policy.sample_logprobs([new])[0][n:] == pytest.approx(fresh.logprobs, abs=LOGPROB_TOL)
        old = trainer.policy.sample_logprobs([samples[0]])[0][n:]
        assert max(abs(a - b) for a, b in zip(old, results[0].logprobs, strict=True)) > LOGPROB_TOL
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def test_samples_merge_only_across_calls_that_show_the_same_images() -> None:
    def call(i: int, prompt: list[int], digests: list[str]) -> RecordedCall:
        return RecordedCall(i, prompt, [9, 2], [-0.1, -0.2], 0, "stop", image_digests=digests)

    first = call(1, [1, 5, 5, 3], ["a"])
    merged = build_samples([first, call(2, [1, 5, 5, 3, 9, 2, 4, 5, 3], ["a", "b"])], 1.0)
    assert len(merged) == 1 and merged[0].image_digests == ["a", "b"]
    # Same ids, another first screenshot: a new sample with its own images.
    split = build_samples([first, call(2, [1, 5, 5, 3, 9, 2, 4, 5, 3], ["z", "b"])], 1.0)
    assert [s.image_digests for s in split] == [["a"], ["z", "b"]]


def test_sglang_engine_sends_the_images_with_the_token_prompt() -> None:
    scripted = ScriptedEngine(completion=[7, 8])
    shots = [screenshot(64, 64, 1), screenshot(80, 40, 2)]
    with fake_server(scripted) as server:
        result = run_sglang(
            lambda eng: eng.generate([1, 2, 3], SamplingParams(max_tokens=4), images=shots), server.url
        )
        body = server.app.state.fake.requests[-1]
    assert result.completion_ids == [7, 8]
    assert body["image_data"] == [im.data_url() for im in shots]
    assert scripted.last_request is not None and scripted.last_request.images == tuple(shots)
    assert "image_data" not in SGLangEngine("http://x").request_body([1], SamplingParams())


def test_screenshots_through_the_gateway_train_on_the_pixels_the_engine_saw(
    tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    """Two turns of a harness sending screenshots as data URLs: the gateway renders them for the VLM,
    the engine samples, the record names the images, and the trainer's logprobs on the merged sample
    (through the store's images) are the engine's."""
    from openai import OpenAI

    from openforgerl.rollouts.trajectory import calls_from_json
    from tests.gateway_helpers import new_rollout, running_gateway

    s1, s2 = screenshot(224, 140, 21), screenshot(224, 140, 22)

    def shot(text: str, image: Image) -> dict[str, Any]:
        return {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image.data_url()}},
                {"type": "text", "text": text},
            ],
        }

    with running_gateway(tiny_vlm_dir, tmp_path, max_tokens=6) as gw:
        rollout = new_rollout(gw)
        client = OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0)
        messages: list[Any] = [shot("Step 1", s1)]
        first = client.chat.completions.create(model="m", messages=messages)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            shot("Step 2", s2),
        ]
        client.chat.completions.create(model="m", messages=messages)
        r = httpx.get(f"{gw.url}/admin/rollouts/{rollout['rollout_id']}/calls", headers=gw.admin_headers)
        calls = calls_from_json(r.json())
        images = gw.gateway.core.store.images_sync
        assert [list(c.image_digests) for c in calls] == [[s1.digest], [s1.digest, s2.digest]]
        [merged] = build_samples(calls, 1.0)
        assert merged.image_digests == [s1.digest, s2.digest] and len(merged.call_ids) == 2
        policy = Policy(tiny_vlm_dir, lr=1e-3, image_source=images)
        recomputed = policy.sample_logprobs([merged])[0]
    for (start, end), call in zip(merged.completion_spans, calls, strict=True):
        assert recomputed[start:end] == pytest.approx(list(call.completion_logprobs), abs=LOGPROB_TOL)


def test_sft_on_image_samples_reads_their_pixels_through_the_image_source(
    tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data, write_samples

    renderer = vision_renderer(tiny_vlm_dir)
    shot = screenshot(224, 140, 31)
    plan = TokenMemory(renderer).plan([user("Press OK", shot)], [])
    answer = [*renderer.encode("click(10, 20)"), renderer.turn_end_id]
    write_samples([sample_of(plan.prompt_ids, [shot], answer, [0.0] * len(answer))], tmp_path / "sft.jsonl")
    [loaded] = load_sft_data(tmp_path / "sft.jsonl", renderer.tokenizer)
    assert loaded.image_digests == [shot.digest]

    with pytest.raises(ValueError, match="no image source"):
        SFTTrainer(tiny_vlm_dir, SFTConfig()).loss([loaded])
    sft = SFTTrainer(tiny_vlm_dir, SFTConfig(lr=3e-3), image_source=source(shot))
    before = sft.loss([loaded])
    for _ in range(3):
        sft.train_step([loaded])
    assert sft.loss([loaded]) < before - 0.1
