"""One launch path for every harness: the built-in ones (react, gui) and each agent CLI adapter.

    choice = HarnessChoice("mini-swe-agent", LaunchOptions(max_turns=8))
    choice.check(tasks)                        # a missing CLI: HarnessNotInstalled, naming the fix
    cfg = RunnerConfig(..., ro_binds=[*python_binds(), *choice.ro_binds(tasks)])
    Runner(cfg, LocalBackend(), choice)        # a HarnessFactory: each task under its harness

A task that names its own `harness` runs under it; the others run under the run's default, which is
how one task set is evaluated or trained under several harnesses. `openforge eval|rollout|train|sft
--harness NAME` and the veRL agent loop all choose harnesses here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from openforgerl import __version__
from openforgerl import harnesses as cli_adapters
from openforgerl.harnesses.base import Harness
from openforgerl.runner import HarnessFactory, HarnessLaunch, cli_harness, gui_harness, react_harness
from openforgerl.sandbox import Sandbox
from openforgerl.tasks import Task

BUILTIN = ("react", "gui")


def harness_names() -> list[str]:
    """Every harness a run can name: the built-in ones, then the CLI adapters."""
    return [*BUILTIN, *cli_adapters.HARNESSES]


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
        return cli_adapters.get(name, self.opts.cache_dir)

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

    def ro_binds(self, tasks: Sequence[Task]) -> list[str]:
        """What the sandboxes must see read-only besides Python: the CLIs' install folders."""
        return sorted({str(self.adapter(n).cache_dir) for n in self.names(tasks) if n not in BUILTIN})

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
