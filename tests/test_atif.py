"""ATIF (Harbor's trajectory format): a rollout recorded by a real gateway (the tiny model's tokenizer,
a scripted engine: a tool call, then the answer) exported with `openforge export-atif`, checked
against our model of the spec (and Harbor's own, where the `harbor` package is importable), and
read back by `openforge sft --data` to the very samples export-sft's rows give; trajectories of
other agents, images and branches, and files the spec refuses.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from openai import OpenAI
from transformers import AutoTokenizer

from openforgerl.atif import ATIF_VERSION, Trajectory, atif_rows, export_atif, load_trajectory
from openforgerl.cli import main
from openforgerl.rl.sft import load_sft_data
from openforgerl.rollouts.trajectory import Sample
from openforgerl.store import CallRow, RolloutRow, Store
from tests.gateway_helpers import ScriptEngine, calls_of, new_rollout, running_gateway
from tests.vlm_helpers import screenshot

TOOL_CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
ANSWER = "The file says 17."
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
FEW_SHOT = "I read files before I answer."  # an assistant turn the harness wrote, not the model


def script(tokenizer: Any) -> Any:
    def answer(prompt: list[int]) -> str:
        text = tokenizer.decode(prompt)
        if "<tools>" not in text:
            return "A title."  # the side request
        return ANSWER if "<tool_response>" in text.rsplit("<|im_start|>", 2)[-2] else TOOL_CALL

    return answer


@dataclass
class Recorded:
    rollout_id: str
    calls: list[dict[str, Any]]  # the admin API's, with their token ids
    atif: Path  # export-atif's folder
    rows: Path  # export-sft's file
    export_output: str
    store: Path


@pytest.fixture(scope="module")
def recorded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    tmp = tmp_path_factory.mktemp("atif")
    engine = ScriptEngine(tiny_model_dir)
    engine.script = script(engine.tokenizer)
    with running_gateway(tiny_model_dir, tmp, engine) as gw:
        rollout = new_rollout(gw, run_id="atif", task_id="read-a")
        client = OpenAI(base_url=rollout["base_url"] + "/v1", api_key=rollout["api_key"], max_retries=0)
        messages: list[Any] = [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "Example: what is in b.txt?"},
            {"role": "assistant", "content": FEW_SHOT},
            {"role": "user", "content": "What does a.txt say?"},
        ]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        [call] = first.choices[0].message.tool_calls or []
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "17"},
        ]
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == ANSWER
        title = [{"role": "user", "content": "Title this conversation."}]
        client.chat.completions.create(model="policy", messages=title)  # type: ignore[arg-type]
        rid = rollout["rollout_id"]
        r = httpx.post(f"{gw.url}/admin/rollouts/{rid}/close", json={"reward": 1.0}, headers=gw.admin_headers)
        assert r.status_code == 200, r.text
        calls = calls_of(gw, rid)
        store = str(gw.gateway.core.store.path)
        out = CliRunner().invoke(main, ["export-atif", "--store", store, "--out", str(tmp / "atif")])
        assert out.exit_code == 0, out.output
        sft = CliRunner().invoke(main, ["export-sft", "--store", store, "--out", str(tmp / "rows.jsonl")])
        assert sft.exit_code == 0, sft.output
    yield Recorded(rid, calls, tmp / "atif", tmp / "rows.jsonl", out.output, Path(store))


def test_a_recorded_rollout_exports_as_an_atif_trajectory(recorded: Recorded) -> None:
    assert f"1 {ATIF_VERSION} trajectories from 1 rollouts" in recorded.export_output
    assert "left out: 1 side request" in recorded.export_output
    assert [p.name for p in (recorded.atif / recorded.rollout_id).iterdir()] == ["trajectory.json"]
    traj = load_trajectory(recorded.atif / recorded.rollout_id / "trajectory.json")
    assert traj.schema_version == "ATIF-v1.7" and traj.session_id == recorded.rollout_id
    assert traj.agent.name == "openforgerl" and traj.agent.tool_definitions == TOOLS
    assert traj.extra == {
        "run_id": "atif",
        "task_id": "read-a",
        "status": "closed",
        "reward": 1.0,
        "branch_id": 0,
    }
    assert [(s.step_id, s.source) for s in traj.steps] == [
        *[(1, "system"), (2, "user"), (3, "agent"), (4, "user"), (5, "agent"), (6, "agent")]
    ]
    copied, acted, answered = traj.steps[2], traj.steps[4], traj.steps[5]
    # The harness's own assistant turn: copied context, no call, no metrics.
    assert copied.message == FEW_SHOT and copied.is_copied_context and copied.metrics is None
    # The tool call and the result that came back for it, linked by the call's id.
    [tool_call] = acted.tool_calls or []
    assert (tool_call.function_name, tool_call.arguments) == ("read_file", {"path": "a.txt"})
    assert acted.observation is not None
    [result] = acted.observation.results
    assert (result.source_call_id, result.content) == (tool_call.tool_call_id, "17")
    assert answered.message == ANSWER and answered.tool_calls is None and answered.observation is None

    # Each agent step is one recorded call, with its exact token ids and logprobs.
    policy_calls = [c for c in recorded.calls if not c["side_request"]]
    for step, call in zip([acted, answered], policy_calls, strict=True):
        assert step.llm_call_count == 1 and step.model_name == call["model"]
        assert step.extra is not None and step.extra["call_id"] == call["call_id"]
        m = step.metrics
        assert m is not None
        assert m.prompt_token_ids == call["prompt_ids"] and m.prompt_tokens == len(call["prompt_ids"])
        assert m.completion_token_ids == call["completion_ids"] and m.logprobs == call["completion_logprobs"]
        assert m.completion_tokens == len(call["completion_ids"]) > 0
    assert traj.final_metrics is not None
    assert traj.final_metrics.total_prompt_tokens == sum(len(c["prompt_ids"]) for c in policy_calls)
    assert traj.final_metrics.total_completion_tokens == sum(len(c["completion_ids"]) for c in policy_calls)
    assert traj.final_metrics.total_steps == 6


def test_harbors_own_models_validate_the_export(recorded: Recorded) -> None:
    """Harbor's pydantic models and validator (the `harbor` package needs Python 3.12 or newer)."""
    models = pytest.importorskip("harbor.models.trajectories")
    validator = pytest.importorskip("harbor.utils.trajectory_validator")
    file = recorded.atif / recorded.rollout_id / "trajectory.json"
    models.Trajectory.model_validate_json(file.read_text())
    checker = validator.TrajectoryValidator()
    assert checker.validate(file), checker.errors


