"""Transient faults of a task's environment, declared as task data (`Task.faults`).

Real tools fail now and then: a file briefly locked, a flaky command, a 503 from an API. A task
declares such faults so that an agent can be trained and measured on recovering from them, the
same faults on every run of the task (they are data: evaluations stay paired).

Three places a fault can fire:
- a built-in harness tool (`tool: read_file`, `write_file` or `bash` of the ReAct harness): the call
  returns `error: <error>` instead of running;
- a program that any harness runs through a shell (`command: cat`): a shim of that name goes first
  on the harness's PATH; it prints `<command>: <error>` on stderr and exits with `exit_code`, and
  otherwise runs the real program. What a harness does in its own process (pi's `read` tool, Claude
  Code's `Read`, Codex's `apply_patch`) never reaches a shell and cannot be faulted this way;
- the gateway (`gateway: [503]`): the rollout's first calls are answered with those statuses, in the
  caller's dialect (the admin API's `POST /admin/rollouts/{id}/faults`).

`match` narrows a tool or command fault to calls whose path or arguments contain it; `times` is how
many matching calls fail before the next one succeeds. A fault with both `tool` and `command` counts
its failures once across both: "the first read of b.txt fails, whichever way it is read".

The counters live in files of the sandbox's temp dir (outside the work dir): a claim is an atomic
`mkdir`, so the harness process and the shims it starts share one count. This module is standard
library only: the ReAct harness imports it inside every sandbox.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FAULTS_ENV = "OPENFORGE_FAULTS"  # the spec file the built-in harnesses read
FAULTS_DIR = "openforge-faults"  # in the sandbox's temp dir: spec, shims (bin/) and counters (state/)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _spec(fault: Any) -> dict[str, Any]:
    """A fault as a plain mapping (the schema's model or its JSON)."""
    return fault.model_dump() if hasattr(fault, "model_dump") else dict(fault)


def environment(
    faults: Sequence[Any], tmpdir: str, path: str | None = None
) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:
    """What makes a sandbox honour `faults`: (files to put, by path -> (content, mode); environment
    for the harness). Gateway faults are the runner's to queue, not the sandbox's."""
    specs = [(i, _spec(f)) for i, f in enumerate(faults)]
    local = [(i, f) for i, f in specs if f.get("tool") or f.get("command")]
    if not local:
        return {}, {}
    root = posixpath.join(tmpdir, FAULTS_DIR)
    spec_file = posixpath.join(root, "faults.json")
    spec = {"state": posixpath.join(root, "state"), "faults": dict(local)}
    files = {spec_file: (json.dumps(spec), 0o644)}
    env = {FAULTS_ENV: spec_file}
    commands = sorted({str(f["command"]) for _, f in local if f.get("command")})
    if commands:
        bin_dir = posixpath.join(root, "bin")
        for command in commands:
            mine = [(i, f) for i, f in local if f.get("command") == command]
            shim = _shim(command, mine, bin_dir, posixpath.join(root, "state"))
            files[posixpath.join(bin_dir, command)] = (shim, 0o755)
        env["PATH"] = f"{bin_dir}:{path or DEFAULT_PATH}"
    return files, env


def _shim(command: str, faults: list[tuple[int, dict[str, Any]]], bin_dir: str, state: str) -> str:
    """A POSIX sh script standing in for `command`: fails while a matching fault has failures left."""
    lines = [
        "#!/bin/sh",
        f"# OpenForgeRL: a transient fault of this task's environment stands in for `{command}`.",
        f"S={shlex.quote(state)}",
        'mkdir -p "$S" 2>/dev/null',
    ]
    for i, f in faults:
        claims = " || ".join(f'mkdir "$S/{i}.{k}" 2>/dev/null' for k in range(1, int(f.get("times", 1)) + 1))
        message = shlex.quote(f"{command}: {f.get('error', '')}")
        fail = f"if {claims}; then printf '%s\\n' {message} >&2; exit {int(f.get('exit_code', 1))}; fi"
        match = f.get("match")
        lines.append(f'case "$*" in *{shlex.quote(match)}*) {fail};; esac' if match else fail)
    # The real program: the first on PATH that is not this shim.
    lines += [
        f"D={shlex.quote(bin_dir)}",
        "IFS=:",
        f'for p in $PATH; do [ "$p" != "$D" ] && [ -x "$p/{command}" ] && exec "$p/{command}" "$@"; done',
        f"echo '{command}: command not found' >&2",
        "exit 127",
        "",
    ]
    return "\n".join(lines)


class ToolFaults:
    """The built-in harness's side: which tool calls fail (read from `$OPENFORGE_FAULTS`)."""

    def __init__(self, state: str, faults: Mapping[str, Mapping[str, Any]]) -> None:
        self.state = Path(state)
        self.faults = {int(i): dict(f) for i, f in faults.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ToolFaults | None:
        spec_file = environ.get(FAULTS_ENV)
        if not spec_file:
            return None
        spec = json.loads(Path(spec_file).read_text())
        return cls(spec["state"], spec["faults"])

    def error(self, tool: str, target: str) -> str | None:
        """The error this call of `tool` on `target` (a path, a command line) meets, if any; a call
        that meets one uses up one of that fault's failures."""
        for i, f in sorted(self.faults.items()):
            if f.get("tool") != tool or (f.get("match") and str(f["match"]) not in target):
                continue
            if self._claim(i, int(f.get("times", 1))):
                return str(f.get("error", ""))
        return None

    def _claim(self, index: int, times: int) -> bool:
        self.state.mkdir(parents=True, exist_ok=True)
        for k in range(1, times + 1):
            try:
                (self.state / f"{index}.{k}").mkdir()
                return True
            except FileExistsError:
                continue
        return False
