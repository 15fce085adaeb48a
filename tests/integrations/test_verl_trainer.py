"""veRL's own trainer, for real, on this machine (`make test-verl`, marker `verl_trainer`).

One run of `openforge train --backend verl cpu_grpo` (the shipped CPU config) on a two-node Ray
cluster (`ray.cluster_utils.Cluster`, in a network namespace of its own): veRL 0.9.1's V1 trainer,
FSDP2 over gloo with one worker per node, one rollout replica per node served by the project's
engine, the project's agent loop running every rollout through the gateway in a sandbox with the
ReAct harness, two GRPO steps of the kit's tiny model on tools-tiny, the weights synced into the
rollout engines after each. No fake server manager and no fake queue: veRL's own LLMServerClient
and TransferQueue.

The reward is veRL's custom reward function `tests/verl_rewards.py` (`openforge.reward=verl`), not
the tools-tiny verifier: the untrained tiny model scores 0 on every task, which would make every
advantage and so the update zero (see that file).

What is checked, from the run's own records: veRL's metrics (its file logger), the gateway's SQLite
stores, the agent loop's outputs (`openforge.dump_outputs`), veRL's rollout dump
(`trainer.rollout_data_dir`) and the replicas' weight-sync log (`OPENFORGE_VERL_SYNC_LOG`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from openforgerl.integrations.verl.data import dataset_rows, write_rows
from openforgerl.integrations.verl.netns import CPU_ENV, wrap
from openforgerl.integrations.verl.replica import SYNC_LOG_ENV
from openforgerl.store.view import StoreView

pytestmark = pytest.mark.verl_trainer

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
# veRL's `training/rollout_probs_diff_max`: the largest |p_rollout - p_actor| over the sampled tokens
# of a step, the rollout engine's probabilities against veRL's FSDP actor's recomputation of them.
PROB_TOLERANCE = 1e-3
SEED = 7


@dataclass
class Run:
    out: Path
    model: Path
    log: str
    seconds: float
    metrics: list[dict[str, Any]]
    syncs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    dumps: list[dict[str, Any]]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Run:
    out = tmp_path_factory.mktemp("verl")
    write_rows(dataset_rows("tools-tiny", "train", limit=8), out / "train.jsonl")
    write_rows(dataset_rows("tools-tiny", "heldout", limit=2), out / "val.jsonl")
    store = out / "store"
    store.mkdir()
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={out / 'train.jsonl'}",
        f"data.val_files={out / 'val.jsonl'}",
        f"trainer.total_training_steps={STEPS}",
        f"trainer.rollout_data_dir={out / 'rollouts'}",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        "trainer.logger=[console,file]",
        # One agent-loop worker (one process less): veRL's least-loaded routing still sends its
        # concurrent rollouts to both replicas.
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"openforge.store_dir={store}",
        "openforge.dump_outputs=true",
        f"openforge.seed={SEED}",
        "openforge.reward=verl",
        f"reward.custom_reward_function.path={ROOT / 'tests' / 'verl_rewards.py'}",
    ]
    env = {
        **os.environ,
        **CPU_ENV,
        SYNC_LOG_ENV: str(out / "syncs.jsonl"),
        "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"),
        "PYTHONUNBUFFERED": "1",
    }
    command = wrap([sys.executable, str(ROOT / "tests" / "verl_two_nodes.py"), *overrides])
    t0 = time.monotonic()
    proc = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=1200)
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    (out / "run.log").write_text(log)
    assert proc.returncode == 0, (
        f"veRL's trainer failed ({proc.returncode}), {out / 'run.log'}:\n{log[-6000:]}"
    )
    print(f"\nveRL two-node run: {seconds:.0f}s; log {out / 'run.log'}")
    outputs = [r for f in sorted(store.glob("outputs-*.jsonl")) for r in _jsonl(f)]
    dumps = [r for f in sorted((out / "rollouts").glob("*.jsonl")) for r in _jsonl(f)]
    return Run(
        out,
        tiny_model_dir,
        log,
        seconds,
        _jsonl(out / "metrics.jsonl"),
        _jsonl(out / "syncs.jsonl"),
        outputs,
        dumps,
    )


def _step_metrics(run: Run) -> dict[int, dict[str, Any]]:
    steps: dict[int, dict[str, Any]] = {}
    for record in run.metrics:
        data = record.get("data", record)
        step = record.get("step", data.get("training/global_step"))
        if step is not None and "actor/grad_norm" in data:
            steps[int(step)] = data
    return steps


def test_two_grpo_steps_with_real_updates(run: Run) -> None:
    steps = _step_metrics(run)
    assert sorted(steps) == list(range(1, STEPS + 1)), f"steps logged: {sorted(steps)}"
    for step, m in steps.items():
        assert m["actor/grad_norm"] > 0, f"step {step}: zero gradient"
        assert m["critic/score/max"] > m["critic/score/min"], f"step {step}: no reward spread in the group"
        print(
            f"step {step}: grad_norm {m['actor/grad_norm']:.4g}, score {m['critic/score/mean']:.4f}, "
            f"step {m['timing_s/step']:.1f}s (gen {m['timing_s/gen']:.1f}s, "
            f"sync {m['timing_s/update_weights']:.3f}s)"
        )


def test_rollout_engine_matches_the_actor_after_each_sync(run: Run) -> None:
    steps = _step_metrics(run)
    for step, m in steps.items():
        diff = m["training/rollout_probs_diff_max"]
        mean = m["training/rollout_probs_diff_mean"]
        print(f"step {step}: max |p_rollout - p_actor| = {diff:.3g} (mean {mean:.3g})")
        assert 0 <= diff < PROB_TOLERANCE
    # Every sync changed the engines' weights (so the match at step 2 is against trained weights).
    by_replica: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in run.syncs:
        by_replica[s["replica"]].append(s)
    assert len(by_replica) == 2, f"syncs seen for replicas {sorted(by_replica)}"
    for replica, syncs in by_replica.items():
        trained = [s for s in syncs if s["global_steps"] >= 1]
        assert [s["global_steps"] for s in trained] == list(range(1, STEPS + 1)), syncs
        for s in trained:
            print(f"replica {replica}: sync at step {s['global_steps']}: |delta w| = {s['delta_l2']:.4g}")
            assert s["delta_l2"] > 0, (
                f"replica {replica}: the sync at step {s['global_steps']} changed nothing"
            )


def _recorded_calls(store: Path) -> dict[str, list[Any]]:
    calls: dict[str, list[Any]] = {}
    for db in store.glob("gateway-*.db"):
        view = StoreView(db)
        try:
            rows = view._db.execute("SELECT id FROM rollouts").fetchall()
            for (rollout_id,) in rows:
                found = view.rollout(rollout_id)
                assert found is not None
                calls[rollout_id] = found[1]
        finally:
            view.close()
    return calls


def _merged(calls: list[Any]) -> tuple[list[int], list[int], list[float]]:
    """One merged sequence from the recorded calls: each call's prompt continues the one before."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for c in calls:
        prompt = ids[: c.prompt_prefix_len] + list(c.prompt_delta)
        assert prompt[: len(ids)] == ids, "each call continues the previous one"
        delta = prompt[len(ids) :]
        ids += delta + list(c.completion_ids)
        mask += [0] * len(delta) + [1] * len(c.completion_ids)
        logprobs += [0.0] * len(delta) + list(c.completion_logprobs)
    return ids, mask, logprobs


