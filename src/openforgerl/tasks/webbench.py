"""Public web-agent benchmarks as tasks: WebVoyager and Online-Mind2Web, read from their own files.

`load_tasks("webvoyager:PATH")` and `load_tasks("online-mind2web:PATH")` give one `Task` per
record: the GUI harness (`harness: gui`) starting at the record's site
(`harness_options.start_url`), split `test`, scored by the LLM judge `openforgerl.tasks.judge:judge`
(the tasks are on the live web: no state to check, only what the agent saw and answered). The
original record is kept in `metadata.record`. They need the live web and a judge model behind the
gateway's upstream mode:

    openforge eval --tasks webvoyager:data/WebVoyager_data.jsonl --harness gui --network host \
        --upstream judge=openai:gpt-4.1 --model VLM_DIR      # key from OPENAI_API_KEY

Formats (as published):

- WebVoyager `data/WebVoyager_data.jsonl`: one object per line, `{"web_name": "Allrecipes", "id":
  "Allrecipes--0", "ques": "...", "web": "https://www.allrecipes.com/"}`. Its reference answers
  (`data/reference_answer.json`, `{web_name: {"answers": [{"id": 0, "type": "golden"|"possible",
  "ans": "..."}]}}`) are read from `reference_answer.json` next to the task file when it is there,
  or from `reference=`; the judge is told whether a reference is the only right answer (golden) or
  one of several (possible).
- Online-Mind2Web: a JSON list (or JSONL) of `{"task_id", "confirmed_task", "website",
  "reference_length", "level"}`, level easy / medium / hard.

Step limits follow OSWorld's settings (15, 50, 100): easy tasks get 15 steps, medium 50, hard 100,
and tasks without a level (WebVoyager's) 50. The harness's timeout grows with the steps (a step on
the live web, with a screenshot and a model call, takes seconds to tens of seconds).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pydantic import ValidationError

from openforgerl.tasks.files import TaskError, json_document, jsonl_records
from openforgerl.tasks.schema import Task

JUDGE = "openforgerl.tasks.judge:judge"
HARNESS = "gui"
DEFAULT_MAX_STEPS = 50
MAX_STEPS_BY_LEVEL = {"easy": 15, "medium": 50, "hard": 100}
SECONDS_PER_STEP = 20.0
MIN_TIMEOUT = 600.0
REFERENCE_FILE = "reference_answer.json"

Record = dict[str, Any]


def _steps_and_timeout(level: str | None) -> tuple[int, float]:
    steps = MAX_STEPS_BY_LEVEL[level] if level else DEFAULT_MAX_STEPS
    return steps, max(MIN_TIMEOUT, SECONDS_PER_STEP * steps)


def _task_id(raw: str) -> str:
    # WebVoyager's ids hold spaces ("Google Flights--1"); task ids are [A-Za-z0-9._-].
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw.strip()).lstrip("._-")


def _require(path: Path, where: str, record: Any, fields: Iterable[str]) -> Record:
    if not isinstance(record, dict):
        raise TaskError(f"{path}: {where}: expected a JSON object, got {type(record).__name__}")
    for name in fields:
        value = record.get(name)
        if name not in record:
            raise TaskError(f"{path}: {where}: missing field {name!r}")
        if not isinstance(value, str) or not value.strip():
            raise TaskError(f"{path}: {where}: field {name!r} must be a non-empty string, got {value!r:.80}")
    return record


def _check_url(path: Path, where: str, url: str) -> str:
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise TaskError(f"{path}: {where}: {url!r} is not an http(s) URL")
    return url.strip()


def _web_task(
    path: Path,
    where: str,
    benchmark: str,
    record: Record,
    task_id: str,
    instruction: str,
    url: str,
    *,
    level: str | None = None,
    tags: Iterable[str] = (),
    reference: Record | None = None,
) -> Task:
    """A task of either benchmark: the GUI harness starting at `url`, split `test`, the LLM judge
    (told the reference answer, if any), steps and timeout by `level`, the record in the metadata."""
    steps, timeout = _steps_and_timeout(level)
    judge: Record = {"task": instruction}
    metadata: Record = {"benchmark": benchmark, "record": record}
    if reference:
        judge |= {"reference": reference["ans"], "reference_type": reference["type"]}
        metadata["reference"] = reference
    try:
        return Task.model_validate(
            {
                "id": _task_id(task_id),
                "instruction": instruction,
                "split": "test",
                "harness": HARNESS,
                "harness_options": {"start_url": url, "max_steps": steps},
                "verifier": {"python": JUDGE, "kwargs": judge},
                "timeout": timeout,
                "tags": [benchmark, *tags],
                "metadata": metadata,
            }
        )
    except ValidationError as exc:  # e.g. an id with nothing valid left in it
        raise TaskError(f"{path}: {where}: cannot make a task of this record: {exc}") from exc


def _unique(path: Path, tasks: list[tuple[str, Task]]) -> list[Task]:
    seen: dict[str, str] = {}
    for where, task in tasks:
        if task.id in seen:
            raise TaskError(f"{path}: {where}: duplicate task id {task.id!r} (also at {seen[task.id]})")
        seen[task.id] = where
    return [t for _, t in tasks]


def _read(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such file")
    return path


# -- WebVoyager ------------------------------------------------------------------------------------


def _references(path: Path) -> dict[tuple[str, int], Record]:
    """(web_name, number) -> {"type", "ans"} from WebVoyager's reference_answer.json."""
    doc = json_document(path, dict, "an object {web_name: {answers: [...]}}")
    out: dict[tuple[str, int], Record] = {}
    for site, entry in doc.items():
        answers = entry.get("answers") if isinstance(entry, dict) else entry
        if not isinstance(answers, list):
            raise TaskError(f"{path}: site {site!r}: expected 'answers', a list")
        for a in answers:
            if not isinstance(a, dict) or not isinstance(a.get("id"), int) or "ans" not in a:
                raise TaskError(
                    f"{path}: site {site!r}: an answer needs an integer 'id' and 'ans': {a!r:.80}"
                )
            out[(site, a["id"])] = {"type": str(a.get("type", "possible")), "ans": str(a["ans"])}
    return out


