"""A run folder read as what it is (issue #27), without a browser: status.json written by the run
itself (finished, failed, interrupted, and a process that is gone), phases, steps of one run, and
the comparison's paired differences, which must be report.json's (demo._paired_gain)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from openforgerl import demo
from openforgerl.run_status import RunRecord, effective_state, read_status, recording
from openforgerl.store.sqlite import SCHEMA
from openforgerl.ui import ViewerConfig, build_app
from openforgerl.ui.compare import compare_reports


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: no process has this pid now (until the kernel reuses it)
    return proc.pid


def test_recording_says_finished_failed_or_interrupted(tmp_path: Path) -> None:
    with recording(tmp_path / "ok", "eval") as record:
        assert read_status(tmp_path / "ok")["state"] == "running"  # type: ignore[index]
        with record.phase("one", "one"):
            assert read_status(tmp_path / "ok")["phases"]["one"]["state"] == "running"  # type: ignore[index]
    done = read_status(tmp_path / "ok")
    assert done is not None and done["state"] == "finished" and done["phases"]["one"]["state"] == "finished"
    assert done["finished_at"] >= done["started_at"]

    with pytest.raises(ValueError), recording(tmp_path / "bad", "eval") as record, record.phase("x", None):
        raise ValueError("no samples")
    bad = read_status(tmp_path / "bad")
    assert bad is not None and bad["state"] == "failed" and bad["error"] == "ValueError: no samples"
    assert bad["phases"]["x"]["state"] == "failed"

    with pytest.raises(KeyboardInterrupt), recording(tmp_path / "stop", "demo") as record:
        with record.phase("sft", "sft"):
            raise KeyboardInterrupt
    stopped = read_status(tmp_path / "stop")
    assert stopped is not None and stopped["state"] == "interrupted"
    assert stopped["phases"]["sft"]["state"] == "interrupted"


def test_a_rerun_keeps_its_phases_records_and_skips_in_order(tmp_path: Path) -> None:
    with recording(tmp_path, "demo") as record:
        with record.phase("model", "model"):
            pass
        first = dict(record.data["phases"]["model"])
    with recording(tmp_path, "demo") as record:
        record.skipped("model", "model")
        record.skipped("teacher", "teacher")
    status = read_status(tmp_path)
    assert status is not None and list(status["phases"]) == ["model", "teacher"]
    assert status["phases"]["model"] == first  # its real record, not "skipped"
    assert status["phases"]["teacher"] == {"state": "finished", "folder": "teacher", "skipped": True}


def test_a_running_status_whose_process_is_gone_was_interrupted(tmp_path: Path) -> None:
    record = RunRecord(tmp_path, "train")
    record.write()
    assert effective_state(record.data) == "running"  # this very process
    gone = {**record.data, "pid": dead_pid()}
    assert effective_state(gone) == "interrupted"
    assert effective_state({**gone, "host": "another-machine"}) == "running"  # cannot tell from here
    assert effective_state({"state": "done"}) == "finished"  # the older contract's word


def _store(path: Path, rows: list[tuple[str, str, float]]) -> None:
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    db.executemany(
        "INSERT INTO rollouts (id, run_id, task_id, key_hash, status, reward, created_at)"
        " VALUES (?, ?, 't', ?, 'closed', ?, 1.0)",
        [(rid, run_id, f"k-{rid}", reward) for rid, run_id, reward in rows],
    )
    db.commit()
    db.close()


def _eval_report(values: dict[str, float], tasks: str = "suite") -> dict[str, Any]:
    iv = {"estimate": 0.5, "low": 0.0, "high": 1.0}
    return {
        "tasks": tasks,
        "harness": "react",
        "n": 2,
        "k": 2,
        "temperature": 0.7,
        "rollouts": 2 * len(values),
        "outcomes": {"ok": 2 * len(values)},
        "task_tags": {t: [tasks, "even" if int(t[-1]) % 2 == 0 else "odd"] for t in values},
        "summary": {
            "mean_reward": iv,
            "pass@k": {"1": iv, "2": iv},
            "pass^k": {"1": iv, "2": iv},
            "per_task": [
                {
                    "task_id": t,
                    "runs": 2,
                    "successes": round(2 * v),
                    "mean_reward": v,
                    "pass@k": {"1": v, "2": min(1.0, 2 * v)},
                    "pass^k": {"1": v, "2": v * v},
                }
                for t, v in values.items()
            ],
        },
    }


def test_a_demo_folder_is_one_run_its_phases_steps_and_an_interrupted_state(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")  # a model: weights and tokenizer, not a run
    (run / "model" / "tokenizer_config.json").write_text("{}")
    (run / "rl" / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "rl" / "checkpoints" / "step-000001" / "config.json").write_text("{}")
    _store(run / "rl" / "gateway.db", [(f"r{s}", f"rl-step{s}", s / 10) for s in (1, 2, 10)])
    for stage, value in (("sft", 0.25), ("rl", 0.75)):
        (run / "eval" / stage).mkdir(parents=True)
        report = _eval_report({"t0": value, "t1": value / 2, "t2": value, "t3": 0.0})
        (run / "eval" / stage / "report.json").write_text(json.dumps(report))
    record = RunRecord(run, "demo")
    for name, folder in (("model", "model"), ("eval-sft", "eval/sft")):
        record.skipped(name, folder)
    record.data["phases"]["rl"] = {"state": "running", "folder": "rl", "started_at": 1.0}
    record.data["pid"] = dead_pid()  # the demo was killed during RL
    record.write()

    with TestClient(build_app(ViewerConfig(runs=run)), base_url="http://127.0.0.1") as client:
        runs = client.get("/api/runs").json()["runs"]
        assert [r["name"] for r in runs] == ["demo"]
        assert runs[0]["status"]["state"] == "interrupted"
        phases = {p["phase"]: (p["run"], p["status"]["state"]) for p in runs[0]["phases"]}
        assert phases == {
            "model": (None, "finished"),
            "eval-sft": ("demo/eval/sft", "finished"),
            "rl": ("demo/rl", "interrupted"),  # running when its process went away
            "eval/rl": ("demo/eval/rl", "finished"),  # not in the record: found below the run
        }
        rl = client.get("/api/run", params={"run": "demo/rl"}).json()
        assert [s["run_id"] for s in rl["step_runs"]] == ["rl-step1", "rl-step2", "rl-step10"]
        assert rl["run_id"] == "rl-step10" and rl["steps"] == 3
        step = client.get("/api/rollouts", params={"run": "demo/rl#rl-step2"}).json()
        assert [r["id"] for r in step["rows"]] == ["r2"]
        demo_run = client.get("/api/run", params={"run": "demo"}).json()
        assert [g["runs"] for g in demo_run["comparisons"]] == [["demo/eval/sft", "demo/eval/rl"]]
        got = client.get("/api/compare", params=[("runs", "demo/eval/sft"), ("runs", "demo/eval/rl")]).json()
        assert got["parent"] == "demo" and got["overall"][0]["metric"] == "pass@1"
        assert got["overall"][0]["differences"][0]["estimate"] == pytest.approx((0.5 + 0.25 + 0.5) / 4)
        one = client.get("/api/compare", params={"runs": "demo/eval/sft"})
        assert one.status_code == 400 and "two or more" in one.json()["error"]["message"]


def test_the_comparison_is_the_reports_paired_gain() -> None:
    sft = _eval_report({"t0": 0.0, "t1": 0.5, "t2": 1.0, "t3": 0.5, "t4": 0.0, "t5": 1.0})
    rl = _eval_report({"t0": 1.0, "t1": 0.5, "t2": 1.0, "t3": 1.0, "t4": 0.5, "t5": 0.5})
    got = compare_reports([("sft", sft), ("rl", rl)])
    # demo.py writes report.json's rl_minus_sft_* with _paired_gain: the viewer shows that number.
    gain = demo._paired_gain({"sft": sft, "rl": rl}, "sft", "rl")
    assert gain is not None and gain["estimate"] == pytest.approx(0.25)
    overall = {m["metric"]: m for m in got["overall"]}
    assert overall["pass@1"]["differences"] == [gain]
    assert gain["low"] < gain["estimate"] < gain["high"]
    assert list(overall) == ["pass@1", "pass@2", "pass^2", "mean reward"]
    # Per family: the tag every task carries (the suite's) is the overall row, left out.
    tags = {t["tag"]: t for t in got["by_tag"]}
    assert set(tags) == {"even", "odd"}
    assert tags["even"]["values"] == pytest.approx([1 / 3, 2.5 / 3])  # t0, t2, t4
    assert tags["even"]["differences"][0]["estimate"] == pytest.approx(0.5)
    t4 = next(t for t in got["by_task"] if t["task_id"] == "t4")
    assert t4["differences"] == [0.5] and t4["successes"] == [0, 1] and t4["tags"] == ["even"]
    with pytest.raises(ValueError, match="same tasks"):
        compare_reports([("sft", sft), ("other", _eval_report({"t0": 1.0, "x9": 0.0}))])


def test_a_demo_from_before_status_json_reads_its_timings(tmp_path: Path) -> None:
    """A run folder made before status.json existed: its timings.json (the demo's record of each
    finished phase, in the order they ran) gives the phases' states and order."""
    run = tmp_path / "old-demo"
    for stage, value in (("sft", 0.25), ("rl", 0.75)):  # alphabetically rl comes first
        (run / "eval" / stage).mkdir(parents=True)
        (run / "eval" / stage / "report.json").write_text(json.dumps(_eval_report({"t0": value, "t1": 0.0})))
    (run / "sft").mkdir()
    (run / "sft" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "unlisted").mkdir()
    (run / "unlisted" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "timings.json").write_text(json.dumps({"sft": 3.0, "eval-sft": 1.0, "eval-rl": 1.0}))
    (run / "report.json").write_text("{}")
    with TestClient(build_app(ViewerConfig(runs=tmp_path)), base_url="http://127.0.0.1") as client:
        (found,) = client.get("/api/runs").json()["runs"]
        assert found["name"] == "old-demo" and found["status"]["source"] == "report.json"
        phases = [(p["phase"], p["status"]["state"], p["status"]["source"]) for p in found["phases"]]
        assert phases == [
            ("sft", "finished", "the run's timings.json"),
            ("eval/sft", "finished", "the run's timings.json"),
            ("eval/rl", "finished", "the run's timings.json"),
            ("unlisted", "unknown", "no status.json"),  # nothing says: not guessed from file times
        ]
        demo_run = client.get("/api/run", params={"run": "old-demo"}).json()
        assert [g["runs"] for g in demo_run["comparisons"]] == [["old-demo/eval/sft", "old-demo/eval/rl"]]
