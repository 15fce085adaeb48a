"""The veRL integration on CPU: our agent loop built and run by veRL's own AgentLoopWorker.

No GPU and no vLLM: veRL's server manager is replaced by a FAKE (`FakeServerManager`) that answers
from the kit's tiny local model, so every id and logprob the loop returns was really produced by a
model: sampled by the built-in transformers engine, or (oracle mode) chosen by the tools-tiny
oracle and scored by the tiny model in one forward pass. Everything else is real: veRL's config
composition and validation, its RLHFDataset over our rows, its AgentLoopWorker instantiating the
loop through the registry with hydra, our gateway, runner, bubblewrap sandbox, ReAct harness,
verifier and trajectory builder.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, AgentLoopWorker, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

from openforgerl.engines.base import EngineError, SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine
from openforgerl.integrations.verl import agent_loop as loop_module
from openforgerl.integrations.verl.agent_loop import OpenForgeAgentLoop, RolloutInfraError
from openforgerl.integrations.verl.data import dataset_rows, task_from_row, task_row, write_rows
from openforgerl.integrations.verl.engine import StickyRequestIds, VerlServerEngine
from openforgerl.integrations.verl.launch import CONFIG_DIR, launch_command, main_ppo_command
from openforgerl.integrations.verl.samples import split_sample
from openforgerl.rl.oracle_teacher import OracleTeacherEngine
from openforgerl.rl.prompt_tools import text_reply
from openforgerl.rollouts.trajectory import RecordedCall, build_samples
from openforgerl.tasks import Task, load_tasks
from openforgerl.tasks.suites.tools_tiny import verify_answer

TASKS = load_tasks("tools-tiny", split="train")[:2]
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
TRAIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


# -- the FAKE server manager ---------------------------------------------------------------
@dataclass
class FakeCall:
    request_id: str
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    token_ids: list[int]
    log_probs: list[float]


class FakeServerManager:
    """A FAKE of veRL's LLMServerClient, for CPU tests only (never a product path).

    `generate(request_id, prompt_ids=..., sampling_params=...) -> TokenOutput` like veRL's. Sampled
    mode: the tiny model samples the ids (TransformersEngine). Oracle mode (`tasks` given): the
    tools-tiny oracle picks the ids, so a rollout solves its task (or, for tasks in `wrong`, writes
    a wrong answer), and the tiny model scores them: the logprobs are its real log-probabilities
    of those ids, from one forward pass.
    """

    def __init__(
        self, model_dir: Path, tasks: Sequence[Task] = (), wrong: Sequence[str] = (), global_steps: int = 3
    ) -> None:
        self.model_dir = model_dir
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self.global_steps = global_steps
        self.wrong = set(wrong)
        self.calls: list[FakeCall] = []
        self.written: dict[str, str] = {}  # task instruction -> what the policy wrote to answer.txt
        self.oracle = OracleTeacherEngine(model_dir, tasks) if tasks else None
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.engine: TransformersEngine | None = None

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        assert not kwargs, kwargs
        sampling = SamplingParams(
            temperature=sampling_params["temperature"],
            top_p=sampling_params["top_p"],
            max_tokens=sampling_params["max_tokens"],
            stop_token_ids=tuple(sampling_params.get("stop_token_ids", ())),
        )
        if self.oracle is None:
            if self.engine is None:
                self.engine = TransformersEngine(self.model_dir, device="cpu")
                await self.engine.start()
            result = await self.engine.generate(prompt_ids, sampling)
            ids, logprobs = result.completion_ids, result.logprobs
        else:
            ids = self._oracle_ids(prompt_ids, sampling)
            logprobs = self.score(prompt_ids, ids)
        self.calls.append(FakeCall(request_id, list(prompt_ids), dict(sampling_params), ids, logprobs))
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _oracle_ids(self, prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        assert self.oracle is not None
        prompt = self.tokenizer.decode(prompt_ids)
        text = self.oracle.reply(prompt)
        instruction = self.oracle._user_text(prompt)
        match = TOOL_CALL.search(text)
        call = json.loads(match.group(1)) if match else {}
        if call.get("name") == "write_file" and instruction in self.wrong:
            call["arguments"]["content"] += "0"
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        reply = text_reply(self.tokenizer, self.oracle.end_id, text, sampling, 0)
        if call.get("name") == "write_file" and reply.finish_reason == "stop":  # not cut by max_tokens
            self.written[instruction] = call["arguments"]["content"]
        return reply.completion_ids

    @torch.no_grad()
    def score(self, prompt_ids: list[int], ids: list[int]) -> list[float]:
        logits = self.model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs[torch.arange(len(ids)), torch.tensor(ids)].tolist()

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


# -- helpers --------------------------------------------------------------------------------
def verl_config(model_dir: Path, *overrides: str) -> DictConfig:
    """The shipped config, composed on veRL's own defaults exactly as veRL's main composes it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(
            "qwen3_grpo",
            overrides=[
                "data.train_files=unused.parquet",
                "data.val_files=unused.parquet",
                "trainer.n_gpus_per_node=1",
                f"actor_rollout_ref.model.path={model_dir}",
                "openforge.max_tokens=24",
                "openforge.max_turns=6",
                *overrides,
            ],
        )


