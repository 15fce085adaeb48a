"""One launch path for every harness: the built-in ones (react, gui) and each agent CLI adapter.

    choice = HarnessChoice("mini-swe-agent", LaunchOptions(max_turns=8))
    choice.check(tasks)                        # a missing CLI: HarnessNotInstalled, naming the fix
    job = RolloutJob(choice, run_id, state_path)   # openforgerl.rollouts.service: each task under its harness

A task that names its own `harness` runs under it; the others run under the run's default, which is
how one task set is evaluated or trained under several harnesses. `openforge eval|rollout|train|sft
--harness NAME` and the veRL agent loop all choose harnesses here.

The runner calls a `HarnessFactory` per rollout: (task, the rollout's base URL as the sandbox reaches
it, its API key, the sandbox) -> a `HarnessLaunch` (argv, environment, files to put first). The
built-in harnesses run this package's own modules with this interpreter: `python_binds()` is what a
sandbox must see for that, and `python_hidden()` the rest of the package, which it must not.
"""

from __future__ import annotations

import asyncio
import posixpath
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openforgerl import __version__
from openforgerl.harnesses import adapters
from openforgerl.harnesses.base import Harness, NpmHarness
from openforgerl.harnesses.gui import EXIT_INFRA as GUI_EXIT_INFRA
from openforgerl.sandbox import Sandbox
from openforgerl.tasks import Task

BUILTIN = ("react", "gui")
# Containers (a task's own image, which does not hold this package): where python_binds binds the
# modules the built-in harnesses run, read-only, for the image's own python3.
PYTHON_INSIDE = "/opt/openforgerl/python"
CONTAINERS = ("docker", "kubernetes")
# In the sandbox's temp dir (`Sandbox.tmpdir`), outside the work dir: the agent never sees it.
TASK_FILE = "openforge-task.txt"  # the built-in harnesses' instruction