def load_webvoyager(path: str | Path, reference: str | Path | None = None) -> list[Task]:
    """WebVoyager's task file (JSONL); reference answers from `reference` or the file beside it."""
    path = _read(path)
    ref_path = Path(reference) if reference is not None else path.parent / REFERENCE_FILE
    if reference is not None and not ref_path.is_file():
        raise TaskError(f"{ref_path}: no such file (the reference answers)")
    refs = _references(ref_path) if ref_path.is_file() else {}
    tasks = []
    for where, record in jsonl_records(path):
        record = _require(path, where, record, ("web_name", "id", "ques", "web"))
        url = _check_url(path, where, record["web"])
        number = record["id"].rpartition("--")[2]
        ref = refs.get((record["web_name"], int(number))) if number.isdecimal() else None
        site = f"site:{record['web_name']}"
        task = _web_task(
            path, where, "webvoyager", record, record["id"], record["ques"], url, tags=[site], reference=ref
        )
        tasks.append((where, task))
    return _unique(path, tasks)


# -- Online-Mind2Web -------------------------------------------------------------------------------


def load_online_mind2web(path: str | Path) -> list[Task]:
    """Online-Mind2Web's task file: a JSON list of records (JSONL works too)."""
    path = _read(path)
    if path.suffix == ".jsonl":
        entries = jsonl_records(path)
    else:
        doc = json_document(path, list, "a JSON list of tasks")
        entries = [(f"entry {i}", r) for i, r in enumerate(doc, start=1)]
    tasks = []
    for where, record in entries:
        if isinstance(record, dict) and isinstance(record.get("task_id"), str):
            where = f"{where} (task_id {record['task_id']!r})"
        record = _require(path, where, record, ("task_id", "confirmed_task", "website"))
        url = _check_url(path, where, record["website"])
        level = record.get("level")
        if level is not None and level not in MAX_STEPS_BY_LEVEL:
            raise TaskError(f"{path}: {where}: level {level!r} is not one of {', '.join(MAX_STEPS_BY_LEVEL)}")
        tags = [f"site:{urlparse(url).hostname}"] + ([f"level:{level}"] if level else [])
        task_id, instruction = record["task_id"], record["confirmed_task"]
        task = _web_task(
            path, where, "online-mind2web", record, task_id, instruction, url, level=level, tags=tags
        )
        tasks.append((where, task))
    return _unique(path, tasks)


# `load_tasks("FORMAT:PATH")`
FORMATS: dict[str, Callable[[str], list[Task]]] = {
    "webvoyager": load_webvoyager,
    "online-mind2web": load_online_mind2web,
}
