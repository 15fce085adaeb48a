"""RL's baselines (rl/baselines.py): rejection-sampling data and SFT continued for the same compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openforgerl.rl.baselines import (
    SAMPLES_FILE,
    continue_sft,
    matched_sft_steps,
    rejection_sampling_data,
    rl_trained_tokens,
)
from openforgerl.rl.oracle_teacher import OracleTeacherEngine
from openforgerl.rl.sft import load_sft_data, oracle_samples
from openforgerl.rollouts.trajectory import Sample
from openforgerl.tasks import load_tasks


class EveryOtherRollout(OracleTeacherEngine):
    """The oracle teacher in one rollout of a task, a wrong answer at once in the next: each
    task's group of two holds one pass and one failure, whichever runs first."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir, load_tasks("tools-tiny", "train"))
        self.started: dict[str, int] = {}

    def reply(self, prompt: str) -> str:
        if "<tool_response>" not in prompt:  # a rollout's first call
            instruction = self._user_text(prompt)
            self.started[instruction] = self.started.get(instruction, 0) + 1
            if self.started[instruction] % 2 == 0:
                return '<tool_call>\n{"name": "submit", "arguments": {"answer": "none"}}\n</tool_call>'
        return super().reply(prompt)


def _trained_text(engine: OracleTeacherEngine, s: Sample) -> str:
    ids = [i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
    return str(engine.tokenizer.decode(ids))


def test_rejection_sampling_keeps_the_passed_rollouts_samples_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = EveryOtherRollout(tiny_model_dir)
    out = tmp_path / "rft"
    data = rejection_sampling_data(
        tiny_model_dir, out, n_tasks=3, group=2, skip_tasks=400, concurrency=4, progress=False, engine=engine
    )
    assert (len(data.task_ids), data.rollouts, data.passed, len(data)) == (3, 6, 3, 3)
    train = {t.id: t for t in load_tasks("tools-tiny", "train")}
    assert len({train[i].instruction for i in data.task_ids}) == 3  # the engine tells them apart so
    assert all(int(i.rsplit("-", 1)[1]) >= 400 for i in data.task_ids)  # the first 400 skipped
    # One merged sample per passed rollout, one per task: the whole solution (every read, the
    # write, the submit), nothing of a failed rollout's wrong submit.
    solved = []
    for s in data:
        (task,) = [
            train[i] for i in data.task_ids if train[i].instruction in engine.tokenizer.decode(s.input_ids)
        ]
        solved.append(task.id)
        text = _trained_text(engine, s)
        assert text.count("<tool_call>") == len(task.metadata["inputs"]) + 2
        assert '"name": "write_file"' in text and '"answer": "none"' not in text
    assert sorted(solved) == sorted(data.task_ids)
    # Written for SFT as teacher data is, and read back the same.
    loaded = load_sft_data(out / SAMPLES_FILE, tiny_model_dir)
    assert [(s.input_ids, s.loss_mask) for s in loaded] == [(s.input_ids, s.loss_mask) for s in data]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rollouts"], summary["passed"], summary["samples"]) == (6, 3, 3)
    # A rerun of the finished data reads it back: the same samples and counts, no engine started
    # (an engine spec that cannot start would raise).
    again = rejection_sampling_data(
        tiny_model_dir, out, n_tasks=3, group=2, skip_tasks=400, concurrency=4, progress=False, engine="no"
    )
    assert [(s.input_ids, s.loss_mask) for s in again] == [(s.input_ids, s.loss_mask) for s in data]
    assert (again.task_ids, again.summary()) == (data.task_ids, data.summary())
    # Interrupted after its rollouts (no summary yet): a rerun finds every rollout done in the
    # runner's state, none is redone, and the same data comes back.
    (out / "summary.json").unlink()
    again = rejection_sampling_data(
        tiny_model_dir, out, n_tasks=3, group=2, skip_tasks=400, concurrency=4, progress=False, engine=engine
    )
    assert engine.started and max(engine.started.values()) == 2
    assert sorted(s.input_ids for s in again) == sorted(s.input_ids for s in data)


def test_rejection_sampling_with_the_tiny_model_generating(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = rejection_sampling_data(
        tiny_model_dir,
        tmp_path / "rft",
        n_tasks=2,
        group=2,
        max_tokens=24,
        max_turns=2,
        concurrency=4,
        progress=False,
    )
    assert data.rollouts == 4 and 0 <= data.passed <= data.rollouts
    assert len(data) <= data.passed * 2 and all(s.num_loss_tokens > 0 for s in data)
    assert data.summary()["samples"] == len(data)
    assert len((tmp_path / "rft" / SAMPLES_FILE).read_text().splitlines()) == len(data)


def test_sft_continued_for_the_same_compute(tiny_model_dir: Path, tmp_path: Path) -> None:
    teacher = oracle_samples(tiny_model_dir, tmp_path / "teacher", limit=3, concurrency=2, progress=False)
    run = tmp_path / "rl"
    run.mkdir()
    rows = [{"step": 0, "eval/pass@1": 0.1}, {"step": 1, "tokens": 700}, {"step": 2, "tokens": 500}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    budget = rl_trained_tokens(run)
    assert budget == 1200
    mean = sum(len(s.input_ids) for s in teacher) / len(teacher)
    steps = matched_sft_steps(teacher, budget, batch_size=2)
    assert steps == max(1, round(budget / (2 * mean)))
    with pytest.raises(ValueError, match="no SFT samples"):
        matched_sft_steps([], budget, 2)
    summary = continue_sft(
        tiny_model_dir, teacher, tmp_path / "sft2", steps=5, lr=1e-3, batch_size=2, progress=False
    )
    # Exactly the steps asked for, at the constant rate, over passes of the data (3 samples, 2 a step).
    assert summary["steps"] == 5 and summary["loss_after"] < summary["loss_before"]
    lines = [json.loads(x) for x in (tmp_path / "sft2" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    assert {x["lr"] for x in lines} == {1e-3}
    assert [x["sequences"] for x in lines] == [2, 1, 2, 1, 2]
    assert lines[-1]["trained_tokens"] == summary["trained_tokens"] == sum(x["tokens"] for x in lines)
    assert (tmp_path / "sft2" / "config.json").is_file()


@pytest.mark.parametrize(
    ("suite", "split", "limit"),
    [
        ("tools-tiny-reworded", "heldout", 3),  # SFT validation data there (never training data)
        ("tools-tiny-varied", "train", 22),  # the first task of each family in each of 4 wordings
    ],
)
def test_reworded_tasks_are_solved_by_the_oracle_teacher_through_the_gateway(
    tiny_model_dir: Path, tmp_path: Path, suite: str, split: str, limit: int
) -> None:
    """The teacher finds a task by its instruction, however it is worded: every one is solved and
    ends in a submit."""
    chosen = load_tasks(suite, split)[:limit]  # type: ignore[arg-type]
    if suite == "tools-tiny-varied":
        assert {t.metadata.get("wording", 0) for t in chosen} == {0, 1, 2, 3}
    samples = oracle_samples(
        tiny_model_dir, tmp_path / "teacher", tasks=suite, split=split, limit=limit, progress=False
    )
    assert len({s.rollout_id for s in samples}) == limit
    engine = OracleTeacherEngine(tiny_model_dir, [])
    texts = [_trained_text(engine, s) for s in samples]
    assert all('"name": "submit"' in t for t in texts)
    prompts = [engine.tokenizer.decode(s.input_ids) for s in samples]
    for task in chosen:  # a trajectory for each task, in its own sentence
        assert any(task.instruction in p for p in prompts), task.instruction
