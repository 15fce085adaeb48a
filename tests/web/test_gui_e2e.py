"""The whole GUI loop with a real vision-language policy (marker `ui`, run by `make test-ui`).

`openforge eval --harness gui` and `openforge train --harness gui` with the kit's tiny Qwen2-VL:
the embedded gateway (VisionRenderer, the transformers engine serving the VLM) answers the GUI
harness, which drives Debian's Chromium on a web-basic site in a real bwrap sandbox. The tiny model
is untrained, so its replies are noise and every action is invalid; what is checked is the loop:
every screenshot the harness saved is, byte for byte, an image of the recorded call that showed it;
the verifier runs and the report is written; the trainer's samples name the images of their calls,
it recomputes the engine's logprobs on the store's pixels, and the weights move and reach the engine.

The harness's files live in the sandbox, which is deleted after the rollout; the tests keep them by
wrapping the web verifier, which gets a copy of each rollout's work directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from openforgerl.cli import main as cli
from openforgerl.rollouts.results import RunState, Status
from openforgerl.store.sqlite import CallRow, Store
from openforgerl.tasks import load_tasks
from openforgerl.tasks.loader import dump_tasks
from openforgerl.tasks.verify import GatewayAccess
from openforgerl.web import verify
from tests.vlm_helpers import tiny_vlm

pytestmark = pytest.mark.ui

BY_ID = {t.id: t for t in load_tasks("web-basic")}
KEEP_IMAGES = 3  # the harness's default: screenshots sent as images; older ones become text


@pytest.fixture(autouse=True)
def _needs_chromium() -> None:
    pytest.importorskip("playwright.sync_api")
    if not os.access("/usr/bin/chromium", os.X_OK):
        pytest.skip("no Chromium at /usr/bin/chromium (make test-ui installs Debian's)")


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Path]:
    """Gateway rollout id -> what the harness left in .openforge/gui (step PNGs, result.json),
    copied by the web verifier (wrapped: it still judges the work dir as the runner gave it)."""
    real = verify.check
    out: dict[str, Path] = {}

    def check(workdir: Path, gateway: GatewayAccess, **kwargs: Any) -> Any:
        dest = tmp_path / "kept" / gateway.rollout_id
        shutil.copytree(Path(workdir) / ".openforge" / "gui", dest)
        out[gateway.rollout_id] = dest
        return real(workdir, **kwargs)

    monkeypatch.setattr(verify, "check", check)
    return out


def _tasks_file(path: Path, ids: Sequence[str]) -> str:
    dump_tasks([BY_ID[i] for i in ids], path)
    return str(path)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _calls(store_path: Path, run_id: str | None = None) -> dict[str, list[CallRow]]:
    """Gateway rollout id -> its recorded calls, read from the run's store."""
    import asyncio

    async def read() -> dict[str, list[CallRow]]:
        store = Store(store_path)
        try:
            rollouts = await store.list_rollouts(run_id=run_id, limit=1000)
            return {r.id: await store.calls(r.id) for r in rollouts}
        finally:
            await store.close()

    return asyncio.run(read())


def _images(store_path: Path, digests: Sequence[str]) -> dict[str, Any]:
    import asyncio

    store = Store(store_path)
    try:
        return store.images_sync(digests)
    finally:
        asyncio.run(store.close())


