"""The Docker backend against a real Docker engine: skipped where none is reachable.

`make test-docker` starts Debian's dockerd here (no bridge, no iptables: containers get no network but
what the backend gives them) and imports a debootstrap image, then runs this file with DOCKER_HOST and
OPENFORGE_DOCKER_IMAGE set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from click.testing import CliRunner

from openforgerl.cli import main as cli
from openforgerl.rollouts.check import tree_digest
from openforgerl.sandbox import Limits, SandboxSpec
from openforgerl.sandbox.docker import DockerBackend, DockerConfig, collect_garbage
from openforgerl.tasks import CommandVerifier, PythonVerifier, load_tasks

IMAGE = os.environ.get("OPENFORGE_DOCKER_IMAGE", "openforgerl/debian:bookworm")


@pytest.fixture(scope="module")
def engine() -> docker.DockerClient:
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        pytest.skip(f"no Docker engine reachable ({e}); `make test-docker` starts one")
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        pytest.skip(f"image {IMAGE} is missing; `make test-docker` imports it")
    return client


def backend(run: str) -> DockerBackend:
    return DockerBackend(DockerConfig(run_id=run, image=IMAGE))


def ours(engine: docker.DockerClient, run: str) -> list[Any]:
    return engine.containers.list(all=True, filters={"label": f"openforgerl.dev/run={run}"})


@pytest.fixture
def gateway() -> Iterator[str]:
    """A stand-in for the gateway on the host's loopback: answers every GET with the path."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"gateway saw {self.path}".encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def test_container_runs_commands_and_moves_files(engine: docker.DockerClient, tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "f.txt").write_text("in a tree")
    spec = SandboxSpec(files={"task.txt": "hello"}, limits=Limits(memory_bytes=256 << 20, wall_time_s=60))

    async def go() -> None:
        async with backend("dock").create(spec, "dock-r1") as sb:
            [ctr] = ours(engine, "dock")
            host = ctr.attrs["HostConfig"]
            assert (host["Memory"], host["MemorySwap"], host["NetworkMode"]) == (256 << 20, 256 << 20, "none")
            assert host["ReadonlyRootfs"] and host["CapDrop"] == ["ALL"]
            done = await sb.exec("cat task.txt; echo $X >&2; id -u; exit 3", env={"X": "env"})
            assert (done.exit_code, done.stdout, done.stderr) == (3, "hello1000\n", "env\n")
            assert (await sb.exec(["cat"], stdin=b"piped")).stdout == "piped"
            await sb.put_dir(tmp_path / "tree", "/tmp/d")
            await sb.put_file("b.bin", bytes(range(256)))
            assert await sb.get_file("b.bin") == bytes(range(256))
            assert await sb.get_file("/tmp/d/f.txt") == b"in a tree"
            slow = await sb.exec("sleep 30", timeout=1)
            assert slow.killed_by == "wall-time" and slow.timed_out
            blocked = await sb.exec(["python3", "-c", GET, "http://127.0.0.1:9/"])
            assert not blocked.ok  # no network at all

    asyncio.run(go())
    assert not ours(engine, "dock")


def test_memory_limit_kills_are_reported(engine: docker.DockerClient) -> None:
    spec = SandboxSpec(limits=Limits(memory_bytes=64 << 20, pids=64, wall_time_s=60))

    async def go() -> Any:
        async with backend("dock-oom").create(spec, "dock-oom-r1") as sb:
            return await sb.exec(["python3", "-c", "x = bytearray(512 << 20)"])

    hog = asyncio.run(go())
    assert hog.killed_by == "oom", hog


def test_only_the_gateway_is_reachable(engine: docker.DockerClient, gateway: str) -> None:
    spec = SandboxSpec(network="gateway", gateway_url=gateway, env={"BASE": f"{gateway}/v1"})

    async def go() -> tuple[Any, Any]:
        async with backend("dock-net").create(spec, "dock-net-r1") as sb:
            assert sb.gateway_url is not None
            seen = await sb.exec(["sh", "-c", 'python3 -c "$0" "$BASE/models"', GET])
            other = await sb.exec(["python3", "-c", GET, "http://127.0.0.1:9/"])
            return seen, other

    seen, other = asyncio.run(go())
    assert seen.stdout == "gateway saw /v1/models\n", seen
    assert not other.ok


