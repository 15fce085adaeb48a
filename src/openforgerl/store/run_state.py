"""A runner's own record of its rollouts (`runner.db`), read-only, for the viewer.

The runner writes one row per task sample (`openforgerl.rollouts.results.RunState`, which owns the
schema: status, reward, outcome, the gateway's rollout id, attempts, verifier details, seconds per
phase). This reads that file with a `mode=ro` URI and never writes it; a file that is missing,
being created or of another shape reads as empty.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

from openforgerl.store.sqlite import connect_read_only


def run_state_progress(path: Path) -> dict[str, int]:
    """Rollouts by state in the runner's record: pending, running, done, ..."""
    if not path.is_file():
        return {}
    with contextlib.closing(connect_read_only(path, timeout=10)) as db, contextlib.suppress(sqlite3.Error):
        return {r[0]: r[1] for r in db.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status")}
    return {}


def run_state_record(path: Path, gateway_rollout_id: str) -> dict[str, Any] | None:
    """The runner's record of one rollout, by the gateway's rollout id: task, sample, status, reward,
    outcome, attempts, details (harness exit and output tail, verifier details) and seconds per
    phase; None when the file or the rollout is not there."""
    if not path.is_file():
        return None
    with contextlib.closing(connect_read_only(path, timeout=10)) as db, contextlib.suppress(sqlite3.Error):
        row = db.execute(
            "SELECT task_id, sample, status, reward, outcome, attempts, details, seconds FROM rollouts"
            " WHERE gateway_rollout_id = ?",
            (gateway_rollout_id,),
        ).fetchone()
        if row is not None:
            return {
                **{k: row[k] for k in ("task_id", "sample", "status", "reward", "outcome", "attempts")},
                "details": json.loads(row["details"] or "{}"),
                "seconds": json.loads(row["seconds"] or "{}"),
            }
    return None
