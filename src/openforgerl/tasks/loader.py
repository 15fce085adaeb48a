"""Loading task files and built-in suites by name (the schema is documented in `tasks.schema`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
import yaml
from pydantic import ValidationError

from openforgerl.tasks.files import TaskError, jsonl_records
from openforgerl.tasks.harbor import load_harbor, task_folders
from openforgerl.tasks.schema import Split, Task
from openforgerl.tasks.suites import (
    CLAW_BASIC_DIR,
    tools_tiny,
    tools_tiny_reworded,
    tools_tiny_varied,
    web_basic,
)
from openforgerl.tasks.webbench import FORMATS as BENCHMARK_FORMATS

TASK_FILE_SUFFIXES = (".yaml", ".yml", ".jsonl")


def _describe(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or '(task)'}: {e['msg']}" for e in error.errors()
    )


def _entries(path: Path) -> list[tuple[str, Any]]:
    """(where in the file, raw task) pairs, defaults already merged."""
    if path.suffix == ".jsonl":
        return jsonl_records(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise TaskError(f"{path}: not valid YAML: {exc}") from exc
    if isinstance(doc, dict) and "tasks" in doc:
        extra = set(doc) - {"defaults", "tasks"}
        defaults = doc.get("defaults") or {}
        if extra or not isinstance(defaults, dict) or not isinstance(doc["tasks"], list):
            raise TaskError(
                f"{path}: a file with 'tasks' holds only 'defaults' (a mapping) and 'tasks' (a list)"
                + (f"; unexpected keys: {sorted(extra)}" if extra else "")
            )
        items = [{**defaults, **t} if isinstance(t, dict) else t for t in doc["tasks"]]
    elif isinstance(doc, dict):
        items = [doc]
    elif isinstance(doc, list):
        items = doc
    else:
        raise TaskError(f"{path}: expected a task, a list of tasks or {{defaults, tasks}}, got {doc!r:.80}")
    return [(f"entry {i}", item) for i, item in enumerate(items, start=1)]


def load_task_file(path: str | Path) -> list[Task]:
    """Every task in one YAML or JSONL file; all bad tasks are reported together."""
    path = Path(path)
    tasks, problems = [], []
    for where, raw in _entries(path):
        task_id = raw.get("id") if isinstance(raw, dict) else None
        try:
            tasks.append(Task.model_validate(raw, context={"base_dir": path.parent}))
        except ValidationError as exc:
            problems.append(f"{path}: task {task_id!r} ({where}): {_describe(exc)}")
    if problems:
        raise TaskError("\n".join(problems))
    return tasks


def _check_unique(tasks_by_file: Iterable[tuple[Path, Task]]) -> None:
    seen: dict[str, Path] = {}
    for path, task in tasks_by_file:
        if task.id in seen:
            raise TaskError(f"{path}: task {task.id!r}: duplicate id (also in {seen[task.id]})")
        seen[task.id] = path


_SUITES: dict[str, Callable[[], list[Task]]] = {}


def register_suite(name: str, load: Callable[[], list[Task]]) -> None:
    """Make `load_tasks(name)` return `load()`; names cannot contain '/' or '.' (they are not paths)."""
    if "/" in name or "." in name:
        raise ValueError(f"suite name {name!r} looks like a path")
    _SUITES[name] = load


def suite_names() -> list[str]:
    return sorted(_SUITES)


# FORMAT:PATH of task sets in another layout: a public benchmark's own file (tasks.webbench), or a
# folder of Harbor / Terminal-Bench 1 task folders (tasks.harbor).
FORMATS = {**BENCHMARK_FORMATS, "harbor": load_harbor, "terminal-bench": load_harbor}


def _benchmark(spec: str) -> list[Task] | None:
    """`webvoyager:PATH`, `online-mind2web:PATH`, `harbor:DIR`, `terminal-bench:DIR`."""
    prefix, colon, path = spec.partition(":")
    load = FORMATS.get(prefix) if colon else None
    return load(path) if load is not None else None


def load_tasks(path_or_suite_name: str | Path, split: Split | None = None) -> list[Task]:
    """Tasks of a built-in suite (by name), a task file, every task file directly in a folder, a
    public benchmark's file (`webvoyager:PATH`, `online-mind2web:PATH`), or Harbor task folders
    (`harbor:DIR`, or a DIR without task files whose folders hold task.toml; tasks.harbor).

    A folder is not searched recursively: task folders hold the tasks' own files, which may be
    YAML too. Ids must be unique across everything loaded.
    """
    if isinstance(path_or_suite_name, str) and path_or_suite_name in _SUITES:
        tasks = _SUITES[path_or_suite_name]()
    elif isinstance(path_or_suite_name, str) and (found := _benchmark(path_or_suite_name)) is not None:
        tasks = found
    else:
        path = Path(path_or_suite_name)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in TASK_FILE_SUFFIXES and p.is_file())
            if not files and task_folders(path):  # Harbor's layout: a folder per task
                tasks = load_harbor(path)
                return tasks if split is None else [t for t in tasks if t.split == split]
            if not files:
                raise TaskError(
                    f"{path}: no task files ({', '.join(TASK_FILE_SUFFIXES)}) in this folder, nor Harbor "
                    "task folders (with task.toml)"
                )
        elif path.is_file():
            files = [path]
        else:
            raise TaskError(
                f"{path_or_suite_name}: neither a task file, a folder, nor a suite "
                f"(built-in suites: {', '.join(suite_names())}), nor FORMAT:PATH of a benchmark's own "
                "file (webvoyager, online-mind2web) or of task folders (harbor, terminal-bench)"
            )
        loaded = [(f, t) for f in files for t in load_task_file(f)]
        _check_unique(loaded)
        tasks = [t for _, t in loaded]
    return tasks if split is None else [t for t in tasks if t.split == split]


def dump_tasks(tasks: Iterable[Task], path: str | Path) -> None:
    """Write tasks as JSONL (folders become absolute paths), loadable with `load_tasks`."""
    with Path(path).open("wb") as f:
        for task in tasks:
            f.write(orjson.dumps(task.model_dump(mode="json", exclude_defaults=True)) + b"\n")


register_suite("tools-tiny", tools_tiny.generate)
register_suite("tools-tiny-faults", lambda: tools_tiny.generate(faults=tools_tiny.FAULT_FRACTION))
register_suite("tools-tiny-reworded", tools_tiny_reworded.generate)  # held-out only
register_suite("tools-tiny-varied", tools_tiny_varied.generate)
register_suite("claw-basic", lambda: load_task_file(CLAW_BASIC_DIR / "tasks.yaml"))
register_suite("web-basic", web_basic.generate)