def test_gc_removes_containers_left_behind(engine: docker.DockerClient) -> None:
    async def leave() -> None:
        sb = backend("dock-gc").create(SandboxSpec(), "dock-gc-r1")
        await sb.start()  # and never stopped, as if the runner had died

    asyncio.run(leave())
    assert len(ours(engine, "dock-gc")) == 1
    assert collect_garbage() == []  # its runner (this process) is alive
    found = CliRunner().invoke(cli, ["gc", "--backend", "docker", "--run", "dock-gc"])
    assert "removed container/openforge-dock-gc-r1 (run dock-gc)" in found.output, found.output
    assert not ours(engine, "dock-gc")


def test_doctor_checks_the_engine(engine: docker.DockerClient) -> None:
    done = CliRunner().invoke(cli, ["doctor", "--backend", "docker"])
    assert "ok       engine: Docker" in done.output, done.output


def test_the_workspace_arrives_byte_exact_in_a_container(engine: docker.DockerClient, tmp_path: Path) -> None:
    """#26: another encoding, a binary, an executable and links, in /workspace and in a task's /app."""
    from tests.test_workspace import inside_check, make_workspace, same_tree, task_with, verify_in_sandbox

    top = make_workspace(tmp_path / "ws")
    expected = tree_digest(top)
    command = CommandVerifier(command=inside_check(top))
    python = PythonVerifier(python="tests.test_workspace:same_tree", kwargs={"expected": expected})
    assert same_tree(top, expected)["reward"] == 1.0
    for workdir in (None, "/app"):
        for verifier in (command, python):
            task = task_with(top, verifier, workdir=workdir)
            assert asyncio.run(verify_in_sandbox(backend("dock-ws"), task)) == 1.0, (workdir, verifier)
    assert not ours(engine, "dock-ws")


def test_a_harbor_dockerfile_task_checks_in_its_own_image(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    """#26: the image is built from environment/Dockerfile (what it put in /app is there), tests go
    to /tests, the reward comes from /logs/verifier; refused on local (test_harbor.py), sound here."""
    from tests.test_harbor import harbor_task

    root = tmp_path / "set"
    harbor_task(
        root,
        "seeded",
        test_sh='#!/bin/bash\n[ "$(cat /app/answer.txt)" = "$(cat /app/seed.txt)" ] && echo 1 > '
        "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n",
        solve_sh="#!/bin/bash\ncp /app/seed.txt /app/answer.txt\n",
        dockerfile=f"FROM {IMAGE}\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\n",
        workspace={"seed.txt": b"\xff\xfebinary seed\n"},
    )
    [task] = load_tasks(root)
    try:
        result = CliRunner().invoke(
            cli, ["tasks", "check", str(root), "--backend", "docker", "--image", IMAGE]
        )
        assert result.exit_code == 0, result.output
        assert result.output.startswith("ok   seeded (untouched 0.00; solved 1.00, 1.00)"), result.output
        assert engine.images.get(str(task.image))
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.images.remove(str(task.image), force=True)


def test_a_task_with_its_own_workdir_gets_its_images_files_there() -> None:
    """No engine needed: what the container is asked for. Harbor's /app is a volume Docker fills from
    the image, the image's user runs in it, /tests and /logs/verifier are writable for that user."""
    spec = SandboxSpec(workdir="/app", extra_dirs=["/tests", "/logs/verifier"], image="task:1")
    kwargs = backend("dock-app").create(spec, "dock-app-r1")._run_kwargs()
    [mount] = kwargs["mounts"]
    assert (mount["Target"], mount["Type"], mount.get("Source")) == ("/app", "volume", None)
    assert (kwargs["working_dir"], kwargs["user"], kwargs["image"]) == ("/app", None, "task:1")
    assert sorted(kwargs["tmpfs"]) == ["/home/sandbox", "/logs/verifier", "/tests", "/tmp"]
    assert all("mode=1777" in options for options in kwargs["tmpfs"].values())
    plain = backend("dock-app").create(SandboxSpec(), "dock-app-r2")._run_kwargs()
    assert (plain["mounts"], plain["user"], sorted(plain["tmpfs"])) == (
        [],
        "1000:1000",
        ["/home/sandbox", "/tmp", "/workspace"],
    )
