"""Workspaces as real ones are (another encoding, a binary, an executable, links) and the verifiers
that check them byte for byte: the local sandboxes' tests (sandbox/test_workspace.py) and the
Docker backend's."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from openforgerl.rollouts import steps
from openforgerl.rollouts.check import tree_digest
from openforgerl.sandbox import Limits
from openforgerl.tasks import Task

LIMITS = Limits(memory_bytes=512 << 20, cpus=1.0, pids=128, wall_time_s=60)
UTF16 = "name,city\nJürgen,Köln\n".encode("utf-16")  # with its byte-order mark
# Looks like gzip (its magic number) but is not: any "repair" on the way would change it.
BINARY = b"\x1f\x8b\x08\x00" + bytes(range(256)) + b"\xff\xfe\x00\r\n\x80"
SCRIPT = b"#!/bin/sh\necho run\n"


def make_workspace(top: Path) -> Path:
    """A folder holding what real workspaces hold: another encoding, a binary, an executable, links."""
    top.mkdir()
    (top / "data.csv").write_bytes(UTF16)
    (top / "blob.gz").write_bytes(BINARY)
    (top / "run.sh").write_bytes(SCRIPT)
    (top / "run.sh").chmod(0o755)
    (top / "private.txt").write_bytes(b"only mine\n")
    (top / "private.txt").chmod(0o600)
    (top / "sub" / "deeper").mkdir(parents=True)
    (top / "sub" / "deeper" / "note.txt").write_bytes(b"no newline at the end")
    os.symlink("data.csv", top / "latest.csv")
    os.symlink("../../blob.gz", top / "sub" / "deeper" / "blob-link")
    return top


# What a command verifier checks inside: every byte (against digests taken here), modes and links.
def inside_check(top: Path) -> str:
    digest = tree_digest(top)
    checks = []
    for rel, what in sorted(digest.items()):
        if what.startswith("link "):
            checks.append(f'[ "$(readlink {rel})" = "{what[5:]}" ]')
        elif what != "dir":
            mode, sha = what.split()
            checks.append(f'[ "$(stat -c %a {rel})" = "{mode}" ]')
            checks.append(f'[ "$(sha256sum < {rel} | cut -d" " -f1)" = "{sha}" ]')
    return " && ".join(checks)


def same_tree(workdir: Path, expected: dict[str, str]) -> dict[str, Any]:
    """A Python verifier: reward 1 when the copy it was given equals the workspace, link for link."""
    got = tree_digest(workdir)
    differ = sorted(p for p in got.keys() | expected.keys() if got.get(p) != expected.get(p))
    return {"reward": float(not differ), "differ": differ}


def task_with(workspace: Path, verifier: Any, workdir: str | None = None) -> Task:
    return Task(
        id="bytes",
        instruction="nothing to do",
        split="test",
        files=workspace,
        verifier=verifier,
        workdir=workdir,
    )


async def verify_in_sandbox(backend: Any, task: Task) -> float:
    spec = steps.task_spec(task, limits=LIMITS, network="none", gateway_url=None)
    async with backend.create(spec, f"ws-{uuid.uuid4().hex[:12]}") as sandbox:
        return (await steps.verify(task, sandbox)).reward
