"""The task schema: a task is data.

Task files
----------
A task file is YAML (``.yaml``/``.yml``) or JSON Lines (``.jsonl``, one task object per line).
A YAML file holds one task, a list of tasks, or a mapping ``{defaults: {...}, tasks: [...]}`` whose
``defaults`` are merged under every task (a task's own keys win; the merge is shallow). Unknown
keys are errors, so a typo never silently drops a setting. Paths in a file are relative to it.

Fields
------
``id`` (required)
    Unique id: letters, digits, ``.``, ``_``, ``-``; starts with a letter or digit.
``instruction`` (required)
    What the agent is asked to do, given to the harness as the user's request.
``split`` (required)
    ``train``, ``heldout`` or ``test``. Required on purpose: a default would silently put evaluation
    tasks into training.
``files``
    The initial work directory: a folder path (relative to the task file) copied byte for byte, with
    its files' modes and its symlinks (which must point inside it), or inline ``{relative path: text
    content}``. Default: empty.
``setup``
    Shell commands run with ``sh -c`` in the work directory, in order, before the harness starts.
``harness``, ``harness_options``
    The harness to run the task with and its options (e.g. ``{max_turns: 10}``); ``harness: null``
    (the default) lets the run choose, which is how one task set trains several harnesses.
``verifier`` (required), one of:
    ``{command: ..., files: ..., timeout: 120}``
        run with ``sh -c`` in the work directory inside the sandbox after the harness finished. It
        prints a JSON object ``{"reward": <float in [0, 1]>, ...details}`` as its last output line,
        or prints no JSON and exits 0 (reward 1) or 1 (reward 0); any other exit status, bad JSON
        or a timeout is a verifier error on the state the agent left, scored 0 (the reward's
        contract, docs/architecture.md). ``files`` (a folder or inline, like the task's) are put
        outside the work directory only after the harness finished, so the agent never sees them.
        The command's environment has ``OPENFORGE_TASK_ID`` and ``OPENFORGE_VERIFIER_DIR`` (where
        ``files`` were put), and ``env``. ``at``: an absolute
        dir inside where ``files`` go instead (Harbor's ``/tests``). ``reward_files``: absolute
        paths inside (Harbor's ``/logs/verifier/reward.txt`` and ``reward.json``); the first one
        the command wrote gives the reward, its exit status does not count then: a ``.json`` file
        holds ``{"reward": x, ...details}`` (or one number under any name), any other holds a number.
        No reward file written (or one that cannot be cleared first) is a verifier error, scored 0.
    ``{python: "package.module:function", kwargs: {...}}``
        called in the runner's process as ``function(workdir: Path, **kwargs)`` on the final work
        directory (copied out of the sandbox); it returns a reward (float or bool) or a mapping
        ``{"reward": ..., ...details}``; an exception it raises scores 0, unless it is
        ``tasks.verify.VerifierUnavailable`` (what it needs beyond the work directory failed: an
        LLM judge that cannot be asked), which the runner retries as infrastructure, as it does a
        function that cannot be imported. Never use it to execute what the agent wrote: that belongs
        in a command verifier, inside the sandbox. A function with a ``gateway`` parameter also gets
        the gateway's URL, admin token and the scored rollout (``tasks.verify.GatewayAccess``), e.g.
        to ask an LLM judge through an upstream (``openforgerl.tasks.judge:judge``).
``solution``
    The reference solution, ``{command: ..., files: ..., at: ..., env: {...}, timeout: 600}``: the
    command runs with ``sh -c`` in the work directory; ``files`` (a folder or inline) are put at
    ``at`` (an absolute dir inside; default: outside the work directory, in
    ``OPENFORGE_SOLUTION_DIR``). ``openforge tasks check`` runs it; the runner never does.
``workdir``
    Where the work directory is inside the sandbox (absolute; Harbor's ``/app``). Default: the
    backend's own (``/workspace``). The local backend needs bubblewrap for it.
``timeout``
    Seconds the harness may run (default 600). Every timeout (the verifier's and the solution's too)
    is finite, above 0 and at most a week. A harness stopped by it is scored as a failure in an
    evaluation (``--on-failure``, reward 0 by default); RL leaves it out of the policy update
    (``openforge train --on-timeout``), since how long a rollout takes depends on the machine's load.
``timeout_is_failure``
    The time limit is part of the task (answer within it, or fail): RL trains on a rollout stopped by
    it with reward 0, as an evaluation scores it. Default false.
``resources``
    ``{memory, cpus, pids}``, each optional (the backend's default). ``memory`` takes bytes or a
    size with a unit: ``512MiB``/``512Mi`` (binary), ``1GB``/``1G`` (decimal, as in Kubernetes),
    from 16 MiB to 1 TiB; ``cpus`` from 0.01 to 1024; ``pids`` from 1 to 4194304. A value out of
    range is refused at load, naming the field.
``image``
    The container image for container backends (the environment; harness adapters install on top).
``build``
    A folder with a Dockerfile that makes ``image`` (the Docker backend builds it where missing).
``needs_image``
    The task runs only in its image (Harbor tasks with a Dockerfile or ``docker_image``): the local
    backend refuses it, naming the image. Default false: the image is optional, and the local backend
    runs the task with the host's tools.
``offline``
    The task's sandbox reaches the gateway and nothing else, even in a run with the host's network
    (Harbor's ``allow_internet = false``). Default false: the run's network decides.
``faults``
    Transient faults of the environment (`openforgerl.faults`), the same on every run of the task:
    ``{tool: read_file, match: b.txt, error: "b.txt: Resource temporarily unavailable"}`` (a
    built-in harness tool: ``read_file``, ``write_file``, ``bash``), ``{command: cat, match: b.txt,
    error: ..., exit_code: 1}`` (a program any harness runs through a shell: a shim goes first on
    its PATH), both at once (one count: the first read fails whichever way), with ``times`` (default
    1) failures before the next call succeeds; or ``{gateway: [503]}``: the rollout's first model
    calls answered with those statuses (429, 500, 503, 529).
``tags``, ``metadata``
    Free-form labels and data (e.g. what a task generator drew); the runner ignores them.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    PositiveInt,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from openforgerl.sandbox.base import SandboxError, check_tree

Split = Literal["train", "heldout", "test"]


def _kubernetes_units(value: Any) -> Any:
    # pydantic's ByteSize reads "512MiB" but not Kubernetes' "512Mi".
    if isinstance(value, str) and value.rstrip().lower().endswith(("ki", "mi", "gi", "ti")):
        return value.rstrip() + "B"
    return value


# Settings no backend can honour are refused at load, naming the field, rather than failing every
# rollout as a retried infrastructure error (or, for an infinite timeout, never stopping a hung agent).
MAX_SECONDS = 7 * 24 * 3600.0
MIN_CPUS, MAX_CPUS = 0.01, 1024.0  # 0.01: Docker's and the CFS quota's least share
MIN_MEMORY, MAX_MEMORY = 16 << 20, 1 << 40  # 16 MiB .. 1 TiB
MAX_PIDS = 1 << 22  # Linux's PID_MAX_LIMIT

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
Cpus = Annotated[float, Field(ge=MIN_CPUS, le=MAX_CPUS, allow_inf_nan=False)]


def _memory_range(value: ByteSize) -> ByteSize:
    if not MIN_MEMORY <= value <= MAX_MEMORY:
        raise ValueError(f"memory must be from 16MiB to 1TiB, not {value.human_readable()}")
    return value


Memory = Annotated[ByteSize, BeforeValidator(_kubernetes_units), AfterValidator(_memory_range)]


def _check_inline_path(path: str) -> None:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or str(p) != path:
        raise ValueError(f"inline file path {path!r} must be a plain relative path (no '..', no '/' first)")


def _resolve_files(value: Any, info: ValidationInfo) -> Any:
    """A folder is relative to the task file (passed as context by the loader), else to the cwd."""
    if isinstance(value, dict):
        for path in value:
            _check_inline_path(path)
        return value
    if isinstance(value, str | Path):
        base = Path((info.context or {}).get("base_dir", "."))
        folder = (base / value).resolve()
        if not folder.is_dir():
            raise ValueError(f"files folder {str(value)!r} is not a directory (looked at {folder})")
        try:  # what cannot travel into a sandbox byte for byte is refused here, not mid-run
            check_tree(folder)
        except SandboxError as exc:
            raise ValueError(str(exc)) from None
        return folder
    return value


Files = dict[str, str] | Path


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_inside_path(value: str | None) -> str | None:
    bad = value is not None and (
        not value.startswith("/") or not value.strip("/") or ".." in value.split("/")
    )
    if bad:
        raise ValueError(f"{value!r} must be an absolute path below / (no '..')")
    return value


class CommandVerifier(_Model):
    command: str = Field(min_length=1)
    files: Files | None = None
    timeout: Seconds = 120.0
    at: str | None = None
    reward_files: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("at")
    @classmethod
    def check_at(cls, value: str | None) -> str | None:
        return _check_inside_path(value)

    @field_validator("reward_files")
    @classmethod
    def check_reward_files(cls, value: list[str]) -> list[str]:
        for path in value:
            _check_inside_path(path)
        return value

    @field_validator("files", mode="before")
    @classmethod
    def resolve_files(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve_files(value, info)


class PythonVerifier(_Model):
    python: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    kwargs: dict[str, Any] = Field(default_factory=dict)


def _verifier_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "python" if "python" in value else "command"
    if isinstance(value, PythonVerifier):
        return "python"
    return "command" if isinstance(value, CommandVerifier) else None


Verifier = Annotated[
    Annotated[CommandVerifier, Tag("command")] | Annotated[PythonVerifier, Tag("python")],
    Discriminator(
        _verifier_kind,
        custom_error_type="verifier",
        custom_error_message="a verifier is {command: ..., files: ...} or {python: 'module:function'}",
    ),
]


class Solution(_Model):
    """A task's reference solution (see ``solution`` above)."""

    command: str = Field(min_length=1)
    files: Files | None = None
    at: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout: Seconds = 600.0

    @field_validator("files", mode="before")
    @classmethod
    def resolve_files(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve_files(value, info)

    @field_validator("at")
    @classmethod
    def check_at(cls, value: str | None) -> str | None:
        return _check_inside_path(value)


class Resources(_Model):
    memory: Memory | None = None
    cpus: Cpus | None = None
    pids: Annotated[int, Field(ge=1, le=MAX_PIDS)] | None = None


class Fault(_Model):
    """One transient fault (see ``faults`` above and `openforgerl.faults`)."""

    tool: Literal["read_file", "write_file", "bash"] | None = None
    command: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
    match: str | None = Field(default=None, min_length=1)
    times: PositiveInt = 1
    error: str = "Resource temporarily unavailable"
    exit_code: int = Field(default=1, ge=1, le=255)
    gateway: list[Literal[429, 500, 503, 529]] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def one_place(self) -> Fault:
        local = self.tool is not None or self.command is not None
        if local == (self.gateway is not None):
            raise ValueError("a fault is {tool and/or command: ...} or {gateway: [statuses]}, one of the two")
        return self


class Task(_Model):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    instruction: str = Field(min_length=1)
    split: Split
    files: Files = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)
    harness: str | None = None
    harness_options: dict[str, Any] = Field(default_factory=dict)
    verifier: Verifier
    timeout: Seconds = 600.0
    timeout_is_failure: bool = False
    resources: Resources = Field(default_factory=Resources)
    image: str | None = None
    build: Path | None = None
    needs_image: bool = False
    offline: bool = False
    workdir: str | None = None
    solution: Solution | None = None
    faults: list[Fault] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("files", mode="before")
    @classmethod
    def resolve_files(cls, value: Any, info: ValidationInfo) -> Any:
        return _resolve_files(value, info)

    @field_validator("build", mode="before")
    @classmethod
    def resolve_build(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str | Path):
            folder = (Path((info.context or {}).get("base_dir", ".")) / value).resolve()
            if not (folder / "Dockerfile").is_file():
                raise ValueError(f"build folder {str(value)!r} has no Dockerfile (looked in {folder})")
            return folder
        return value

    @field_validator("workdir")
    @classmethod
    def check_workdir(cls, value: str | None) -> str | None:
        return _check_inside_path(value)

    @model_validator(mode="after")
    def image_for_build(self) -> Task:
        if self.build is not None and not self.image:
            raise ValueError("build needs image: the tag the build makes")
        if self.needs_image and not self.image:
            raise ValueError("needs_image needs image")
        return self

    def inside_dirs(self) -> list[str]:
        """The dirs besides the work dir that the task's verifier and solution use inside the sandbox
        (Harbor's /tests, /logs/verifier, /solution): its sandboxes make them."""
        dirs: list[str] = []
        verifier = self.verifier
        if isinstance(verifier, CommandVerifier):
            dirs += [verifier.at] if verifier.at else []
            dirs += [str(PurePosixPath(p).parent) for p in verifier.reward_files]
        if self.solution is not None and self.solution.at:
            dirs.append(self.solution.at)
        unique = sorted({str(PurePosixPath(d)) for d in dirs} - {"/"})
        return [d for d in unique if d != self.workdir]