def test_no_token_ids_leaves_the_ids_out(recorded: Recorded, tmp_path: Path) -> None:
    args = ["export-atif", "--store", str(recorded.store), "--out", str(tmp_path), "--no-token-ids"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    traj = load_trajectory(tmp_path / recorded.rollout_id / "trajectory.json")
    for m in [s.metrics for s in traj.steps if s.metrics]:
        assert m.prompt_tokens and m.completion_tokens
        assert m.prompt_token_ids is m.completion_token_ids is m.logprobs is None


def trained(tokenizer: Any, s: Sample) -> str:
    return str(tokenizer.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]))


def test_the_export_trains_as_export_sfts_rows_do(
    recorded: Recorded, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    [from_rows] = load_sft_data(recorded.rows, tokenizer)
    [from_atif] = load_sft_data(recorded.atif, tokenizer)  # a folder: its trajectory*.json
    assert from_atif.input_ids == from_rows.input_ids and from_atif.loss_mask == from_rows.loss_mask
    assert trained(tokenizer, from_atif) == f"{TOOL_CALL}<|im_end|>{ANSWER}<|im_end|>"
    assert FEW_SHOT in tokenizer.decode(from_atif.input_ids)  # context, not trained on
    assert from_atif.rollout_id == recorded.rollout_id

    out = tmp_path / "student"
    file = recorded.atif / recorded.rollout_id / "trajectory.json"
    args = ["sft", "--data", str(file), "--model", str(tiny_model_dir), "--out", str(out), "--epochs", "1"]
    args += ["--device", "cpu"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    found = re.search(r"1 steps on 1 samples: loss ([\d.]+) -> ([\d.]+)", result.output)
    assert found and float(found[2]) < float(found[1]), result.output
    assert (out / "config.json").exists()


def other_agent() -> dict[str, Any]:
    """A trajectory as another agent writes it: a terminal agent (observations without tool calls),
    bare tool definitions, a copied-context step, a non-LLM dispatch and an embedded subagent."""
    sub = {
        "schema_version": "ATIF-v1.7",
        "trajectory_id": "sub-1",
        "agent": {"name": "helper", "version": "1"},
        "steps": [
            {"step_id": 1, "source": "user", "message": "Summarise."},
            {"step_id": 2, "source": "agent", "message": "A summary."},
        ],
    }
    return {
        "schema_version": "ATIF-v1.5",
        "session_id": "run-7",
        "agent": {"name": "terminus-2", "version": "2.0", "tool_definitions": [TOOLS[0]["function"]]},
        "steps": [
            {"step_id": 1, "source": "system", "message": "You drive a terminal."},
            {
                "step_id": 2,
                "source": "user",
                "message": "List the files.",
                "timestamp": "2025-10-16T14:30:00Z",
            },
            {"step_id": 3, "source": "agent", "message": "Earlier: I looked.", "is_copied_context": True},
            {
                "step_id": 4,
                "source": "agent",
                "message": "",
                "reasoning_content": "ls shows them.",
                "tool_calls": [
                    {"tool_call_id": "c1", "function_name": "read_file", "arguments": {"path": "."}},
                ],
                "observation": {
                    "results": [
                        {"source_call_id": "c1", "content": "a.txt"},
                        {"content": [{"type": "text", "text": "$ "}]},
                    ]
                },
                "metrics": {"prompt_tokens": 10, "completion_tokens": 3, "cost_usd": 0.001},
            },
            {"step_id": 5, "source": "agent", "message": "Dispatched.", "llm_call_count": 0},
            {"step_id": 6, "source": "agent", "message": "There is a.txt."},
        ],
        "final_metrics": {"total_prompt_tokens": 10, "total_steps": 6},
        "subagent_trajectories": [sub],
    }


def test_other_agents_trajectories_become_chat_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "job" / "trial" / "agent").mkdir(parents=True)
    file = tmp_path / "job" / "trial" / "agent" / "trajectory.json"
    file.write_text(json.dumps(other_agent()))
    (tmp_path / "job" / "config.json").write_text("{}")  # not a trajectory: not read
    [(where, row), (_, sub)] = list(atif_rows(tmp_path))
    assert where == str(file) and row["rollout_id"] == "run-7"
    assert row["tools"] == TOOLS  # the bare definition, wrapped as chat templates take them
    assert row["messages"] == [
        {"role": "system", "content": "You drive a terminal."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Earlier: I looked.", "weight": 0},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "ls shows them.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "."}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "user", "content": "$ "},  # output no tool call asked for
        {"role": "assistant", "content": "Dispatched.", "weight": 0},
        {"role": "assistant", "content": "There is a.txt."},
    ]
    assert sub["messages"] == [
        {"role": "user", "content": "Summarise."},
        {"role": "assistant", "content": "A summary."},
    ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    main_sample, sub_sample = load_sft_data(file, tokenizer)
    assert "Earlier: I looked." not in trained(tokenizer, main_sample)
    assert "Dispatched." not in trained(tokenizer, main_sample)
    assert "There is a.txt." in trained(tokenizer, main_sample)
    assert trained(tokenizer, sub_sample) == "A summary.<|im_end|>"


def broken(change: str) -> dict[str, Any]:
    doc = other_agent()
    steps = doc["steps"]
    if change == "version":
        doc["schema_version"] = "1.4"
    elif change == "step ids":
        steps[2]["step_id"] = 7
    elif change == "unknown field":
        steps[1]["role"] = "user"
    elif change == "metrics on a user step":
        steps[1]["metrics"] = {"prompt_tokens": 1}
    elif change == "result of no tool call":
        steps[3]["observation"]["results"][0]["source_call_id"] = "c9"
    elif change == "no steps":
        doc["steps"] = []
    elif change == "timestamp":
        steps[1]["timestamp"] = "yesterday"
    elif change == "subagent without id":
        del doc["subagent_trajectories"][0]["trajectory_id"]
    return doc


@pytest.mark.parametrize(
    "change",
    [
        "version",
        "step ids",
        "unknown field",
        "metrics on a user step",
        "result of no tool call",
        "no steps",
        "timestamp",
        "subagent without id",
    ],
)
def test_the_spec_refuses_what_it_refuses(change: str) -> None:
    Trajectory.model_validate(broken(""))
    with pytest.raises(ValueError):
        Trajectory.model_validate(broken(change))


def test_sft_refuses_a_bad_trajectory_naming_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    file = tmp_path / "trajectory.json"
    file.write_text(json.dumps(broken("step ids")))
    out = tmp_path / "student"
    args = ["sft", "--data", str(file), "--model", str(tiny_model_dir), "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert f"{file}: not an ATIF trajectory" in result.output and "step ids run 1, 2, 3" in result.output
    assert not out.exists()  # refused before any training
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trajectory"):
        load_sft_data(tmp_path / "empty", tiny_model_dir)


def _call(
    call_id: int, parent: int | None, branch_id: int, delta: list[Any], answer: str, **kw: Any
) -> CallRow:
    return CallRow(
        rollout_id="ro_img",
        seq=call_id,
        branch_id=branch_id,
        parent_call_id=parent,
        branch_reason="",
        dialect="openai",
        model="policy",
        engine="scripted",
        status="ok",
        error="",
        policy_version=0,
        prompt_prefix_len=0,
        prompt_delta=[1, 2, 3],
        prompt_tokens=3,
        completion_ids=[4, 5],
        completion_logprobs=[-0.1, -0.2],
        finish_reason="stop",
        stop_reason=None,
        sampling_requested={"tools": 0},
        sampling_used={},
        messages_delta=delta,
        response={"role": "assistant", "content": answer},
        parse_errors=[],
        memory={},
        created_at=1_760_000_000.0,
        latency_ms=1.0,
        **kw,
    )


def test_images_and_branches(tmp_path: Path, tiny_vlm_dir: Path) -> None:
    """A screenshot is written beside the trajectory and read back into the row; a second branch of
    the rollout is a trajectory of its own."""
    shot = screenshot(224, 168, 1)

    async def record() -> None:
        store = Store(tmp_path / "gw.db")
        try:
            await store.create_rollout(RolloutRow("ro_img", "run", "task", "h", status="closed", reward=1.0))
            look = {"role": "user", "content": "What is shown?", "images": [shot.digest]}
            await store.record_call(_call(1, None, 0, [look], "Blocks."), [shot])
            await store.record_call(_call(2, None, 1, [{"role": "user", "content": "Again?"}], "Yes."))
            await export_atif(store, tmp_path / "out")
        finally:
            await store.close()

    asyncio.run(record())
    folder = tmp_path / "out" / "ro_img"
    assert sorted(p.name for p in folder.iterdir()) == [
        "images",
        "trajectory.branch-1.json",
        "trajectory.json",
    ]
    traj = load_trajectory(folder / "trajectory.json")
    first = traj.steps[0].message
    assert isinstance(first, list) and [p.type for p in first] == ["image", "text"]
    assert first[0].source is not None and first[0].source.path == f"images/{shot.digest}.png"
    assert (folder / first[0].source.path).read_bytes() == shot.data
    assert load_trajectory(folder / "trajectory.branch-1.json").steps[0].message == "Again?"

    data = load_sft_data(folder / "trajectory.json", tiny_vlm_dir)
    [s] = data
    assert (
        s.image_digests == [shot.digest] and data.image_source([shot.digest])[shot.digest].data == shot.data
    )
