"""Crash safety: kill -9 the gateway under load; every acknowledged call survives the restart."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from openforgerl.testing.gateway import free_port

ADMIN = "crash-admin"


def start(model: Path, store: Path, port: int, durability: str = "full") -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "openforgerl.cli", "gateway", "--model", str(model), "--port", str(port)]
    cmd += ["--store", str(store), "--admin-token", ADMIN, "--max-tokens", "3", "--durability", durability]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("gateway did not start")


@pytest.mark.parametrize("durability", ["full", "normal"])
def test_kill_9_under_load_loses_no_acknowledged_call(
    tiny_model_dir: Path, tmp_path: Path, durability: str
) -> None:
    """Both modes keep this promise: `normal` commits to the WAL (the OS has it when the answer goes
    out) without the fsync that `full` adds for power loss."""
    store, port = tmp_path / "gw.db", free_port()
    url, admin = f"http://127.0.0.1:{port}", {"authorization": f"Bearer {ADMIN}"}
    proc = start(tiny_model_dir, store, port, durability)
    rollouts = [httpx.post(url + "/admin/rollouts", json={}, headers=admin).json() for _ in range(8)]
    acked: dict[str, list[list[int]]] = {r["rollout_id"]: [] for r in rollouts}
    histories: dict[str, list[Any]] = {}
    stop = threading.Event()

    def load(ro: dict[str, Any]) -> None:
        msgs: list[Any] = [{"role": "user", "content": "hello"}]
        histories[ro["rollout_id"]] = msgs
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                try:
                    r = client.post(
                        ro["base_url"] + "/v1/chat/completions",
                        json={"model": "m", "messages": msgs, "return_token_ids": True},
                        headers={"authorization": f"Bearer {ro['api_key']}"},
                    )
                except httpx.HTTPError:
                    return  # the gateway died mid-request: that call was never acknowledged
                if r.status_code != 200:
                    return
                body = r.json()
                acked[ro["rollout_id"]].append(body["choices"][0]["token_ids"])
                msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
                msgs.append({"role": "user", "content": "go on"})

    threads = [threading.Thread(target=load, args=(ro,)) for ro in rollouts]
    for t in threads:
        t.start()
    time.sleep(4)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert sum(len(v) for v in acked.values()) >= 8, "the load produced too few calls to mean anything"

    # The store opens cleanly and holds every call a client got an answer for.
    with sqlite3.connect(store) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    proc = start(tiny_model_dir, store, port, durability)
    try:
        for ro in rollouts:
            calls = httpx.get(f"{url}/admin/rollouts/{ro['rollout_id']}/calls", headers=admin).json()["calls"]
            recorded = [c["completion_ids"] for c in calls if c["status"] == "ok"]
            assert recorded[: len(acked[ro["rollout_id"]])] == acked[ro["rollout_id"]]
        # The restarted gateway rebuilt token memory: the next turn extends the recorded branch.
        ro = next(r for r in rollouts if acked[r["rollout_id"]])
        msgs = histories[ro["rollout_id"]]
        n_acked = len(acked[ro["rollout_id"]])
        # Keep exactly the acknowledged turns (a call in flight at the kill may have been appended).
        msgs = msgs[: 1 + 2 * n_acked]
        r = httpx.post(
            ro["base_url"] + "/v1/chat/completions",
            json={"model": "m", "messages": msgs},
            headers={"authorization": f"Bearer {ro['api_key']}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        calls = httpx.get(f"{url}/admin/rollouts/{ro['rollout_id']}/calls", headers=admin).json()["calls"]
        last = calls[-1]
        assert last["branch_reason"] == "" and last["reused_prompt_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
