"""What every reader of task files shares: the error a bad file raises, JSON and JSONL records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


class TaskError(ValueError):
    """A task file that cannot be loaded: the message names the file, the task and the problem."""


def jsonl_records(path: Path) -> list[tuple[str, Any]]:
    """(where in the file, record) of each non-blank line of a JSONL file."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                out.append((f"line {n}", orjson.loads(line)))
            except orjson.JSONDecodeError as exc:
                raise TaskError(f"{path}: line {n}: not valid JSON: {exc}") from exc
    return out


def json_document(path: Path, kind: type, what: str) -> Any:
    """The JSON document in `path`, which must be a `kind`: `what` says what it should hold."""
    try:
        doc = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise TaskError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, kind):
        raise TaskError(f"{path}: expected {what}, got {type(doc).__name__}")
    return doc