class FakeTransferQueue(types.ModuleType):
    """A FAKE of the `transfer_queue` package (not installed here): keeps what veRL's V1 worker puts."""

    def __init__(self) -> None:
        super().__init__("transfer_queue")
        self.puts: list[dict[str, Any]] = []

    def init(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def async_kv_batch_put(
        self, keys: list[str], fields: Any, tags: list[dict[str, Any]], partition_id: str
    ) -> None:
        self.puts.append({"keys": keys, "fields": fields, "tags": tags, "partition_id": partition_id})


@pytest.fixture(scope="module")
def v1_worker() -> Iterator[tuple[type, FakeTransferQueue]]:
    """veRL's V1 agent-loop worker (AgentLoopWorkerTQ, unwrapped from ray.remote) over a fake queue.

    Its module is loaded from its file: the `verl.trainer.ppo.v1` package imports the whole trainer
    (torchdata, GPUs), which this path does not need.
    """
    queue = FakeTransferQueue()
    saved = sys.modules.get("transfer_queue")
    sys.modules["transfer_queue"] = queue
    try:
        path = Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "agent_loop_tq.py"
        spec = importlib.util.spec_from_file_location("_openforge_test_verl_agent_loop_tq", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["transfer_queue"]
        else:
            sys.modules["transfer_queue"] = saved
    tq_worker = module.AgentLoopWorkerTQ.__ray_metadata__.modified_class

    class CapturingWorker(tq_worker):  # type: ignore[misc,valid-type]
        """Also keeps the raw outputs the loop returned, before veRL's V1 postprocessing."""

        captured: list[Any]

        async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
            self.captured.append(output)
            return await super()._agent_loop_postprocess(output, validate, **kwargs)

    yield CapturingWorker, queue


def as_client(fake: FakeServerManager) -> Any:
    """The fake where veRL's types ask for an LLMServerClient."""
    return fake


def dataset(rows: list[dict[str, Any]], path: Path, config: DictConfig) -> RLHFDataset:
    write_rows(rows, path)
    tokenizer: Any = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    return RLHFDataset(str(path), tokenizer, config.data)


async def run_row(worker: AgentLoopWorker, item: dict[str, Any], session: int = 0) -> Any:
    """One dataset item through veRL's own `_run_agent_loop` (hydra instantiation via the registry)."""
    trajectory = {"step": 1, "sample_index": item["index"], "rollout_n": session, "validate": False}
    return await worker._run_agent_loop(
        dict(TRAIN_SAMPLING), trajectory, trace=False, uid=f"uid{item['index']}", session_id=session,
        global_steps=1, **item,
    )  # fmt: skip


def recorded(rollout_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway's record of a rollout and of its calls (admin API)."""
    [gw] = loop_module.worker_gateways()
    headers = {"authorization": f"Bearer {gw.admin_token}"}
    with httpx.Client(base_url=gw.url, headers=headers) as client:
        row = client.get(f"/admin/rollouts/{rollout_id}").raise_for_status().json()
        calls = client.get(f"/admin/rollouts/{rollout_id}/calls").raise_for_status().json()
    return row, calls


def expected_sequence(calls: list[dict[str, Any]]) -> tuple[list[int], list[int], list[float]]:
    """Ids, mask and logprobs of one merged sequence, from the recorded calls themselves."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for c in calls:
        assert c["prompt_ids"][: len(ids)] == ids, "each call continues the previous one"
        delta = c["prompt_ids"][len(ids) :]
        ids += delta + c["completion_ids"]
        mask += [0] * len(delta) + [1] * len(c["completion_ids"])
        logprobs += [0.0] * len(delta) + c["completion_logprobs"]
    return ids, mask, logprobs


def check_against_record(out: AgentLoopOutput, fake: FakeServerManager) -> dict[str, Any]:
    """The output is the merged sequence the gateway recorded, token for token; returns the calls."""
    info = out.extra_fields["openforge"]
    _, payload = recorded(info["rollout_id"])
    calls = payload["calls"]
    ids, mask, logprobs = expected_sequence(calls)
    first = mask.index(1)
    assert out.prompt_ids == ids[:first] == calls[0]["prompt_ids"]
    assert out.response_ids == ids[first:]
    assert out.response_mask == mask[first:]
    assert len(out.response_logprobs or []) == len(out.response_ids)
    assert out.response_logprobs == pytest.approx(logprobs[first:], abs=1e-6)
    # What the gateway recorded is what veRL's server manager (the fake) sampled, for the same prompts.
    mine = [c for c in fake.calls if c.prompt_ids in [x["prompt_ids"] for x in calls]]
    assert [c.token_ids for c in mine] == [x["completion_ids"] for x in calls]
    sampled = [lp for c in mine for lp in c.log_probs]
    assert [lp for lp, m in zip(out.response_logprobs or [], out.response_mask, strict=True) if m] == (
        pytest.approx(sampled, abs=1e-6)
    )
    assert out.num_turns == len(calls)
    assert out.extra_fields["min_global_steps"] == out.extra_fields["max_global_steps"] == fake.global_steps
    return payload


@pytest.fixture()
def gateways() -> Iterator[None]:
    yield
    loop_module.close_worker_gateways()


# -- registration, config, data -------------------------------------------------------------
def test_entry_point_registers_the_loop_when_verl_is_imported() -> None:
    [ep] = [e for e in entry_points(group="verl.plugins") if e.name == "openforge"]
    assert ep.value == "openforgerl.integrations.verl.plugin"  # which imports the agent loop
    target = "openforgerl.integrations.verl.agent_loop.OpenForgeAgentLoop"
    assert f"{OpenForgeAgentLoop.__module__}.{OpenForgeAgentLoop.__qualname__}" == target
    assert _agent_loop_registry["openforge"] == {"_target_": target}
    # In a fresh process nothing but veRL's own plugin discovery imports our module.
    probe = (
        "import sys, verl; from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r; "
        "print('openforgerl.integrations.verl.agent_loop' in sys.modules, r['openforge']['_target_'])"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", target], done.stderr


def test_shipped_config_composes_on_verl_defaults_and_passes_its_validation(tiny_model_dir: Path) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    config = verl_config(tiny_model_dir)
    assert config.algorithm.adv_estimator == "grpo"
    assert config.trainer.use_v1 is True
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.name, rollout.mode, rollout.agent.default_agent_loop) == ("vllm", "async", "openforge")
    assert (rollout.prompt_length, rollout.response_length) == (1024, 3072)  # from data.*_length
    assert config.openforge.harness == "react"
    with pytest.warns(UserWarning, match="Disabled critic"):
        validate_config(
            config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )

    command = main_ppo_command("qwen3_grpo", ["trainer.total_training_steps=2"], python="python")
    assert command == [
        "python", "-m", "verl.trainer.main_ppo", f"--config-path={CONFIG_DIR}", "--config-name=qwen3_grpo",
        "trainer.total_training_steps=2",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="neither a YAML file nor a shipped config"):
        main_ppo_command("no-such-config", [])


def _compose(name: str, model_dir: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(
            name,
            overrides=[
                "data.train_files=unused.jsonl",
                "data.val_files=unused.jsonl",
                f"actor_rollout_ref.model.path={model_dir}",
            ],
        )


def test_cpu_and_gpu_configs_share_the_recipe_and_differ_only_by_device(tiny_model_dir: Path) -> None:
    """`cpu_grpo` and `qwen3_grpo` compose the same recipe (config/recipe/grpo.yaml); what differs is
    the device side the README's table lists."""
    from omegaconf import OmegaConf

    gpu, cpu = _compose("qwen3_grpo", tiny_model_dir), _compose("cpu_grpo", tiny_model_dir)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        recipe = compose("recipe/grpo")
    shared = (
        "algorithm.adv_estimator",
        "algorithm.norm_adv_by_std_in_grpo",
        "actor_rollout_ref.actor.loss_agg_mode",
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        "actor_rollout_ref.rollout.calculate_log_probs",
        "trainer.use_v1",
        "openforge.harness",
        "openforge.on_failure",
        "openforge.reward",
    )
    for key in shared:
        want = OmegaConf.select(recipe, key)
        assert OmegaConf.select(gpu, key) == want == OmegaConf.select(cpu, key), key
    assert (gpu.actor_rollout_ref.rollout.name, cpu.actor_rollout_ref.rollout.name) == ("vllm", "openforge")
    assert (gpu.openforge.device, cpu.openforge.device) == (None, "cpu")
    assert cpu.actor_rollout_ref.model.use_remove_padding is False
    assert cpu.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert cpu.actor_rollout_ref.actor.strategy == "fsdp2"
    assert cpu.ray_kwargs.ray_init.num_gpus == cpu.trainer.n_gpus_per_node == 1

    # The launcher: the CPU config runs in a network namespace with the CPU platform's environment.
    command, env = launch_command("cpu_grpo", ["x=1"], python="python")
    assert command[0].endswith("unshare") and "--net" in command and "--pid" in command
    assert command[command.index("--") + 1 :][:4] == [
        "python",
        "-m",
        "openforgerl.integrations.verl.netns",
        "--",
    ]
    assert command[-3:] == ["--config-path=" + str(CONFIG_DIR), "--config-name=cpu_grpo", "x=1"]
    assert env["VERL_PLATFORM"] == "cpu" and env["VERL_ENGINE_DEVICE"] == "cuda"
    assert launch_command("qwen3_grpo", [], python="python") == (
        main_ppo_command("qwen3_grpo", [], "python"),
        {},
    )
    assert launch_command("qwen3_grpo", ["openforge.device=cpu"], python="python")[1] == env
    with pytest.raises(ValueError, match="the launcher knows 'cpu'"):
        launch_command("qwen3_grpo", ["openforge.device=tpu"])


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dataset_rows_load_in_verl_rlhf_dataset(tiny_model_dir: Path, tmp_path: Path, suffix: str) -> None:
    config = verl_config(tiny_model_dir)
    rows = dataset_rows("tools-tiny", "train", limit=3)
    data = dataset(rows, tmp_path / f"train{suffix}", config)
    assert len(data) == 3
    item = data[1]
    assert item["agent_name"] == "openforge"
    assert item["index"] == 1
    assert item["raw_prompt"] == [{"role": "user", "content": TASKS[1].instruction}]
    assert task_from_row(item["extra_info"]) == TASKS[1]
    # A hand-written row may name the task instead of carrying it.
    assert task_from_row({"tasks": "tools-tiny", "task_id": TASKS[0].id}) == TASKS[0]
    with pytest.raises(ValueError, match="names no task"):
        task_from_row({"index": 0})
    with pytest.raises(ValueError, match=r"\.parquet or \.jsonl"):
        write_rows(rows, tmp_path / "train.csv")


# -- conversion and routing ------------------------------------------------------------------
def test_split_sample_masks_sampled_tokens_and_cuts_to_verls_limits() -> None:
    calls = [
        RecordedCall(1, [1, 2, 3, 4], [10, 11], [-0.1, -0.2], policy_version=5),
        RecordedCall(2, [1, 2, 3, 4, 10, 11, 20, 21, 22], [12, 13, 14], [-0.3, -0.4, -0.5], policy_version=6),
    ]
    [sample] = build_samples(calls, 1.0)
    seq = split_sample(sample, prompt_length=8, response_length=16)
    assert seq is not None and not seq.truncated
    assert seq.prompt_ids == [1, 2, 3, 4]
    assert seq.response_ids == [10, 11, 20, 21, 22, 12, 13, 14]
    assert seq.response_mask == [1, 1, 0, 0, 0, 1, 1, 1]
    assert seq.response_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4, -0.5]

    cut = split_sample(sample, prompt_length=3, response_length=4)
    assert cut is not None
    assert (cut.prompt_ids, cut.prompt_truncated) == ([2, 3, 4], 1)  # the oldest prompt tokens go
    # Four tokens would end inside the tool output: the response ends on its last sampled token.
    assert (cut.response_ids, cut.response_mask, cut.response_truncated) == ([10, 11], [1, 1], 6)
    assert cut.truncated


def test_sticky_request_ids_follow_a_conversation_and_only_it() -> None:
    routes = StickyRequestIds(capacity=2)
    first = routes.route([1, 2, 3])
    routes.remember(first, [4, 5])
    nxt = routes.route([1, 2, 3, 4, 5, 6, 7])  # the next turn: prompt + completion + tool output
    assert nxt.continued and nxt.request_id == first.request_id
    assert not routes.route([1, 2, 3, 9]).continued  # a different conversation from the same start
    routes.remember(nxt, [8])
    other = routes.route([7, 7])
    routes.remember(other, [7])
    assert len(routes) == 2  # the oldest tip is forgotten beyond capacity
    assert routes.route([1, 2, 3, 4, 5, 6, 7, 8, 9]).request_id == first.request_id


def test_engine_speaks_verls_token_output_and_cancels_on_the_managers_loop() -> None:
    class Manager:
        """A scripted stand-in for veRL's server manager: each call pops the next reply."""

        def __init__(self, replies: list[TokenOutput | None]) -> None:
            self.replies = replies
            self.params: list[dict[str, Any]] = []
            self.entered = asyncio.Event()
            self.cancelled = False

        async def generate(
            self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
        ) -> Any:
            self.params.append(sampling_params)
            reply = self.replies.pop(0)
            if reply is None:  # hang until cancelled
                self.entered.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled = True
                    raise
            return reply

    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, stop_token_ids=(7,))

    async def go() -> None:
        manager = Manager(
            [
                TokenOutput(token_ids=[5, 7], log_probs=[-1.0, -2.0], stop_reason="completed",
                            extra_fields={"global_steps": 5}),
                TokenOutput(token_ids=[5, 6, 8], log_probs=[-1.0] * 3, stop_reason="completed"),
                TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted"),
                TokenOutput(token_ids=[5], log_probs=None, stop_reason="completed"),
                None,
            ]
        )  # fmt: skip
        engine = VerlServerEngine(
            manager, asyncio.get_running_loop(), max_context=64, base_params={"top_k": 20}
        )
        stop = await engine.generate([1, 2], sampling)
        assert (stop.completion_ids, stop.finish_reason, stop.stop_reason) == ([5, 7], "stop", 7)
        assert stop.logprobs == [-1.0, -2.0] and stop.policy_version == engine.policy_version == 5
        assert manager.params[0] == {
            "top_k": 20, "temperature": 0.7, "top_p": 0.9, "max_tokens": 3, "logprobs": True,
            "stop_token_ids": [7],
        }  # fmt: skip
        assert (await engine.generate([1, 2], sampling)).finish_reason == "length"
        assert (await engine.generate([1, 2], sampling)).finish_reason == "abort"
        with pytest.raises(EngineError, match="calculate_log_probs"):
            await engine.generate([1, 2], sampling)
        pending = asyncio.ensure_future(engine.generate([1, 2], sampling))
        await manager.entered.wait()
        pending.cancel()  # the harness went away: veRL's request is cancelled too
        with pytest.raises(asyncio.CancelledError):
            await pending
        await asyncio.sleep(0)
        assert manager.cancelled

    asyncio.run(go())


# -- end to end through veRL's AgentLoopWorker ------------------------------------------------
def test_v1_rollout_sampled_by_the_tiny_model(
    tiny_model_dir: Path, tmp_path: Path, gateways: None, v1_worker: tuple[type, FakeTransferQueue]
) -> None:
    worker_class, queue = v1_worker
    config = verl_config(tiny_model_dir)
    data = dataset(dataset_rows("tools-tiny", "train", limit=1), tmp_path / "train.jsonl", config)
    fake = FakeServerManager(tiny_model_dir)

    async def go() -> list[Any]:
        worker = worker_class(config, llm_client=fake)
        worker.captured = []
        try:
            await run_row(worker, data[0])
        finally:
            await fake.close()
        return worker.captured

    [outputs] = asyncio.run(go())
    assert isinstance(outputs, list) and outputs, "V1: a list of AgentLoopOutput"
    out = outputs[0]
    payload = check_against_record(out, fake)
    # veRL's sampling reached its server manager; the gateway's max_tokens cap too.
    assert {c.sampling_params["max_tokens"] for c in fake.calls} == {24}
    assert all(c.sampling_params["logprobs"] is True and c.sampling_params["top_k"] == -1 for c in fake.calls)
    row, _ = recorded(payload["rollout_id"])
    assert out.reward_score == row["reward"] == 0.0  # a random model does not solve the task
    assert out.extra_fields["reward_extra_info"] == {"score": 0.0, "truncated": 0.0}
    # What veRL's V1 worker put into TransferQueue for the trainer: one key per output.
    put = queue.puts[-1]
    assert put["keys"] == [f"uid0_0_{i}" for i in range(len(outputs))] and put["partition_id"] == "train"
    tag = put["tags"][0]
    assert tag["status"] == "success" and tag["min_global_steps"] == fake.global_steps
    assert (tag["prompt_len"], tag["response_len"]) == (len(out.prompt_ids), len(out.response_ids))
    fields = put["fields"]
    assert fields["responses"][0].tolist() == out.response_ids
    assert fields["loss_mask"][0].tolist() == out.response_mask
    assert fields["rollout_log_probs"][0].tolist() == pytest.approx(out.response_logprobs)
    assert fields["rm_scores"][0][-1] == out.reward_score  # the reward on the last response token


def test_v1_multi_turn_rollouts_masks_logprobs_and_rewards(
    tiny_model_dir: Path, tmp_path: Path, gateways: None, v1_worker: tuple[type, FakeTransferQueue]
) -> None:
    worker_class, queue = v1_worker
    config = verl_config(tiny_model_dir, "openforge.max_tokens=128")  # room for the oracle's tool calls
    data = dataset(dataset_rows("tools-tiny", "train", limit=2), tmp_path / "train.parquet", config)
    fake = FakeServerManager(tiny_model_dir, TASKS, wrong=[TASKS[1].instruction])

    async def go() -> list[Any]:
        worker = worker_class(config, llm_client=fake)
        worker.captured = []
        # Two loops at once in one worker process: they share its one gateway.
        await asyncio.gather(run_row(worker, data[0]), run_row(worker, data[1]))
        return worker.captured

    captured = asyncio.run(go())
    assert len(loop_module.worker_gateways()) == 1
    by_task = {outs[0].extra_fields["openforge"]["task_id"]: outs for outs in captured}
    for task in TASKS:
        [out] = by_task[task.id]  # one merged sample: every call extended the previous one
        payload = check_against_record(out, fake)
        calls = payload["calls"]
        assert len(calls) >= 3  # read the inputs, write the answer, submit
        # Tool results sit inside the response with mask 0: the tokens the policy did not sample.
        unsampled = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if not m]
        assert "<tool_response>" in fake.tokenizer.decode(unsampled)
        # The reward is the verifier's verdict on what the policy wrote.
        written = fake.written[task.instruction]
        scratch = tmp_path / task.id
        scratch.mkdir()
        (scratch / "answer.txt").write_text(written)
        verdict = verify_answer(scratch, **task.verifier.kwargs)  # type: ignore[union-attr]
        row, _ = recorded(out.extra_fields["openforge"]["rollout_id"])
        assert out.reward_score == verdict["reward"] == row["reward"]
        assert out.extra_fields["reward_extra_info"]["score"] == verdict["reward"]
        # veRL's sticky routing: every turn of a conversation went to the same request id.
        ids = {c.request_id for c in fake.calls if c.prompt_ids in [x["prompt_ids"] for x in calls]}
        assert len(ids) == 1
    assert by_task[TASKS[0].id][0].reward_score == 1.0
    assert by_task[TASKS[1].id][0].reward_score == 0.0
    assert {key for put in queue.puts[-2:] for key in put["keys"]} == {"uid0_0_0", "uid1_0_0"}


