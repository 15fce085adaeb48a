"""What every reader of task files shares: the error a bad file raises, JSON and JSONL records, a task
folder's files read only from inside it, and what a folder of task files holds (its digest, for checks
and image tags)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import orjson

from openforgerl.sandbox.base import link_out


class TaskError(ValueError):
    """A task file that cannot be loaded: the message names the file, the task and the problem."""


def refuse_links_out(folder: Path) -> None:
    """Raises TaskError, naming the link, where a task folder holds a symlink that leads out of it: a
    task's files (instruction, tests, solution, environment, scripts) are read only from inside its
    folder, never from /etc/shadow or /proc/self/environ, which would reach the model's prompt, the
    store and the sandbox. Checked before anything of the folder is read."""
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            if path.is_symlink() and (target := link_out(folder, path)) is not None:
                raise TaskError(
                    f"{path}: a symlink to {target!r}, outside the task folder {folder}: refused (a task's "
                    "files are read only from inside its folder)"
                )


def read_text(path: Path) -> str:
    """A task file's UTF-8 text; one that cannot be read is a TaskError naming it, not a traceback."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskError(f"{path}: not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise TaskError(f"{path}: cannot be read: {exc.strerror or exc}") from exc


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


def tree_digest(top: Path) -> dict[str, str]:
    """Each path under `top` -> a digest of what it is (a file's mode and bytes, a link's target)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            rel = path.relative_to(top).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link " + os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                digest = hashlib.sha256()
                with path.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                out[rel] = f"{stat.S_IMODE(st.st_mode):o} {digest.hexdigest()}"
    return out
