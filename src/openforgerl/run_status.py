"""A run folder's own record of its state: `status.json`, written by the process doing the work.

    {"kind": "eval", "state": "finished", "pid": 4711, "host": "box", "started_at": 1.7e9,
     "finished_at": 1.7e9, "error": null, "phases": {...}}

`state` is running, finished, failed (an exception; `error` says which) or interrupted (Ctrl-C). A
process killed outright (kill -9, SIGTERM, a lost machine) leaves "running" behind: a reader on the
same host sees that its pid is gone (`effective_state`). A run made of phases (the demo) records
each one under `phases`, in order: `{"model": {"state": "finished", "folder": "model", ...}}`.

`openforge eval` (evaluate.run_eval), `openforge train` (rl/loop.train) and the demo write one;
the viewer reads it and never infers a state from file times.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
STATES = ("running", "finished", "failed", "interrupted")


def _end_state(exc: BaseException | None) -> tuple[str, str | None]:
    if exc is None:
        return "finished", None
    if isinstance(exc, KeyboardInterrupt | SystemExit):
        return "interrupted", type(exc).__name__
    return "failed", f"{type(exc).__name__}: {exc}"[:2000]


class RunRecord:
    """The status.json of one run folder. A rerun in the same folder keeps its phases' records."""

    def __init__(self, folder: Path, kind: str, **extra: Any) -> None:
        self.path = folder / STATUS_FILE
        old = read_status(folder) or {}
        self.data: dict[str, Any] = {
            **{k: v for k, v in old.items() if k == "phases"},
            **extra,
            "kind": kind,
            "state": "running",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "finished_at": None,
            "error": None,
        }
        self.data.setdefault("phases", {})

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)  # a reader sees the old file or the new one, never half of one

    def end(self, exc: BaseException | None) -> None:
        self.data["state"], self.data["error"] = _end_state(exc)
        self.data["finished_at"] = time.time()
        self.write()

    def skipped(self, name: str, folder: str | None) -> None:
        """A phase whose output exists already (a rerun): finished, its first record kept."""
        phases = self.data["phases"]
        if phases.get(name, {}).get("state") != "finished":
            phases[name] = {"state": "finished", "folder": folder, "skipped": True}
        else:
            phases[name] = phases.pop(name)  # keep the phases in the order this run met them
        self.write()

    @contextlib.contextmanager
    def phase(self, name: str, folder: str | None) -> Iterator[None]:
        """Records phase `name` (its output in `folder`, relative to the run) as it runs and ends."""
        self.data["phases"].pop(name, None)
        entry: dict[str, Any] = {"state": "running", "folder": folder, "started_at": time.time()}
        self.data["phases"][name] = entry
        self.write()
        try:
            yield
        except BaseException as exc:
            entry["state"], entry["error"] = _end_state(exc)
            entry["finished_at"] = time.time()
            self.write()
            raise
        entry["state"], entry["finished_at"] = "finished", time.time()
        entry["seconds"] = round(entry["finished_at"] - entry["started_at"], 1)
        self.write()


@contextlib.contextmanager
def recording(folder: Path, kind: str, **extra: Any) -> Iterator[RunRecord]:
    """status.json in `folder`: running now; finished, failed or interrupted when the block ends."""
    record = RunRecord(folder, kind, **extra)
    record.write()
    try:
        yield record
    except BaseException as exc:
        record.end(exc)
        raise
    record.end(None)


def read_status(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("state"), str) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def effective_state(status: dict[str, Any]) -> str:
    """The recorded state, except that a "running" whose process is gone (on this host) was
    interrupted; "done" (the older contract's word) is finished."""
    state = str(status.get("state"))
    if state == "done":
        return "finished"
    pid = status.get("pid")
    if (
        state == "running"
        and isinstance(pid, int)
        and status.get("host") == socket.gethostname()
        and not _alive(pid)
    ):
        return "interrupted"
    return state