def test_legacy_trainer_pads_within_verls_limits(
    tiny_model_dir: Path, tmp_path: Path, gateways: None
) -> None:
    config = verl_config(
        tiny_model_dir,
        "trainer.use_v1=false",
        "data.max_prompt_length=64",
        "data.max_response_length=40",
        "actor_rollout_ref.rollout.max_model_len=4096",
        "openforge.max_tokens=128",
    )
    data = dataset(dataset_rows("tools-tiny", "train", limit=1), tmp_path / "train.jsonl", config)
    fake = FakeServerManager(tiny_model_dir, TASKS)

    async def go() -> Any:
        return await run_row(AgentLoopWorker(config, llm_client=as_client(fake)), data[0])

    out = asyncio.run(go())  # veRL's own padding of one AgentLoopOutput
    assert out.prompt_ids.shape == (1, 64) and out.response_ids.shape == (1, 40)
    assert out.input_ids.shape == out.attention_mask.shape == (1, 104)
    mask = out.response_mask[0]
    assert mask[0] == 1 and int(mask.sum()) > 0
    real = int(out.attention_mask[0, 64:].sum())  # the response's own tokens, then padding
    assert mask[real - 1] == 1 and not mask[real:].any()  # the cut response ends on a sampled token
    assert (out.response_logprobs[0][mask == 0] == 0).all()
    info = out.extra_fields["openforge"]
    assert info["prompt_truncated"] > 0 and info["response_truncated"] > 0
    assert out.reward_score == 1.0 and out.extra_fields["reward_extra_info"]["truncated"] == 1.0


