"""claw-basic: every verifier rejects the untouched work directory and accepts the reference solution."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from openforgerl.tasks import Task, VerifierError, load_tasks, prepare_local, verify_local
from openforgerl.tasks.suites import CLAW_BASIC_DIR

TASKS = load_tasks("claw-basic")
SOLUTIONS = CLAW_BASIC_DIR / "solutions"


@pytest.fixture(autouse=True, scope="module")
def python3_is_this_interpreter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Verifiers and solutions call `python3`, the sandbox's; here it is the interpreter running the
    tests, so the result does not depend on this machine's PATH (and skips slow version-manager shims)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python3").symlink_to(sys.executable)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        yield


def test_the_suite() -> None:
    assert len(TASKS) >= 30 and len({t.id for t in TASKS}) == len(TASKS)
    assert {p.stem for p in SOLUTIONS.glob("*.sh")} == {t.id for t in TASKS}
    assert {t.split for t in TASKS} == {"train", "test"}
    assert all(t.files or not t.setup for t in TASKS)


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_verifier_rejects_the_untouched_state_and_accepts_the_solution(task: Task, tmp_path: Path) -> None:
    work = tmp_path / "work"
    prepare_local(task, work)
    untouched = verify_local(task, work)
    assert untouched.reward == 0.0 and untouched.details["failed"]
    assert not any("crashed" in f for f in untouched.details["failed"]), untouched.details
    subprocess.run(["bash", str(SOLUTIONS / f"{task.id}.sh")], cwd=work, check=True, capture_output=True)
    solved = verify_local(task, work)
    assert solved.reward == 1.0, solved.details
    assert not (work / "checks.py").exists() and not (work / "expected").exists()


def test_an_unknown_task_is_a_verifier_error(tmp_path: Path) -> None:
    task = TASKS[0].model_copy(update={"id": "not-in-the-suite"})
    with pytest.raises(VerifierError, match="no check for task 'not-in-the-suite'"):
        verify_local(task, tmp_path)