def test_training_samples_are_the_gateways_record(run: Run) -> None:
    calls = _recorded_calls(run.out / "store")
    assert len(run.outputs) >= STEPS * 2 * 2, f"{len(run.outputs)} outputs"  # steps x tasks x group
    tokenizer = AutoTokenizer.from_pretrained(run.model)
    for out in run.outputs:
        info = out["openforge"]
        rollout_calls = calls[info["rollout_id"]]
        assert rollout_calls, info
        ids, mask, logprobs = _merged(rollout_calls)
        first = mask.index(1)
        assert out["prompt_ids"] == ids[:first]
        n = len(out["response_ids"])
        assert out["response_ids"] == ids[first : first + n]
        # The loss mask covers exactly the tokens the model sampled; tool and harness text is 0.
        assert out["response_mask"] == mask[first : first + n]
        assert out["response_logprobs"] == pytest.approx(logprobs[first : first + n], abs=1e-6)
        assert out["reward_score"] is None  # scored by veRL's reward loop (openforge.reward=verl)
    # What veRL trained on (its own rollout dump, from TransferQueue) is those sequences.
    ours = sorted(tokenizer.decode(o["response_ids"], skip_special_tokens=True) for o in run.outputs)
    theirs = sorted(d["output"] for d in run.dumps)
    assert ours == theirs
    assert all(d["score"] > 0 for d in run.dumps)


def test_two_policy_versions_sampled(run: Run) -> None:
    by_step: dict[int, set[int]] = defaultdict(set)
    for out in run.outputs:
        by_step[int(out["global_steps"])].update({out["min_global_steps"], out["max_global_steps"]})
    assert sorted(by_step) == list(range(1, STEPS + 1))
    versions = [sorted(v) for _, v in sorted(by_step.items())]
    print(f"policy versions sampled per step: {versions}")
    assert all(len(v) == 1 for v in versions), "one policy version per step (synchronous GRPO)"
    assert versions[0] != versions[1], "the second step sampled from the synced, trained weights"


def test_rollouts_spread_over_both_nodes(run: Run) -> None:
    last: dict[int, dict[str, Any]] = {}
    for s in run.syncs:
        last[s["replica"]] = s
    nodes = {s["node_id"] for s in last.values()}
    print(f"replicas: {[(r, s['node_id'][:8], s['requests']) for r, s in sorted(last.items())]}")
    assert len(nodes) == 2, "one rollout replica on each node"
    assert all(s["requests"] > 0 for s in last.values()), "both nodes' replicas served rollouts"
