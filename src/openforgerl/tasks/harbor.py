"""Task folders in the layout users already keep their tasks in: Harbor's (Terminal-Bench 2.0's
successor, read by verifiers' HarborEnv, SkyRL and NeMo Gym), and Terminal-Bench 1's.

Harbor: one folder per task, its name the task's id::

    task.toml          [metadata] (free; `tags`, and `split` here: train, heldout or test, default test)
                       [agent] timeout_sec · [verifier] timeout_sec, env · [solution] env
                       [environment] docker_image, cpus, memory_mb (or memory "4G"), allow_internet
    instruction.md     what the agent is asked
    environment/       the image's build context (environment/Dockerfile), or see "host tools" below
    tests/test.sh      copied to /tests once the agent finished, run as `bash /tests/test.sh` in /app; it
                       writes the reward to /logs/verifier/reward.txt (a number, partial rewards too) or
                       reward.json ({"reward": x, ...}); no reward file is a verifier error
    solution/solve.sh  the reference solution (optional), copied to /solution, run in /app

The work dir is /app. A task with `[environment] docker_image` or `environment/Dockerfile` runs only in
that image (`Task.needs_image`): the Docker backend pulls or builds it, the local backend refuses the
task and names the image. A task with neither runs on the **host's tools**: the local backend runs it
directly (bubblewrap gives it /app, /tests and /logs/verifier), and its `environment/` folder, if any,
holds the initial /app, copied byte for byte. `allow_internet = false` keeps the task's sandbox on the
gateway alone even in a run with `--network host`; true (Harbor's default) leaves it to the run.

A task's files are read only from inside its folder: a symlink anywhere in it that leads out (by its
text or through another link) is refused at load, naming it, before anything is read
(`files.refuse_links_out`). Timeouts and resources are checked at load against the task schema's
ranges (`tasks.schema`), each problem naming its task.toml field.

Terminal-Bench 1 (`task.yaml` with `instruction`, `max_agent_timeout_sec`, `max_test_timeout_sec`;
`Dockerfile`, `run-tests.sh`, `tests/`, `solution.sh`) is read the same way: its Dockerfile is its
image, tests go to /tests (`$TEST_DIR`), and run-tests.sh exiting 0 is reward 1.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Annotated, Any

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openforgerl.tasks.files import TaskError, read_text, refuse_links_out, tree_digest
from openforgerl.tasks.schema import MAX_MEMORY, MIN_MEMORY, Cpus, Memory, Seconds, Task

WORKDIR = "/app"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"
REWARD_FILES = ["/logs/verifier/reward.txt", "/logs/verifier/reward.json"]
DEFAULT_SPLIT = "test"  # a task set read from elsewhere is for evaluation unless it says otherwise


class _Section(BaseModel):
    # Harbor ignores keys it does not know; so does this reader.
    model_config = ConfigDict(extra="ignore")


# The ranges are the task schema's (tasks.schema), checked here too so that a problem names its
# task.toml field: `[environment] memory_mb`, not the task's `resources.memory`.
class _Agent(_Section):
    timeout_sec: Seconds = 600.0


class _Verifier(_Section):
    timeout_sec: Seconds = 600.0
    env: dict[str, str] = Field(default_factory=dict)


class _Solution(_Section):
    env: dict[str, str] = Field(default_factory=dict)


class _Environment(_Section):
    docker_image: str | None = Field(default=None, min_length=1)
    cpus: Cpus | None = None
    memory_mb: Annotated[int, Field(ge=MIN_MEMORY >> 20, le=MAX_MEMORY >> 20)] | None = None
    memory: Memory | None = None  # the older spelling: "4G"
    allow_internet: bool = True


class _TaskYamlTimeouts(_Section):
    """Terminal-Bench 1's task.yaml timeouts, checked under their own names."""

    max_agent_timeout_sec: Seconds = 360.0
    max_test_timeout_sec: Seconds = 60.0


