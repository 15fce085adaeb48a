"""One rollout's result, and the run's durable record of them (RunState: the run folder's runner.db).

A `RolloutResult` is what the rollouts package hands every consumer (eval, RL, SFT, the veRL agent
loop): status, reward, how the harness ended, and what the gateway recorded (the calls as typed
records, the samples built of them). Its `reward` is the reward's one source of truth: the verifier's
verdict (or the `on_failure` score) as the runner scored it, kept in the run's state. The runner
hands the gateway a copy when it closes the rollout (`POST /admin/rollouts/{id}/close`), for the
recording's readers (the viewer, `openforge export-sft`); no evaluation or training reads it back,
and the samples carry the result's reward (service.py).
"""

from __future__ import annotations

import enum
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openforgerl.rollouts.trajectory import RecordedCall, Sample


class Status(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"  # scored (reward set)
    DROPPED = "dropped"  # excluded: a policy failure by on_failure="drop", a timeout in RL (runner.py)
    INFRA_FAILED = "infra_failed"  # the infrastructure failed every retry: not the policy's fault


@dataclass
class RolloutResult:
    task_id: str
    sample: int
    status: Status
    reward: float | None = None
    outcome: str = ""  # how the harness ended: ok | crash | timeout | killed:oom | killed:pids | ...
    gateway_rollout_id: str = ""
    attempts: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    # What the gateway recorded of the rollout: its calls (read once: by the runner at close, or by
    # the service for a rollout an earlier process finished; None when the gateway cannot say) and
    # the training samples the service built of them with `reward` (none for a dropped rollout).
    # Not persisted: the gateway's store keeps the calls.
    calls: list[RecordedCall] | None = field(default=None, repr=False, compare=False)
    samples: list[Sample] = field(default_factory=list, repr=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.task_id}#{self.sample}"


class RunState:
    """The run's durable record of every rollout's state (SQLite, one row per task sample)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS rollouts (key TEXT PRIMARY KEY, task_id TEXT, sample INTEGER,"
            " status TEXT, reward REAL, outcome TEXT, gateway_rollout_id TEXT, attempts INTEGER,"
            " details TEXT, seconds TEXT, updated REAL)"
        )

    def save(self, r: RolloutResult) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO rollouts VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    r.key,
                    r.task_id,
                    r.sample,
                    r.status.value,
                    r.reward,
                    r.outcome,
                    r.gateway_rollout_id,
                    r.attempts,
                    json.dumps(r.details),
                    json.dumps(r.seconds),
                    time.time(),
                ),
            )

    def load(self) -> dict[str, RolloutResult]:
        with self._lock:
            rows = self._db.execute(
                "SELECT task_id, sample, status, reward, outcome, gateway_rollout_id, attempts, details,"
                " seconds FROM rollouts"
            ).fetchall()
        out = {}
        for task_id, sample, status, reward, outcome, gw_id, attempts, details, seconds in rows:
            r = RolloutResult(task_id, sample, Status(status), reward, outcome, gw_id, attempts)
            r.details, r.seconds = json.loads(details), json.loads(seconds)
            out[r.key] = r
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()
