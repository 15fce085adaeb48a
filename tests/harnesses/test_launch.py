"""One harness launch path (launch.py): every harness by name, a task's own harness first, and a
missing CLI refused before any model is loaded, with the command that installs it."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import openforgerl
from openforgerl.cli import main as cli
from openforgerl.harnesses.launch import (
    PYTHON_INSIDE,
    HarnessChoice,
    HarnessNotInstalled,
    LaunchOptions,
    harness_names,
    python_binds,
)
from openforgerl.tasks import Task, load_tasks


def _task(harness: str | None = None) -> Task:
    task = load_tasks("tools-tiny", split="heldout")[0]
    return task.model_copy(update={"harness": harness})


def test_every_adapter_and_the_built_in_harnesses_can_be_named() -> None:
    names = harness_names()
    assert names[:2] == ["react", "gui"]
    assert {"mini-swe-agent", "pi", "claude-code", "codex", "qwen-code", "opencode", "openclaw"} <= set(names)
    with pytest.raises(ValueError, match="unknown harness 'nope'"):
        HarnessChoice("nope")


def test_a_tasks_own_harness_wins_over_the_runs(tmp_path: Path) -> None:
    choice = HarnessChoice("react", LaunchOptions(cache_dir=tmp_path))
    plain, own = _task(), _task("pi")
    assert choice.name_for(plain) == "react" and choice.name_for(own) == "pi"
    assert choice.names([plain, own, plain]) == ["react", "pi"]
    # Only CLI harnesses need their install folder inside the sandbox, and an npm CLI the host's node
    # (a task's image has none).
    node = shutil.which("node")
    node_bind = [(str(Path(node).resolve()), node)] if node else []
    assert choice.ro_binds([plain]) == [] and choice.ro_binds([own]) == [str(tmp_path), *node_bind]
    assert choice.version("pi").startswith("pi ") and choice.version("react").startswith("openforgerl ")


def test_a_missing_cli_is_refused_naming_the_install_command(tmp_path: Path) -> None:
    choice = HarnessChoice("mini-swe-agent", LaunchOptions(cache_dir=tmp_path))
    choice.check([_task("react")])  # the built-in harness needs nothing installed
    with pytest.raises(HarnessNotInstalled, match="openforge harness install mini-swe-agent"):
        choice.check([_task()])


def test_the_react_launch_is_unchanged_through_the_choice(tmp_path: Path) -> None:
    class FakeSandbox:  # only what react's launch reads
        tmpdir = str(tmp_path)
        info = SimpleNamespace(backend="local")

    launch = asyncio.run(HarnessChoice("react")(_task(), "http://gw/r/ro_1", "key", FakeSandbox()))  # type: ignore[arg-type]
    assert launch.argv[1:3] == ["-m", "openforgerl.harnesses.react"] and "--max-turns" in launch.argv
    assert launch.argv[0] == sys.executable


def test_in_a_container_react_runs_on_the_images_python_with_the_bound_modules(tmp_path: Path) -> None:
    """#36: a task's image does not hold the project: the harness's modules are bound read-only at
    PYTHON_INSIDE, and the image's python3 runs them."""

    class FakeSandbox:
        tmpdir = "/tmp"
        info = SimpleNamespace(backend="docker")

    launch = asyncio.run(HarnessChoice("react")(_task(), "http://gw/r/ro_1", "key", FakeSandbox()))  # type: ignore[arg-type]
    assert launch.argv[:3] == ["python3", "-m", "openforgerl.harnesses.react"]
    assert launch.env == {"PYTHONPATH": PYTHON_INSIDE}
    binds = dict(python_binds("docker"))
    assert binds[str(Path(openforgerl.__file__).parent / "harnesses" / "react.py")] == (
        f"{PYTHON_INSIDE}/openforgerl/harnesses/react.py"
    )
    assert all(inside.startswith(PYTHON_INSIDE) for inside in binds.values())


def test_eval_refuses_a_missing_cli_before_loading_a_model(tmp_path: Path) -> None:
    env = {"OPENFORGE_HARNESS_CACHE": str(tmp_path / "empty")}
    args = ["eval", "--tasks", "tools-tiny", "--harness", "react,pi", "--model", str(tmp_path / "no-model")]
    done = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out")], env=env)
    assert done.exit_code == 1, done.output
    assert "harness pi" in done.output and "openforge harness install pi" in done.output
    twice = CliRunner().invoke(cli, ["rollout", "--tasks", "tools-tiny", "--harness", "react,pi"])
    assert twice.exit_code == 2 and "rollout runs one harness" in twice.output


def test_train_and_sft_take_every_harness_by_name(tmp_path: Path) -> None:
    for command in (["train", "--out", str(tmp_path / "run")], ["sft", "--teacher", "oracle"]):
        bad = CliRunner().invoke(cli, [*command, "--model", str(tmp_path), "--harness", "nope"])
        assert bad.exit_code == 2 and "unknown harness 'nope'; one of react, gui, claude-code" in bad.output
        two = CliRunner().invoke(cli, [*command, "--model", str(tmp_path), "--harness", "react,pi"])
        assert two.exit_code == 2 and "one harness here" in two.output
    assert "mini-swe-agent" in CliRunner().invoke(cli, ["train", "--help"]).output