class _TaskToml(_Section):
    metadata: dict[str, Any] = Field(default_factory=dict)
    agent: _Agent = Field(default_factory=_Agent)
    verifier: _Verifier = Field(default_factory=_Verifier)
    solution: _Solution = Field(default_factory=_Solution)
    environment: _Environment = Field(default_factory=_Environment)


def _problems(error: ValidationError) -> str:
    """pydantic's errors as `[section] field: message`, the way a task.toml author reads them."""
    out = []
    for e in error.errors():
        loc = [str(part) for part in e["loc"]]
        where = f"[{loc[0]}] {'.'.join(loc[1:])}" if len(loc) > 1 else loc[0] if loc else "(file)"
        out.append(f"{where}: {e['msg']} (got {e.get('input')!r:.60})")
    return "; ".join(out)


def is_task_folder(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "task.yaml").is_file()


def task_folders(root: Path) -> list[Path]:
    """`root` itself where it is one task's folder, else its subfolders that are."""
    if is_task_folder(root):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and is_task_folder(p))


def load_harbor(root: str | Path) -> list[Task]:
    """Every Harbor (or Terminal-Bench 1) task folder in `root`, or `root` itself; every bad folder is
    reported together, each problem naming its file and field."""
    if not Path(root).is_dir():
        raise TaskError(f"{root}: not a folder of Harbor tasks")
    root = Path(root).resolve()
    folders = task_folders(root)
    if not folders:
        raise TaskError(f"{root}: no task folders (a folder with task.toml, or Terminal-Bench's task.yaml)")
    tasks, problems = [], []
    for folder in folders:
        try:
            refuse_links_out(folder)  # before any of its files is read
            if (folder / "task.toml").is_file():
                tasks.append(_harbor_task(folder))
            else:
                tasks.append(_terminal_bench_task(folder))
        except TaskError as exc:
            # One line per bad folder: YAML's errors span several.
            problems.append(" ".join(str(exc).split()))
    if problems:
        raise TaskError("\n".join(problems))
    return tasks


def _read_toml(path: Path) -> _TaskToml:
    try:
        raw = tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return _TaskToml.model_validate(raw)
    except ValidationError as exc:
        raise TaskError(f"{path}: {_problems(exc)}") from exc


def _memory(env: _Environment) -> int | None:
    if env.memory_mb is not None:
        return env.memory_mb << 20
    return env.memory


def _instruction(path: Path) -> str:
    if not path.is_file():
        raise TaskError(f"{path}: missing (every task needs its instruction)")
    text = read_text(path).strip()
    if not text:
        raise TaskError(f"{path}: empty")
    return text


def _tree_digest(folder: Path) -> str:
    """A digest of a build context (names, modes, bytes, links): the image tag changes with it."""
    return hashlib.sha256(orjson.dumps(sorted(tree_digest(folder).items()))).hexdigest()[:12]


def _image(folder: Path, docker_image: str | None, context: Path) -> tuple[str | None, Path | None]:
    """(image, build context): the task's own image, one built from its Dockerfile, or none."""
    if docker_image:
        return docker_image, None
    if (context / "Dockerfile").is_file():
        return f"openforge-task-{folder.name.lower()}:{_tree_digest(context)}", context
    return None, None


def _task(folder: Path, fields: dict[str, Any], where: Path) -> Task:
    try:
        return Task.model_validate(fields, context={"base_dir": folder})
    except ValidationError as exc:
        raise TaskError(f"{where}: task {folder.name!r}: {_problems(exc)}") from exc