def test_infrastructure_failure_raises_for_verl(tiny_model_dir: Path, tmp_path: Path, gateways: None) -> None:
    # The loop raises; veRL's V1 worker then marks the prompt's group as failed. The loop is declared
    # in an agent_loop_config_path file this time: its keys are the loop's options (they win).
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(f"- name: openforge\n  _target_: {OpenForgeAgentLoop.__module__}.OpenForgeAgentLoop\n"
                     "  infra_retries: 0\n")  # fmt: skip
    config = verl_config(
        tiny_model_dir,
        "openforge.infra_retries=3",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
    )
    broken = TASKS[0].model_copy(update={"setup": ["exit 3"]})
    row = task_row(broken, 0, "tools-tiny")
    fake = FakeServerManager(tiny_model_dir, TASKS)
    item = {**row, "raw_prompt": row["prompt"], "index": 0}

    async def go() -> Any:
        return await run_row(AgentLoopWorker(config, llm_client=as_client(fake)), item)

    registered = dict(_agent_loop_registry)
    try:
        with pytest.raises(RolloutInfraError, match=r"setup 'exit 3' failed") as failed:
            asyncio.run(go())
    finally:
        _agent_loop_registry.clear()
        _agent_loop_registry.update(registered)
    assert "attempt 1" in str(failed.value) and "attempt 2" not in str(failed.value)  # no retry
    assert fake.calls == []  # the policy was never asked


