"""Run folders as the viewer reads them (see the package docstring for the files and their shapes)."""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from openforgerl.run.folder import EVALS_INDEX, OWN_FOLDERS, REPORT, RUN_MARKERS, RUNNER_STATE, SETTINGS
from openforgerl.run_status import effective_state, read_status
from openforgerl.store import run_state_progress, run_state_record

# A folder holding any of these is a run; the folders a run keeps for itself (checkpoints, a
# trainer's per-step runner records, the headroom measurement's, tensorboard logs) are never runs.
RUN_FILES = RUN_MARKERS
NOT_RUNS = OWN_FOLDERS
MAX_DEPTH = 4  # how deep under --runs run folders are looked for (the demo's are at demo/eval/NAME)


@dataclass
class Run:
    name: str  # the key in URLs: the folder's path under --runs, or the store's run_id
    run_id: str  # the rollouts' run_id in `store`
    folder: Path | None = None
    store: Path | None = None
    parent: str | None = None  # the run folder this one is a phase of (None: a run of its own)
    steps: list[str] = field(default_factory=list)  # the run_ids of its store, one per step
    step_of: str | None = None  # the run this is one step of (its rollouts under one run_id)


def is_model_folder(path: Path) -> bool:
    """A model's folder (weights and tokenizer), whose config.json is the model's, not a run's."""
    return (path / "tokenizer_config.json").is_file() and not any(
        (path / f).exists() for f in RUN_FILES if not f.startswith("config.")
    )


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in RUN_FILES) and not is_model_folder(path)


def run_folders(root: Path) -> Iterator[tuple[str, Path, str | None]]:
    """(name, folder, parent's name) of the run folders under `root`: root itself, and every run
    folder below it (through plain folders such as the demo's eval/), MAX_DEPTH deep. A run folder
    inside another is a phase of it: its parent is the nearest run folder above it."""

    def below(
        folder: Path, prefix: str, parent: str | None, depth: int
    ) -> Iterator[tuple[str, Path, str | None]]:
        if depth > MAX_DEPTH:
            return
        with contextlib.suppress(OSError):
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
            for child in children:
                if child.name in NOT_RUNS:
                    continue
                name = f"{prefix}/{child.name}" if prefix else child.name
                if is_run_folder(child):
                    yield name, child, parent
                    yield from below(child, name, name, depth + 1)
                else:
                    yield from below(child, name, parent, depth + 1)

    if is_run_folder(root):
        name = root.resolve().name
        yield name, root, None
        yield from below(root, name, name, 1)
    elif root.is_dir():
        yield from below(root, "", None, 1)


def step_order(run_id: str) -> tuple[str, int, str]:
    """rl-step2 before rl-step10: run_ids sorted by the number in them."""
    m = re.match(r"^(.*?)(\d+)(\D*)$", run_id)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else (run_id, -1, "")


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
    for name in ("config.json", "config.yaml", "config.yml", SETTINGS):  # run.json: openforge train's
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


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def eval_reports(folder: Path) -> list[dict[str, Any]]:
    """The run's eval reports in display order: `evals.jsonl` (the trainer's list) first, in its
    order, then the `eval-*/report.json` and `eval/*/report.json` (the demo's) it did not name,
    oldest first; the run's own report.json (an eval run) leads."""
    out: list[dict[str, Any]] = []
    seen: set[Path] = set()
    own = folder / REPORT
    if own.is_file():
        report = read_json(own)
        if isinstance(report, dict) and "summary" in report:  # an evaluation's (not the demo's)
            out.append({"name": "this run", "step": None, "path": REPORT, "report": report})
            seen.add(own.resolve())
    listed = folder / EVALS_INDEX
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
                    full = full / REPORT
                seen.add(full)
                report = read_json(full)
            if isinstance(report, dict):
                name = str(entry.get("name") or path or f"eval {len(out) + 1}")
                out.append({"name": name, "step": entry.get("step"), "path": path, "report": report})
    found = [
        p
        for p in [*folder.glob(f"eval-*/{REPORT}"), *folder.glob(f"eval/*/{REPORT}")]
        if p.resolve() not in seen
    ]
    for path in sorted(found, key=lambda p: p.stat().st_mtime):
        report = read_json(path)
        if isinstance(report, dict):
            name = path.parent.name.removeprefix("eval-")
            out.append({"name": name, "step": None, "path": str(path.relative_to(folder)), "report": report})
    return out


def report_headline(folder: Path) -> dict[str, Any] | None:
    """Mean reward, pass@1 and rollouts of the run's own report.json (an eval run), for the run list."""
    report = read_json(folder / REPORT)
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
    return run_state_progress(folder / RUNNER_STATE)


def runner_record(folder: Path | None, gateway_rollout_id: str) -> dict[str, Any] | None:
    """The runner's record of one rollout: outcome, harness exit and output tail, verifier details,
    seconds per phase."""
    return run_state_record(folder / RUNNER_STATE, gateway_rollout_id) if folder is not None else None


FINAL_STATES = ("finished", "failed", "interrupted")


def run_status(
    folder: Path | None,
    progress: dict[str, int],
    open_rollouts: int,
    phase: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's state from its own record, never from file times (the viewer's reads may touch
    them): its status.json (openforgerl.run_status; a "running" whose process is gone on this host:
    interrupted); else its entry in its parent run's status.json phases (`phase`); else finished
    when it wrote report.json; else running when the runner's record has rollouts pending or running
    or the store has open ones; else finished when the runner's record is complete; else unknown."""
    own = read_status(folder) if folder is not None else None
    if own is not None:
        at = own.get("finished_at") or own.get("started_at")
        return {**own, "state": effective_state(own), "source": "status.json", "changed_at": at}
    if phase is not None:
        at = phase.get("finished_at") or phase.get("started_at")
        return {"source": "the run's status.json", **phase, "changed_at": at}
    if folder is not None and (folder / REPORT).is_file():
        return {"state": "finished", "source": REPORT, "changed_at": None}
    if progress.get("running") or progress.get("pending") or open_rollouts:
        source = RUNNER_STATE if progress.get("running") or progress.get("pending") else "store"
        return {"state": "running", "source": source, "changed_at": None}
    if progress:
        return {"state": "finished", "source": RUNNER_STATE, "changed_at": None}
    return {"state": "unknown", "source": "no status.json", "changed_at": None}


def phases_of(status: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A run's phases as its status.json records them, in order; those left running by a process
    that is gone were interrupted with it."""
    if status is None or not isinstance(status.get("phases"), dict):
        return {}
    gone = effective_state(status) == "interrupted"
    out = {}
    for name, phase in status["phases"].items():
        if isinstance(phase, dict):
            state = phase.get("state")
            out[str(name)] = {**phase, "state": "interrupted" if gone and state == "running" else state}
    return out


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