def _harbor_task(folder: Path) -> Task:
    toml_path = folder / "task.toml"
    cfg = _read_toml(toml_path)
    test_sh = folder / "tests" / "test.sh"
    if not test_sh.is_file():
        raise TaskError(f"{test_sh}: missing (a Harbor task's verifier)")
    env = cfg.environment
    image, build = _image(folder, env.docker_image, folder / "environment")
    workspace = folder / "environment"
    split = cfg.metadata.get("split", DEFAULT_SPLIT)
    tags = cfg.metadata.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise TaskError(f"{toml_path}: [metadata] tags: a list of strings, not {tags!r:.60}")
    solve = folder / "solution" / "solve.sh"
    fields: dict[str, Any] = {
        "id": folder.name,
        "instruction": _instruction(folder / "instruction.md"),
        "split": split,
        # The host-tools task's environment/ is its initial /app; an image's is its build context.
        "files": workspace if image is None and workspace.is_dir() else {},
        "workdir": WORKDIR,
        "timeout": cfg.agent.timeout_sec,
        # Plain data, validated with the task (`_task`): a problem is a TaskError naming the file.
        "verifier": {
            "command": f"bash {TESTS_DIR}/test.sh",
            "files": folder / "tests",
            "at": TESTS_DIR,
            "reward_files": REWARD_FILES,
            "env": cfg.verifier.env,
            "timeout": cfg.verifier.timeout_sec,
        },
        "solution": {
            "command": f"bash {SOLUTION_DIR}/solve.sh",
            "files": folder / "solution",
            "at": SOLUTION_DIR,
            "env": cfg.solution.env,
            "timeout": cfg.agent.timeout_sec,
        }
        if solve.is_file()
        else None,
        "resources": {"cpus": env.cpus, "memory": _memory(env)},
        "image": image,
        "build": build,
        "needs_image": image is not None,
        "offline": not env.allow_internet,
        "tags": tags,
        "metadata": {"format": "harbor", "folder": str(folder), **cfg.metadata},
    }
    return _task(folder, fields, toml_path)


def _heredoc(script: str, env: str = "") -> str:
    """A shell command that runs `script` (a file's text) with bash, exit 0 or 1."""
    marker = "OPENFORGE_SCRIPT_END"
    while marker in script:
        marker += "_"
    return f"{env}bash -s <<'{marker}'\n{script.rstrip()}\n{marker}\n[ $? -eq 0 ]"


def _terminal_bench_task(folder: Path) -> Task:
    yaml_path = folder / "task.yaml"
    try:
        raw = yaml.safe_load(read_text(yaml_path))
    except yaml.YAMLError as exc:
        raise TaskError(f"{yaml_path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise TaskError(f"{yaml_path}: expected a mapping, got {type(raw).__name__}")
    instruction = raw.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskError(f"{yaml_path}: instruction: missing or empty")
    try:
        timeouts = _TaskYamlTimeouts.model_validate(raw)
    except ValidationError as exc:
        raise TaskError(f"{yaml_path}: {_problems(exc)}") from exc
    run_tests = folder / "run-tests.sh"
    if not run_tests.is_file():
        raise TaskError(f"{run_tests}: missing (a Terminal-Bench task's verifier)")
    image, build = _image(folder, None, folder)
    solution = folder / "solution.sh"
    test_env = f"TEST_DIR={TESTS_DIR} "
    fields: dict[str, Any] = {
        "id": folder.name,
        "instruction": instruction.strip(),
        "split": raw.get("split", DEFAULT_SPLIT),
        "workdir": WORKDIR,
        "timeout": timeouts.max_agent_timeout_sec,
        "verifier": {
            "command": _heredoc(read_text(run_tests), test_env),
            "files": folder / "tests" if (folder / "tests").is_dir() else None,
            "at": TESTS_DIR,
            "timeout": timeouts.max_test_timeout_sec,
        },
        "solution": {"command": _heredoc(read_text(solution))} if solution.is_file() else None,
        "image": image,
        "build": build,
        "needs_image": image is not None,
        "tags": raw.get("tags") or [],
        "metadata": {"format": "terminal-bench", "folder": str(folder)}
        | {k: v for k, v in raw.items() if k in ("difficulty", "category", "author_email")},
    }
    return _task(folder, fields, yaml_path)
