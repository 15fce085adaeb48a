"""Running a task on this machine's file system: its files, its setup, its verifier.

Sandbox backends reuse the pieces (`write_files`, `verifier_env`, `parse_verifier_output`,
`run_python_verifier`); `prepare_local` and `verify_local` are the plain-subprocess versions, used
by the tests and by a local backend without isolation.

A verifier that fails says which kind of failure it was (the reward's contract,
docs/architecture.md): `VerifierError`, it failed on the state the agent left (the runner scores
it 0), or `VerifierUnavailable`, what it needs beyond that state failed (infrastructure: retried).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from openforgerl.tasks.schema import CommandVerifier, Files, PythonVerifier, Task

OUTPUT_TAIL = 2000  # characters of a verifier's output kept in the details
DETAILS_LIMIT = 64 * 1024  # characters of JSON of a verifier's details kept with a rollout


class VerifierError(RuntimeError):
    """The verifier failed on the state the agent left (crashed, timed out, wrote no reward, printed
    nonsense): the agent can cause each of these, so the runner scores it 0."""


class VerifierUnavailable(VerifierError):
    """What the verifier needs beyond the agent's state failed (its code cannot be loaded, an LLM
    judge cannot be asked): infrastructure, which the runner retries and never scores."""


class SetupError(RuntimeError):
    """A task's setup command failed: the task, not the policy, is broken."""


@dataclass(frozen=True, slots=True)
class GatewayAccess:
    """The gateway, for a Python verifier that calls it itself (an LLM judge through an upstream).

    The runner passes it as the keyword argument `gateway` to verifiers whose function declares a
    parameter of that name (others never see the admin token); outside a runner such a verifier
    reads OPENFORGE_GATEWAY_URL and OPENFORGE_ADMIN_TOKEN instead (see `from_env`).
    """

    url: str  # as this process reaches it
    admin_token: str
    run_id: str = ""
    rollout_id: str = ""  # the gateway rollout being scored
    task_id: str = ""

    @classmethod
    def from_env(cls) -> GatewayAccess | None:
        url = os.environ.get("OPENFORGE_GATEWAY_URL", "")
        token = os.environ.get("OPENFORGE_ADMIN_TOKEN", "")
        if not (url and token):
            return None
        return cls(url, token, run_id=os.environ.get("OPENFORGE_RUN_ID", ""))


@dataclass(frozen=True, slots=True)
class VerifierResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


