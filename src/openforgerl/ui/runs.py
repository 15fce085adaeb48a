"""Run folders as the viewer reads them (see the package docstring for the files and their shapes)."""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from openforgerl.store import run_state_progress, run_state_record

# A folder holding any of these is a run.
RUN_FILES = (
    "metrics.jsonl",
    "report.json",
    "runner.db",
    "gateway.db",
    "config.json",
    "config.yaml",
    "config.yml",
    "status.json",
    "evals.jsonl",
)
ACTIVE_SECONDS = 120.0  # a run whose files changed this recently counts as active


@dataclass
class Run:
    name: str  # the key in URLs: the folder's path under --runs, or the store's run_id
    run_id: str  # the rollouts' run_id in `store`
    folder: Path | None = None
    store: Path | None = None


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in RUN_FILES)


def run_folders(root: Path) -> Iterator[tuple[str, Path]]:
    """(name, folder) of the runs under `root`: root itself, its children, and their eval-* folders."""
    if is_run_folder(root):
        yield root.resolve().name, root
    if not root.is_dir():
        return
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        if is_run_folder(child):
            yield child.name, child
        for sub in sorted(child.glob("eval-*")):
            if is_run_folder(sub):
                yield f"{child.name}/{sub.name}", sub


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class MetricsFile:
    """`metrics.jsonl`, read incrementally: each poll parses only the lines appended since the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._lock = threading.Lock()

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                return self.rows
            if size < self._offset:  # rewritten from scratch (a restarted run): read it again
                self.rows, self._offset = [], 0
            if size > self._offset:
                with self.path.open("rb") as f:
                    f.seek(self._offset)
                    chunk = f.read(size - self._offset)
                # A line still being written has no newline yet: leave it for the next poll.
                end = chunk.rfind(b"\n") + 1
                self._offset += end
                for line in chunk[:end].splitlines():
                    row = _metrics_row(line)
                    if row is not None:
                        self.rows.append(row)
            return self.rows


def _metrics_row(line: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not _finite(data.get("step")):
        return None
    # Only numbers are plotted; NaN and infinities become gaps (JSON has no way to say them).
    return {k: (v if _finite(v) else None) for k, v in data.items() if _finite(v) or v is None}


def metrics_after(rows: list[dict[str, Any]], after: float | None) -> list[dict[str, Any]]:
    """The rows past step `after`, one per step (a step logged twice, after a restart: the last wins)."""
    by_step: dict[float, dict[str, Any]] = {}
    for row in rows:
        if after is None or row["step"] > after:
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def read_config(folder: Path) -> dict[str, Any]:
    for name in ("config.json", "config.yaml", "config.yml"):
        path = folder / name
        if path.is_file():
            with contextlib.suppress(ValueError, yaml.YAMLError, OSError):
                text = path.read_text()
                data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
                if isinstance(data, dict):
                    return data
    return {}


def model_dir_of(config: dict[str, Any]) -> Path | None:
    """The tokenizer's directory named by a run's config, if it exists on this machine."""
    policy = config.get("policy")
    candidates = [config.get(k) for k in ("model_dir", "model_path", "model")]
    if isinstance(policy, dict):
        candidates.append(policy.get("model"))
    for value in candidates:
        if isinstance(value, str) and value and (Path(value) / "tokenizer_config.json").is_file():
            return Path(value)
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def eval_reports(folder: Path) -> list[dict[str, Any]]:
    """The run's eval reports in display order: `evals.jsonl` (the trainer's list) first, in its
    order, then the `eval-*/report.json` it did not name, oldest first; the run's own report.json
    (an eval run) leads."""
    out: list[dict[str, Any]] = []
    seen: set[Path] = set()
    own = folder / "report.json"
    if own.is_file():
        report = _read_json(own)
        if isinstance(report, dict):
            out.append({"name": "this run", "step": None, "path": "report.json", "report": report})
            seen.add(own.resolve())
    listed = folder / "evals.jsonl"
    if listed.is_file():
        for line in listed.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if not isinstance(entry, dict):
                continue
            report, path = entry.get("report"), entry.get("path")
            if isinstance(path, str):
                full = (folder / path).resolve()
                if full.is_dir():
                    full = full / "report.json"
                seen.add(full)
                report = _read_json(full)
            if isinstance(report, dict):
                name = str(entry.get("name") or path or f"eval {len(out) + 1}")
                out.append({"name": name, "step": entry.get("step"), "path": path, "report": report})
    found = [p for p in folder.glob("eval-*/report.json") if p.resolve() not in seen]
    for path in sorted(found, key=lambda p: p.stat().st_mtime):
        report = _read_json(path)
        if isinstance(report, dict):
            name = path.parent.name.removeprefix("eval-")
            out.append({"name": name, "step": None, "path": str(path.relative_to(folder)), "report": report})
    return out


def report_headline(folder: Path) -> dict[str, Any] | None:
    """Mean reward, pass@1 and rollouts of the run's own report.json (an eval run), for the run list."""
    report = _read_json(folder / "report.json")
    if not isinstance(report, dict):
        return None
    summary = report.get("summary") or {}
    pass1 = (summary.get("pass@k") or {}).get("1") or {}
    return {
        "reward_mean": (summary.get("mean_reward") or {}).get("estimate"),
        "pass_rate": pass1.get("estimate"),
        "rollouts": report.get("rollouts"),
    }