@dataclass(frozen=True)
class HarnessLaunch:
    """How to run a harness inside a sandbox: argv and environment, given the rollout's endpoint."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # extra files to put in the sandbox first
    # The exit code by which the harness says its environment failed, not the policy (e.g. a browser
    # that did not start): the rollout is retried as an infrastructure failure, never scored.
    infra_exit_code: int | None = None


# A harness factory: (task, inside base_url, api_key, sandbox) -> launch.
HarnessFactory = Callable[[Task, str, str, Sandbox], Awaitable[HarnessLaunch]]


def _own_package(python: str) -> dict[str, str]:
    """The env that makes this interpreter import, inside a local sandbox, the very package the
    runner runs (bound there by python_binds): a source tree on PYTHONPATH is not on the venv's own
    path, which may name another checkout. Other interpreters (an image's python3) keep theirs."""
    if python != sys.executable:
        return {}
    import openforgerl

    return {"PYTHONPATH": str(Path(openforgerl.__file__).parent.parent)}


def _python(python: str, sandbox: Sandbox) -> tuple[str, dict[str, str]]:
    """The interpreter that runs a built-in harness in `sandbox`, and its env: `python` in a local
    sandbox (bound inside), the image's python3 in a container, on the modules bound at PYTHON_INSIDE
    (a Pod's image must hold them there, or openforgerl installed)."""
    if sandbox.info.backend in CONTAINERS:
        return "python3", {"PYTHONPATH": PYTHON_INSIDE}
    return python, _own_package(python)


def react_harness(
    max_turns: int = 12, max_tokens: int | None = None, python: str = sys.executable
) -> HarnessFactory:
    """The built-in ReAct harness (harnesses/react.py), run with `python`: this interpreter for
    local sandboxes (bound read-only inside), the image's `python3` (with openforgerl installed) in
    containers and Pods."""

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        turns = int(task.harness_options.get("max_turns", max_turns))
        task_file = posixpath.join(sandbox.tmpdir, TASK_FILE)
        py, env = _python(python, sandbox)
        argv = [py, "-m", "openforgerl.harnesses.react", "--base-url", base_url, "--api-key", api_key]
        argv += ["--task", f"@{task_file}", "--max-turns", str(turns)]
        if max_tokens:
            argv += ["--max-tokens", str(max_tokens)]
        return HarnessLaunch(argv, env, {task_file: task.instruction})

    return launch


GUI_MAX_STEPS = 15  # OSWorld's smallest limit; it also runs 50 and 100


def gui_harness(
    max_steps: int | None = None,
    max_tokens: int | None = None,
    python: str = sys.executable,
    a11y: bool = False,
    width: int = 640,
    height: int = 480,
) -> HarnessFactory:
    """The built-in GUI harness (harnesses/gui.py): headless Chromium on the task's local site
    (`harness_options.site`, e.g. web-basic's) or at `harness_options.start_url`. `max_steps` (e.g.
    15, 50 or 100) overrides the task's own `harness_options.max_steps` (default 15); `a11y` adds
    the accessibility tree to each screenshot (for text-only policies)."""

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        opts = task.harness_options
        steps = max_steps or int(opts.get("max_steps", GUI_MAX_STEPS))
        task_file = posixpath.join(sandbox.tmpdir, TASK_FILE)
        py, env = _python(python, sandbox)
        argv = [py, "-m", "openforgerl.harnesses.gui", "--base-url", base_url, "--api-key", api_key]
        argv += ["--task", f"@{task_file}", "--max-steps", str(steps)]
        if opts.get("site"):
            argv += ["--site", str(opts["site"])]
        elif opts.get("start_url"):
            argv += ["--start-url", str(opts["start_url"])]
        else:
            raise ValueError(f"task {task.id}: the gui harness needs harness_options.site or start_url")
        argv += ["--width", str(width), "--height", str(height)]
        if a11y or opts.get("a11y"):
            argv.append("--a11y")
        if max_tokens:
            argv += ["--max-tokens", str(max_tokens)]
        return HarnessLaunch(argv, env, {task_file: task.instruction}, infra_exit_code=GUI_EXIT_INFRA)

    return launch


def cli_harness(harness: Harness, model: str = "policy", max_turns: int | None = None) -> HarnessFactory:
    """A real agent CLI (harnesses/adapters.py) inside the sandbox; `max_turns` (or the task's
    `harness_options.max_turns`) reaches the CLI's own turn limit where it has one.

    The adapter writes its config files into a scratch HOME on the host; they are copied into the
    sandbox's own HOME, and host paths in the environment are rewritten to the inside ones. The
    harness's install folder and its runtime (runtime_binds) must be visible inside, at the host's
    paths (RunnerConfig.ro_binds): so it runs in a task's own image too.
    """

    async def launch(task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        probe = await sandbox.exec(["sh", "-c", 'printf %s "$HOME"'], timeout=30)
        home = probe.stdout.strip() or sandbox.tmpdir
        turns = task.harness_options.get("max_turns", max_turns)
        return await asyncio.to_thread(
            _prepare_cli, harness, task, base_url, api_key, model, home, sandbox.workdir, turns
        )

    return launch


def _prepare_cli(
    harness: Harness,
    task: Task,
    base_url: str,
    api_key: str,
    model: str,
    home: str,
    workdir: str,
    max_turns: int | None,
) -> HarnessLaunch:
    with tempfile.TemporaryDirectory(prefix="openforge-home-") as scratch:
        turns = int(max_turns) if max_turns else None
        env = harness.prepare(Path(scratch), Path(workdir), base_url, api_key, model, turns)
        files = {
            f"{home}/{p.relative_to(scratch)}": p.read_text(errors="replace")
            for p in Path(scratch).rglob("*")
            if p.is_file()
        }
        env = {k: v.replace(scratch, home) for k, v in env.items()}
    return HarnessLaunch(harness.command(task.instruction), env, files)


# The package's files that the built-in harnesses run inside a sandbox: the ReAct loop, the GUI
# harness and the site server it starts. The rest of the package is hidden there (python_hidden).
SANDBOX_MODULES = (
    "__init__.py",
    "py.typed",
    "faults.py",
    "harnesses/__init__.py",
    "harnesses/builtin.py",
    "harnesses/react.py",
    "harnesses/gui.py",
    "harnesses/gui_browser.py",
    *(f"web/{m}.py" for m in ("__init__", "common", "serve", "shop", "booking", "wiki", "settings")),
)


def python_binds(backend: str = "local") -> list[str | tuple[str, str]]:
    """What the sandbox must see read-only for this interpreter and package to run inside it: the
    interpreter, the venv, the package's folder (hidden by python_hidden()) and SANDBOX_MODULES. A
    container runs its image's python3: it gets SANDBOX_MODULES alone, at PYTHON_INSIDE."""
    import openforgerl

    package = Path(openforgerl.__file__).parent
    if backend in CONTAINERS:
        inside = f"{PYTHON_INSIDE}/openforgerl"
        return [(str(package / m), f"{inside}/{m}") for m in SANDBOX_MODULES if (package / m).is_file()]
    paths = {sys.prefix, sys.base_prefix, str(package.parent)}
    binds: list[str | tuple[str, str]] = sorted(
        p for p in paths if not p.startswith(("/usr", "/bin", "/lib"))
    )
    return binds + [str(package / m) for m in SANDBOX_MODULES if (package / m).is_file()]


def runtime_binds(harness: Harness) -> list[str | tuple[str, str]]:
    """The host's runtime that a CLI's install runs on, seen at the host's path: a task's image has
    neither this interpreter nor Node. A venv's base interpreter (pyvenv.cfg's `home`: the venv's
    python links there; one under /usr is the image's own to have) and, for an npm CLI, the host's
    node binary (the image's libc and libstdc++ must do for it)."""
    found: list[str | tuple[str, str]] = []
    cfg = Path(getattr(harness, "venv", "/nonexistent")) / "pyvenv.cfg"
    if cfg.is_file():
        keys = dict(line.partition(" = ")[::2] for line in cfg.read_text().splitlines())
        home = keys.get("home", "").strip()
        if home and not home.startswith(("/usr", "/bin")):
            found.append(str(Path(home).parent))
    node = shutil.which("node") if isinstance(harness, NpmHarness) else None
    if node:
        found.append((str(Path(node).resolve()), node))
    return found


def python_hidden() -> list[str]:
    """What python_binds() shows that the agent must not see (RunnerConfig.hidden): the package's
    folder, which sandboxes replace by an empty one holding only SANDBOX_MODULES. Out of sight so:
    the task suites (their verifiers, expected outputs and reference solutions), the web tasks'
    checks, the gateway, the trainer, and the compiled __pycache__ of them all."""
    import openforgerl

    return [str(Path(openforgerl.__file__).parent)]


def harness_names() -> list[str]:
    """Every harness a run can name: the built-in ones, then the CLI adapters."""
    return [*BUILTIN, *adapters.HARNESSES]


class HarnessNotInstalled(RuntimeError):
    """A run needs an agent CLI that is not installed at its pinned version."""


@dataclass(frozen=True)
class LaunchOptions:
    max_turns: int = 12  # react's turns; a CLI's own turn limit where it has one (mini-swe-agent)
    max_tokens: int | None = None  # per model call (the built-in harnesses ask for it)
    max_steps: int | None = None  # the gui harness's step limit (None: the task's)
    cache_dir: Path | None = None  # where the CLIs are installed (None: default_cache_dir())
    model: str = "policy"  # the model name a CLI is configured to ask for


class HarnessChoice:
    """The runner's HarnessFactory for a run: each task under its own harness, else `default`."""

    def __init__(self, default: str, opts: LaunchOptions | None = None) -> None:
        check_name(default)
        self.default = default
        self.opts = opts or LaunchOptions()
        self._factories: dict[str, HarnessFactory] = {}

    def name_for(self, task: Task) -> str:
        return task.harness or self.default

    def names(self, tasks: Sequence[Task]) -> list[str]:
        """The harnesses `tasks` run under, in order of first use."""
        return list(dict.fromkeys(self.name_for(t) for t in tasks))

    def adapter(self, name: str) -> Harness:
        return adapters.get(name, self.opts.cache_dir)

    def check(self, tasks: Sequence[Task]) -> None:
        """Every harness `tasks` need is known and installed, before a model is loaded."""
        for name in self.names(tasks):
            check_name(name)
            if name in BUILTIN:
                continue
            found = self.adapter(name).check()
            if not found.ok:
                raise HarnessNotInstalled(
                    f"harness {name} {found.pinned} is not ready: {found.missing}. "
                    f"Install it with `openforge harness install {name}`"
                    f" (into {self.adapter(name).cache_dir})."
                )

    def ro_binds(self, tasks: Sequence[Task]) -> list[str | tuple[str, str]]:
        """What the sandboxes must see read-only besides Python: the CLIs' install folders and the
        runtimes they run on (runtime_binds)."""
        found: dict[str, str | tuple[str, str]] = {}
        for adapter in (self.adapter(n) for n in self.names(tasks) if n not in BUILTIN):
            for bind in (str(adapter.cache_dir), *runtime_binds(adapter)):
                found[bind if isinstance(bind, str) else bind[1]] = bind
        return [found[k] for k in sorted(found)]

    def version(self, name: str) -> str:
        """What a report names: an adapter's pinned version, or this package's for a built-in one."""
        return f"openforgerl {__version__}" if name in BUILTIN else f"{name} {self.adapter(name).version}"

    def factory(self, name: str) -> HarnessFactory:
        if name not in self._factories:
            o = self.opts
            if name == "react":
                self._factories[name] = react_harness(o.max_turns, o.max_tokens)
            elif name == "gui":
                self._factories[name] = gui_harness(o.max_steps, o.max_tokens)
            else:
                self._factories[name] = cli_harness(self.adapter(name), o.model, o.max_turns)
        return self._factories[name]

    async def __call__(self, task: Task, base_url: str, api_key: str, sandbox: Sandbox) -> HarnessLaunch:
        return await self.factory(self.name_for(task))(task, base_url, api_key, sandbox)


def check_name(name: str) -> None:
    if name not in harness_names():
        raise ValueError(f"unknown harness {name!r}; one of {', '.join(harness_names())}")