def test_verl_loop_leaves_wall_clock_timeouts_out_unless_told(tmp_path: Path) -> None:
    """veRL's agent loop follows `openforge train --on-timeout`'s default: a rollout stopped by the wall
    clock is left out of the update (issue #35), unless `openforge.on_timeout: zero`."""
    from types import SimpleNamespace

    from openforgerl.integrations.verl.agent_loop import LoopOptions
    from openforgerl.tasks import CommandVerifier, Task

    task = Task(id="t", instruction="x", split="train", verifier=CommandVerifier(command="true"))
    for section, excluded in ((None, True), ({"on_timeout": "zero"}, False)):
        loop = SimpleNamespace(options=LoopOptions.build(section, {}))
        job = OpenForgeAgentLoop._job(loop, task, {"temperature": 0.7}, {}, tmp_path)  # type: ignore[arg-type]
        assert job.exclude_timeouts is excluded


def test_rollout_seeds_differ_within_a_group_and_repeat_across_runs() -> None:
    """`openforge.seed`: each sample of a GRPO group (veRL's session_id) and each step gets its own
    seed, the same on a rerun; unset, rollouts are unseeded."""
    from openforgerl.integrations.verl.agent_loop import LoopOptions, rollout_seed

    task = TASKS[0]
    seeded = LoopOptions.build({"seed": 7}, {})
    seeds = {
        (step, session): rollout_seed(seeded, task, {"global_steps": step, "session_id": session})
        for step in (1, 2)
        for session in (0, 1)
    }
    assert len(set(seeds.values())) == 4
    assert rollout_seed(seeded, task, {"global_steps": 1, "session_id": 0}) == seeds[(1, 0)]
    assert rollout_seed(LoopOptions.build(None, {}), task, {"global_steps": 1}) is None
    with pytest.raises(ValueError, match="'verifier' or 'verl'"):
        LoopOptions.build({"reward": "judge"}, {})
