"""Dataset rows for veRL's `RLHFDataset`, one per task: `openforge verl-data`.

Each row has what veRL reads (`prompt` as chat messages, `data_source`, `agent_name`,
`reward_model`, `extra_info.index`) and what our agent loop needs to run the task:

    extra_info.task      the whole task as JSON (what the loop runs: the row is self-contained)
    extra_info.tasks     the suite name or task file it came from, and
    extra_info.task_id   its id: used only when a row has no `task` (rows written by hand)

A task whose files are a folder carries that folder's absolute path: it must exist on every
worker node (the same install path or a shared filesystem); built-in generated suites such as
tools-tiny carry their files inline. `prompt` is the instruction alone: veRL only logs it and
checks its length; the harness builds the real prompt (system, tools) itself.

Parquet needs pyarrow (installed with `datasets`, which veRL's dataset needs anyway); JSON Lines
(`.jsonl`) needs nothing and `RLHFDataset` reads it too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from openforgerl.tasks import Task, load_tasks

AGENT_NAME = "openforge"  # the name the agent loop is registered under
SUFFIXES = (".parquet", ".jsonl")


def task_row(task: Task, index: int, source: str) -> dict[str, Any]:
    return {
        "data_source": f"openforge/{source}",
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": task.instruction}],
        "ability": "agent",
        "reward_model": {"style": "openforge-verifier", "ground_truth": task.id},
        "extra_info": {
            "index": index,
            "task_id": task.id,
            "tasks": source,
            "split": task.split,
            # A string, not a struct: Arrow needs one schema for every row, tasks differ in shape.
            "task": task.model_dump_json(exclude_defaults=True),
        },
    }


def dataset_rows(tasks: str, split: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of a suite name or task file/folder, optionally one split, at most `limit` tasks."""
    loaded = load_tasks(tasks, split=split)  # type: ignore[arg-type]
    if limit is not None:
        loaded = loaded[:limit]
    if not loaded:
        raise ValueError(f"no tasks in {tasks!r}" + (f" with split {split!r}" if split else ""))
    source = tasks if not Path(tasks).exists() else str(Path(tasks).resolve())
    return [task_row(t, i, source) for i, t in enumerate(loaded)]


def write_rows(rows: Iterable[Mapping[str, Any]], out: str | Path) -> Path:
    """Write rows as Parquet or JSON Lines, by the file's suffix."""
    out = Path(out)
    if out.suffix not in SUFFIXES:
        raise ValueError(f"{out}: the file must end in {' or '.join(SUFFIXES)} (what RLHFDataset reads)")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if out.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ValueError(
                "writing Parquet needs pyarrow (pip install pyarrow); or write JSON Lines: --out FILE.jsonl"
            ) from exc
        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        with out.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def task_from_row(extra_info: Mapping[str, Any] | None) -> Task:
    """The task a dataset row stands for (see the module doc); a clear error when it names none."""
    info = dict(extra_info or {})
    if info.get("task"):
        raw = info["task"]
        return Task.model_validate_json(raw) if isinstance(raw, str | bytes) else Task.model_validate(raw)
    if info.get("tasks") and info.get("task_id"):
        found = _tasks_by_id(str(info["tasks"])).get(str(info["task_id"]))
        if found is None:
            raise ValueError(f"task {info['task_id']!r} is not in {info['tasks']!r}")
        return found
    raise ValueError(
        "the dataset row names no task: its extra_info needs 'task' (the task as JSON) or 'tasks' and "
        f"'task_id' (write rows with `openforge verl-data`); got keys {sorted(info)}"
    )


@functools.cache
def _tasks_by_id(tasks: str) -> dict[str, Task]:
    return {t.id: t for t in load_tasks(tasks)}