def clip(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"... [truncated: {len(text) - limit} of {len(text)} characters left out]"


def bounded_details(details: Mapping[str, Any], limit: int = DETAILS_LIMIT) -> dict[str, Any]:
    """A verifier's details as a rollout stores them (plain JSON, about `limit` characters at most):
    the smallest fields whole, the first that does not fit cut (`clip`), the rest left out, and
    `_truncated` saying so. A reward file is the agent's to fill, so its size is not trusted."""
    plain = json.loads(json.dumps(details, default=str))
    sizes = {k: len(json.dumps(v)) + len(k) for k, v in plain.items()}
    total = sum(sizes.values())
    if total <= limit:
        return dict(plain)
    out: dict[str, Any] = {}
    room = limit
    for key in sorted(plain, key=sizes.__getitem__):
        if sizes[key] <= room:
            out[key], room = plain[key], room - sizes[key]
        elif room > 100 and len(key) < room // 2:  # worth a cut value; after it nothing fits
            out[key] = clip(plain[key] if isinstance(plain[key], str) else json.dumps(plain[key]), room)
            room = 0
    cut = [k for k in plain if k not in out or out[k] != plain[k]]
    out["_truncated"] = (
        f"the verifier's details were {total} characters, over the {limit} kept: "
        f"{len(cut)} field(s) cut or left out ({clip(', '.join(cut), 200)})"
    )
    return {k: out[k] for k in [*plain, "_truncated"] if k in out}


def reward_from_value(value: Any) -> VerifierResult:
    """A verifier's answer (float, bool, or mapping with "reward" + details) as a checked result."""
    details: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise VerifierError(f"the verifier's answer has no 'reward': {dict(value)!r:.200}")
        details = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise VerifierError(f"the reward must be a number in [0, 1], got {value!r:.80}")
    return VerifierResult(float(value), details)


def parse_verifier_output(stdout: str, exit_code: int, stderr: str = "") -> VerifierResult:
    """A command verifier's outcome: JSON on its last output line, else exit 0 = 1.0 and 1 = 0.0."""
    if exit_code not in (0, 1):
        raise VerifierError(
            f"the verifier exited with status {exit_code}: {(stdout + stderr)[-OUTPUT_TAIL:]}"
        )
    lines = stdout.strip().splitlines()
    last = lines[-1].strip() if lines else ""
    if last.startswith("{"):
        try:
            return reward_from_value(orjson.loads(last))
        except orjson.JSONDecodeError as exc:
            raise VerifierError(f"the verifier's last line is not valid JSON: {last[:200]}") from exc
    return VerifierResult(1.0 if exit_code == 0 else 0.0, {"exit_code": exit_code})


def reward_from_file(path: str, data: bytes) -> VerifierResult:
    """The reward a verifier wrote to a file (Harbor's reward.txt or reward.json): JSON for a `.json`
    file (`{"reward": x, ...}`, or a mapping with one number), a number for any other."""
    text = data.decode("utf-8", errors="replace").strip()
    if path.endswith(".json"):
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise VerifierError(f"{path} is not valid JSON: {text[:200]!r}") from exc
        if isinstance(value, Mapping) and "reward" not in value and len(value) == 1:
            (name, number), *_ = value.items()
            value = {"reward": number, "metric": name}
        result = reward_from_value(value)
    else:
        try:
            number = float(text)
        except ValueError as exc:
            raise VerifierError(f"{path} should hold a number, not {text[:200]!r}") from exc
        result = reward_from_value(number)
    return VerifierResult(result.reward, {**result.details, "reward_file": path})


def write_files(files: Files, dest: Path) -> None:
    """Put a task's (or verifier's) files into `dest`: a folder is copied, inline files are written."""
    dest.mkdir(parents=True, exist_ok=True)
    if isinstance(files, Path):
        # symlinks=True: a link stays a link (the workspace's own, byte for byte), never its target.
        shutil.copytree(files, dest, symlinks=True, dirs_exist_ok=True)
        return
    for rel, content in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


def verifier_env(task_id: str, verifier_dir: str) -> dict[str, str]:
    return {"OPENFORGE_TASK_ID": task_id, "OPENFORGE_VERIFIER_DIR": verifier_dir}


def prepare_local(task: Task, workdir: Path) -> None:
    """Write the task's files into `workdir` and run its setup commands there."""
    write_files(task.files, workdir)
    for command in task.setup:
        try:
            done = subprocess.run(
                ["sh", "-c", command], cwd=workdir, capture_output=True, text=True, timeout=task.timeout
            )
        except subprocess.TimeoutExpired as exc:
            raise SetupError(
                f"task {task.id!r}: setup command {command!r} ran over {task.timeout} s"
            ) from exc
        if done.returncode != 0:
            raise SetupError(
                f"task {task.id!r}: setup command {command!r} exited with {done.returncode}: "
                f"{(done.stdout + done.stderr)[-OUTPUT_TAIL:]}"
            )


def _takes_gateway(function: Any) -> bool:
    try:
        return "gateway" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


def run_python_verifier(
    verifier: PythonVerifier, workdir: Path, gateway: GatewayAccess | None = None
) -> VerifierResult:
    module_name, _, function_name = verifier.python.partition(":")
    try:  # the task's code, not the agent's state: a verifier that cannot load is unavailable
        function = getattr(importlib.import_module(module_name), function_name)
    except Exception as exc:
        raise VerifierUnavailable(f"the verifier {verifier.python} cannot be loaded: {exc!r}") from exc
    kwargs = dict(verifier.kwargs)
    if gateway is not None and _takes_gateway(function):
        kwargs["gateway"] = gateway
    try:
        value = function(workdir, **kwargs)
    except VerifierUnavailable as exc:
        raise VerifierUnavailable(f"the verifier {verifier.python} failed: {exc!r}") from exc
    except Exception as exc:
        raise VerifierError(f"the verifier {verifier.python} failed: {exc!r}") from exc
    return reward_from_value(value)


def _run_command_verifier(task_id: str, verifier: CommandVerifier, workdir: Path) -> VerifierResult:
    # The verifier's files live outside the work directory, as they would in a sandbox.
    with tempfile.TemporaryDirectory(prefix="openforge-verifier-") as verifier_dir:
        if verifier.files is not None:
            write_files(verifier.files, Path(verifier_dir))
        try:
            done = subprocess.run(
                ["sh", "-c", verifier.command],
                cwd=workdir,
                env={**os.environ, **verifier.env, **verifier_env(task_id, verifier_dir)},
                capture_output=True,
                text=True,
                timeout=verifier.timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise VerifierError(f"the verifier ran over its timeout of {verifier.timeout} s") from exc
    return parse_verifier_output(done.stdout, done.returncode, done.stderr)


def verify_local(task: Task, workdir: Path) -> VerifierResult:
    """Run the task's verifier on `workdir` (a plain subprocess: no isolation from this machine)."""
    if isinstance(task.verifier, PythonVerifier):
        return run_python_verifier(task.verifier, workdir)
    if task.verifier.at or task.verifier.reward_files or task.workdir:
        raise VerifierError(
            f"task {task.id!r}: its verifier uses fixed paths inside a sandbox ({task.workdir or ''} "
            f"{task.verifier.at or ''} {' '.join(task.verifier.reward_files)}): run it in one "
            "(openforge tasks check)"
        )
    return _run_command_verifier(task.id, task.verifier, workdir)
