"""Byte-exact workspaces (#26): a task's folder arrives in the sandbox byte for byte, with its files'
modes and its symlinks, and comes back so to its verifier (a command one in place, a Python one as a
copy). Local sandboxes with and without bubblewrap here; the Docker backend in test_docker.py."""

from __future__ import annotations

import asyncio
import os
import tarfile
from pathlib import Path

import pytest

from openforgerl.rollouts.check import tree_digest
from openforgerl.sandbox import SandboxError, SandboxSpec, SandboxUnavailable
from openforgerl.sandbox.container import stdin_chunks, stdin_size, tar_dir
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import CommandVerifier, PythonVerifier, TaskError, load_task_file
from tests.workspace_helpers import (
    UTF16,
    inside_check,
    make_workspace,
    task_with,
    verify_in_sandbox,
)


@pytest.fixture(scope="module")
def bwrap() -> LocalBackend:
    try:
        return LocalBackend(bwrap=True)
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap unusable here ({e})")


@pytest.fixture(scope="module", params=["bwrap", "plain"])
def local(request: pytest.FixtureRequest) -> LocalBackend:
    if request.param == "plain":
        return LocalBackend(bwrap=False)
    return request.getfixturevalue("bwrap")  # type: ignore[no-any-return]


def test_the_workspace_arrives_and_comes_back_byte_exact(local: LocalBackend, tmp_path: Path) -> None:
    top = make_workspace(tmp_path / "ws")
    expected = tree_digest(top)
    assert expected["data.csv"].startswith("644 ") and expected["run.sh"].startswith("755 ")
    command = CommandVerifier(command=inside_check(top))
    python = PythonVerifier(python="tests.workspace_helpers:same_tree", kwargs={"expected": expected})
    assert asyncio.run(verify_in_sandbox(local, task_with(top, command))) == 1.0
    assert asyncio.run(verify_in_sandbox(local, task_with(top, python))) == 1.0


def test_the_checks_can_fail(local: LocalBackend, tmp_path: Path) -> None:
    """The same verifiers score a workspace that differs by one byte, one mode or one link 0."""
    top = make_workspace(tmp_path / "ws")
    command = CommandVerifier(command=inside_check(top))
    expected = tree_digest(top)
    python = PythonVerifier(python="tests.workspace_helpers:same_tree", kwargs={"expected": expected})
    changed = make_workspace(tmp_path / "changed")
    (changed / "data.csv").write_bytes(UTF16[2:])  # the byte-order mark lost, as text handling did
    assert asyncio.run(verify_in_sandbox(local, task_with(changed, command))) == 0.0
    assert asyncio.run(verify_in_sandbox(local, task_with(changed, python))) == 0.0
    (changed / "data.csv").write_bytes(UTF16)
    (changed / "run.sh").chmod(0o644)
    assert asyncio.run(verify_in_sandbox(local, task_with(changed, command))) == 0.0


def test_a_workdir_of_the_tasks_own(bwrap: LocalBackend, tmp_path: Path) -> None:
    """Harbor's /app: the workspace is there, and absolute paths into it work."""
    top = make_workspace(tmp_path / "ws")
    check = '[ "$(pwd)" = /app ] && cmp /app/blob.gz blob.gz && [ -x /app/run.sh ]'
    verifier = CommandVerifier(command=check)
    assert asyncio.run(verify_in_sandbox(bwrap, task_with(top, verifier, workdir="/app"))) == 1.0


def test_without_bubblewrap_a_workdir_of_its_own_is_refused(tmp_path: Path) -> None:
    spec = SandboxSpec(workdir="/app", extra_dirs=["/tests"])
    with pytest.raises(SandboxUnavailable, match=r"/app, /tests .*bubblewrap"):
        LocalBackend(bwrap=False).create(spec, "no-app")


def test_links_that_leave_the_workspace_are_refused(tmp_path: Path) -> None:
    top = make_workspace(tmp_path / "ws")
    os.symlink("/etc/passwd", top / "escape")
    (tmp_path / "tasks.yaml").write_text(
        "id: t\ninstruction: x\nsplit: test\nfiles: ws\nverifier: {command: 'true'}\n"
    )
    with pytest.raises(TaskError, match=r"escape: a symlink to '/etc/passwd', outside the workspace"):
        load_task_file(tmp_path / "tasks.yaml")
    os.unlink(top / "escape")
    os.symlink("../../outside", top / "sub" / "up")
    with pytest.raises(TaskError, match=r"sub/up: a symlink to '../../outside'"):
        load_task_file(tmp_path / "tasks.yaml")
    # Out through another link (#35): `sub/top -> ..` stays inside, `leak -> sub/top/../secret` looks
    # as if it did, but resolves to the file beside the workspace.
    os.unlink(top / "sub" / "up")
    (tmp_path / "secret.txt").write_text("CANARY\n")
    os.symlink("..", top / "sub" / "top")
    os.symlink("sub/top/../secret.txt", top / "leak")
    assert (top / "leak").read_text() == "CANARY\n"
    with pytest.raises(TaskError, match=r"leak: a symlink to 'sub/top/../secret.txt', outside the workspace"):
        load_task_file(tmp_path / "tasks.yaml")
    os.unlink(top / "leak")
    os.unlink(top / "sub" / "top")
    # Made after the task was loaded, it is refused when the sandbox starts.
    task = load_task_file(tmp_path / "tasks.yaml")[0]
    os.symlink("/", top / "root")
    with pytest.raises(SandboxError, match="outside the workspace"):
        asyncio.run(verify_in_sandbox(LocalBackend(bwrap=False), task))


def test_the_container_carrier_keeps_bytes_modes_and_links(tmp_path: Path) -> None:
    """Docker and Kubernetes get the workspace as one tar stream (tar_dir, spooled to a file and sent
    in chunks, never whole in memory): unpacked, it is the same."""
    top = make_workspace(tmp_path / "ws")
    with tar_dir(top) as archive:
        size = stdin_size(archive)
        (tmp_path / "ws.tar").write_bytes(b"".join(stdin_chunks(archive, 1000)))
    assert size == (tmp_path / "ws.tar").stat().st_size > 10_000
    with tarfile.open(tmp_path / "ws.tar") as tar:
        assert {m.name for m in tar.getmembers() if m.issym()} == {"latest.csv", "sub/deeper/blob-link"}
        tar.extractall(tmp_path / "out", filter="fully_trusted")
    assert tree_digest(tmp_path / "out") == tree_digest(top)