def runner_progress(folder: Path) -> dict[str, int]:
    """Rollouts by state in the runner's own record (runner.db): pending, running, done, ..."""
    return run_state_progress(folder / "runner.db")


def runner_record(folder: Path | None, gateway_rollout_id: str) -> dict[str, Any] | None:
    """The runner's record of one rollout: outcome, harness exit and output tail, verifier details,
    seconds per phase."""
    return run_state_record(folder / "runner.db", gateway_rollout_id) if folder is not None else None


def run_status(folder: Path | None, progress: dict[str, int], open_rollouts: int) -> dict[str, Any]:
    """`status.json` when the run writes one, else inferred: finished (a report.json written after
    everything else), active (files changed in the last two minutes, or the runner has rollouts
    running), finished (an older report), or idle."""
    if folder is not None and (folder / "status.json").is_file():
        data = _read_json(folder / "status.json")
        if isinstance(data, dict) and isinstance(data.get("state"), str):
            return {**data, "source": "status.json"}
    changed = report = 0.0
    if folder is not None:
        for name in ("metrics.jsonl", "runner.db-wal", "runner.db", "gateway.db-wal", "gateway.db"):
            with contextlib.suppress(OSError):
                changed = max(changed, (folder / name).stat().st_mtime)
        with contextlib.suppress(OSError):
            report = (folder / "report.json").stat().st_mtime
    if report and report >= changed:
        state = "finished"
    elif time.time() - changed < ACTIVE_SECONDS or (progress.get("running") and open_rollouts):
        state = "active"
    else:
        state = "finished" if report else "idle"
    return {"state": state, "source": "inferred", "changed_at": max(changed, report) or None}


@dataclass
class TrainerTokens:
    """What the trainer recorded for one sample (`token_logprobs.jsonl`), aligned with its input_ids."""

    step: Any = None
    logprobs: list[float | None] = field(default_factory=list)
    importance_weights: list[float | None] = field(default_factory=list)


def trainer_tokens(folder: Path | None, rollout_id: str) -> dict[int, TrainerTokens]:
    """The trainer's per-token records of a rollout's samples, by the sample's first call id (the
    last line for a sample wins: the latest step that trained on it)."""
    path = folder / "token_logprobs.jsonl" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    out: dict[int, TrainerTokens] = {}
    needle = rollout_id.encode()
    with path.open("rb") as f:
        for line in f:
            if needle not in line:  # skip other rollouts' lines without parsing them
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue
            if isinstance(data, dict) and data.get("rollout_id") == rollout_id:
                out[int(data.get("call_id", -1))] = TrainerTokens(
                    data.get("step"),
                    list(data.get("trainer_logprobs") or []),
                    list(data.get("importance_weights") or []),
                )
    return out