def _invoke(command: str) -> str:
    """Run an `openforge` command line (no argument holds a space) in this process."""
    result = CliRunner().invoke(cli, command.split(), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


# -- evaluation -----------------------------------------------------------------------------------
HELD_OUT = ["web-shop-buy-one-3", "web-wiki-year-3"]  # two sites: their screenshots differ


def test_eval_records_every_screenshot_the_harness_sent(
    tiny_vlm_dir: Path, kept: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "eval"
    steps = 3
    tasks = _tasks_file(tmp_path / "tasks.jsonl", HELD_OUT)
    printed = _invoke(
        f"eval --tasks {tasks} --harness gui --model {tiny_vlm_dir} --max-steps {steps} --max-tokens 16 "
        f"--concurrency 2 --out {out}"
    )
    results = RunState(out / "runner.db").load()
    assert sorted(r.task_id for r in results.values()) == sorted(HELD_OUT)
    for r in results.values():  # finished by the harness and scored by the verifier, not a crash
        assert (r.status, r.outcome) == (Status.DONE, "ok"), r.details
        assert r.reward is not None and "reason" in r.details["verifier"]
    calls = _calls(out / "gateway.db")
    assert set(kept) == set(calls) == {r.gateway_rollout_id for r in results.values()}

    first_shots = set()
    for rollout_id, gui in kept.items():
        result = json.loads((gui / "result.json").read_text())
        assert result["stopped"] in ("max_steps", "answered") and result["compactions"] == 0
        recorded = calls[rollout_id]
        assert [c.seq for c in recorded] == list(range(result["steps"])) and result["steps"] >= 1
        shots = [_sha(gui / f"step-{i:03d}.png") for i in range(result["steps"])]
        first_shots.add(shots[0])
        for c in recorded:
            # Call s shows the screenshots of steps s - s % 3 .. s (older ones were cut to text).
            assert c.image_digests == shots[c.seq - c.seq % KEEP_IMAGES : c.seq + 1], c.seq
        stored = _images(out / "gateway.db", shots)
        for i, digest in enumerate(shots):
            image = stored[digest]
            assert image.data == (gui / f"step-{i:03d}.png").read_bytes()
            assert (image.media_type, image.width, image.height) == ("image/png", 640, 480)
    assert len(first_shots) == len(HELD_OUT)

    report = json.loads((out / "report.json").read_text())
    assert (report["harness"], report["rollouts"], report["scored"]) == ("gui", 2, 2)
    pass1 = report["summary"]["pass@k"]["1"]["estimate"]
    assert pass1 == sum(r.reward >= 1 for r in results.values() if r.reward is not None) / 2
    assert report["tokens"]["prompt"] == sum(c.prompt_tokens for cs in calls.values() for c in cs)
    assert "| pass@1 |" in (out / "report.md").read_text() and "| pass@1 |" in printed


def test_a_full_context_is_compacted_and_the_episode_goes_on(kept: dict[str, Path], tmp_path: Path) -> None:
    """A model whose context holds two screenshots but not three: the third call's prompt is refused
    (context_length_exceeded), the harness starts over from the newest screenshot with the task
    restated, and the episode runs to its step limit."""
    model = tiny_vlm(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1500  # calls take ~1030, ~1360, ~1700 tokens
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    tasks = _tasks_file(tmp_path / "tasks.jsonl", HELD_OUT[:1])
    _invoke(f"eval --tasks {tasks} --harness gui --model {model} --max-steps 4 --max-tokens 16 --out {out}")
    [r] = RunState(out / "runner.db").load().values()
    assert (r.status, r.outcome) == (Status.DONE, "ok"), r.details
    gui = kept[r.gateway_rollout_id]
    result = json.loads((gui / "result.json").read_text())
    assert (result["stopped"], result["steps"], result["compactions"]) == ("max_steps", 4, 1)
    shots = [_sha(gui / f"step-{i:03d}.png") for i in range(4)]
    recorded = _calls(out / "gateway.db")[r.gateway_rollout_id]
    assert [c.image_digests for c in recorded] == [shots[:1], shots[:2], shots[2:3], shots[2:4]]
    assert all(c.prompt_tokens + 1 <= 1500 for c in recorded)
    assert recorded[2].branch_reason and recorded[3].parent_call_id == recorded[2].id


# -- training -------------------------------------------------------------------------------------
TRAIN = ["web-shop-buy-one-0", "web-wiki-year-0"]


def test_grpo_on_screenshots_trains_on_the_recorded_images(
    tiny_vlm_dir: Path, kept: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from openforgerl.rl.trainer import Rollout, Trainer

    # The untrained model solves nothing; the first scored rollout of each group gets 1, the other 0
    # (after the real verifier ran), so each group has an advantage and the weights move.
    wrapped = verify.check
    firsts: set[tuple[str, str]] = set()
    lock = threading.Lock()

    def rewarding(workdir: Path, gateway: GatewayAccess, **kwargs: Any) -> float:
        wrapped(workdir, gateway=gateway, **kwargs)  # the verifier, and `kept` copies the files
        with lock:
            first = (gateway.run_id, gateway.task_id) not in firsts
            firsts.add((gateway.run_id, gateway.task_id))
        return 1.0 if first else 0.0

    monkeypatch.setattr(verify, "check", rewarding)
    trained: list[list[Rollout]] = []
    looked_up: list[str] = []
    real_step, real_images = Trainer.train_step, Store.images_sync

    def train_step(self: Trainer, rollouts: Sequence[Rollout]) -> dict[str, Any]:
        trained.append(list(rollouts))
        return real_step(self, rollouts)

    def images_sync(self: Store, digests: Any) -> Any:
        digests = list(digests)
        looked_up.extend(digests)
        return real_images(self, digests)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(Store, "images_sync", images_sync)

    out = tmp_path / "run"
    tasks = _tasks_file(tmp_path / "tasks.jsonl", TRAIN)
    printed = _invoke(
        f"train --model {tiny_vlm_dir} --tasks {tasks} --harness gui --max-steps 2 --max-tokens 16 "
        f"--steps 2 --batch-tasks 2 --group 2 --concurrency 2 --lr 1e-4 --out {out}"
    )
    assert "2 steps, policy version 2" in printed
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and [m["policy_version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["updated"] and m["outcomes"] == {"ok": 4} and m["groups_kept"] == 2
        assert math.isfinite(m["loss"]) and m["tokens"] > 0 and m["loss_tokens"] > 0 and m["grad_norm"] > 0
        # The trainer's logprobs on the store's pixels are the engine's on the harness's screenshots.
        assert abs(m["is_weight_min"] - 1) < 1e-3 and abs(m["is_weight_max"] - 1) < 1e-3

    # Rollouts of step 2 ran on the weights of step 1: the push reached the engine.
    for step, version in [(1, 0), (2, 1)]:
        step_calls = _calls(out / "gateway.db", f"{out.name}-step{step}")
        assert len(step_calls) == 4
        assert {c.policy_version for cs in step_calls.values() for c in cs} == {version}
    by_id = {c.id: c for cs in _calls(out / "gateway.db").values() for c in cs}

    # Each sample names the images of its sequence's last call, which the harness saved.
    shots = {_sha(p) for gui in kept.values() for p in gui.glob("step-*.png")}
    samples = [s for rollouts in trained for r in rollouts for s in r.samples]
    assert len(trained) == 2 and len(samples) == 8
    for s in samples:
        assert s.image_digests and s.image_digests == by_id[s.call_ids[-1]].image_digests
        assert set(s.image_digests) <= shots
    assert {d for s in samples for d in s.image_digests} <= set(looked_up)

    start = load_file(str(tiny_vlm_dir / "model.safetensors"))
    end = load_file(str(out / "checkpoints" / "step-000002" / "model.safetensors"))
    assert any(not start[k].equal(end[k]) for k in start if k in end)
