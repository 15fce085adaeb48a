"""Training a real pretrained model: SFT (every weight; LoRA with gradient checkpointing) and one
GRPO step on SmolLM2-135M-Instruct with the embedded trainer, the model generating every turn of
the built-in ReAct harness through the gateway. After the step the engine serves the pushed weights
with the trainer's own logprobs. Marker `real_model` (`make test-real-model`)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from openforgerl.engines.base import SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.rl.loop import TrainOptions, train
from openforgerl.rl.sft import SFTConfig, SFTTrainer, oracle_samples, write_samples
from openforgerl.rl.trainer import Policy, TrainerConfig, Tuning
from openforgerl.rollouts.trajectory import Sample, calls_from_rows
from tests.harness_helpers import recorded_calls, sample_of

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def teacher(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Sample]:
    """The ORACLE teacher's trajectories on 2 tools-tiny train tasks, in SmolLM2's template."""
    return oracle_samples(
        smollm2_dir,
        tmp_path_factory.mktemp("teacher"),
        limit=2,
        concurrency=2,
        progress=False,
        harness="react",
    )


@pytest.mark.parametrize(
    "tuning",
    [Tuning(), Tuning(lora_rank=16, gradient_checkpointing=True)],
    ids=["full", "lora-checkpointed"],
)
def test_one_sft_step_lowers_the_loss(
    smollm2_dir: Path, teacher: list[Sample], tuning: Tuning, tmp_path: Path
) -> None:
    sft = SFTTrainer(smollm2_dir, SFTConfig(lr=5e-5 if not tuning.lora else 1e-3, epochs=1, tuning=tuning))
    taught = sft.policy.tokenizer.decode(
        [i for i, m in zip(teacher[0].input_ids, teacher[0].loss_mask, strict=True) if m]
    )
    assert "<tool_call>" in taught and "<|im_end|>" in taught  # its template's own tool-call format
    t0 = time.monotonic()
    summary = sft.fit(teacher, tmp_path / "sft", progress=False)
    tokens = sum(len(s.input_ids) for s in teacher)
    print(
        f"\nSFT {tuning}: loss {summary['loss_before']:.3f} -> {summary['loss_after']:.3f}, "
        f"{tokens} tokens, {time.monotonic() - t0:.1f} s with the loss passes and the save"
    )
    assert summary["steps"] == 1 and summary["loss_after"] < summary["loss_before"]
    trainable = sum(p.numel() for p in sft.policy.model.parameters() if p.requires_grad)
    assert trainable == (134_515_008 if not tuning.lora else 4_884_480)
    # A plain checkpoint either way (LoRA merged): the engine loads it as it loads any model.
    config = json.loads((tmp_path / "sft" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and not (tmp_path / "sft" / "adapter_config.json").exists()


def test_a_grpo_step_with_the_model_generating_and_the_engine_serving_the_trainers_logprobs(
    smollm2_dir: Path, teacher: list[Sample], tmp_path: Path
) -> None:
    write_samples(teacher, tmp_path / "ptx.jsonl")
    run = tmp_path / "run"
    opts = TrainOptions(
        model=str(smollm2_dir),
        out=run,
        harness="react",
        skip_tasks=2,
        steps=1,
        group=2,
        batch_tasks=1,
        max_tokens=48,
        max_turns=2,
        concurrency=2,
        progress=False,
        ptx_data=str(tmp_path / "ptx.jsonl"),
        # The ptx term moves the weights whatever the two rewards were.
        trainer=TrainerConfig(lr=1e-5, ptx_coef=1.0, ptx_batch=2, drop_zero_variance=False),
    )
    done = train(opts)
    assert done["steps"] == 1 and done["policy_version"] == 1
    [metrics] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics["rollouts"] == 2
    rows = [r for r in recorded_calls(run / "gateway.db") if r.status == "ok"]
    assert rows and {r.policy_version for r in rows} == {0}
    assert any(lp < -1e-3 for r in rows for lp in r.completion_logprobs)  # sampled by the model

    checkpoint = run / "checkpoints" / "step-000001"
    prompt = max((list(c.prompt_ids) for c in calls_from_rows(rows)), key=len)
    engine = TransformersEngine(checkpoint)

    async def generate() -> Any:
        await engine.start()
        try:
            return await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, seed=3))
        finally:
            await engine.close()

    result = asyncio.run(generate())
    new = sample_of(prompt, list(result.completion_ids), list(result.logprobs))
    trained = Policy(checkpoint, lr=0.0).sample_logprobs([new])[0][len(prompt) :]
    worst = max(abs(a - b) for a, b in zip(trained, result.logprobs, strict=True))
    print(
        f"\nengine vs trainer after the GRPO step: max |logprob diff| {worst:.2e} over {len(trained)} tokens"
    )
    assert worst < 1e-4
    before = Policy(smollm2_dir, lr=0.0).sample_logprobs([new])[0][len(prompt) :]
    assert max(abs(a - b) for a, b in zip(before, result.logprobs, strict=True)) > 1e-4  # the step moved them
