"""The Docker backend against a real Docker engine: skipped where none is reachable.

`make test-docker` starts Debian's dockerd here (no bridge, no iptables: containers get no network but
what the backend gives them) and imports a debootstrap image, then runs this file with DOCKER_HOST and
OPENFORGE_DOCKER_IMAGE set; `make test-real-model` runs its `real_model` test (SmolLM2) the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
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
    from tests.workspace_helpers import (
        inside_check,
        make_workspace,
        same_tree,
        task_with,
        verify_in_sandbox,
    )

    top = make_workspace(tmp_path / "ws")
    expected = tree_digest(top)
    command = CommandVerifier(command=inside_check(top))
    python = PythonVerifier(python="tests.workspace_helpers:same_tree", kwargs={"expected": expected})
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
    from tests.harbor_helpers import harbor_task

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


# -- #36: image-bound Harbor tasks through tasks check, eval and train on the Docker backend -----------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor" / "images"
TINY = ["--max-turns", "2", "--max-tokens", "12", "--concurrency", "2"]


@pytest.fixture
def base_image(engine: docker.DockerClient) -> str:
    """The examples' FROM image (`make docker-base`); what docker_engine.sh imports."""
    from openforgerl.sandbox.choice import DEFAULT_IMAGE

    if IMAGE != DEFAULT_IMAGE:
        pytest.skip(f"the examples are FROM {DEFAULT_IMAGE}; this engine's base image is {IMAGE}")
    return IMAGE


def test_the_example_image_tasks_check_in_their_images(base_image: str) -> None:
    result = CliRunner().invoke(cli, ["tasks", "check", f"harbor:{EXAMPLES}", "--backend", "docker"])
    assert result.exit_code == 0, result.output
    assert "3 task(s): 3 passed, 0 failed" in result.output, result.output


def test_eval_runs_the_tiny_model_inside_the_tasks_own_images(
    base_image: str, engine: docker.DockerClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The built-in ReAct harness runs on each image's python3 (the project is not in the image: its
    harness modules are bound read-only), reaching the gateway through the relay, with no network."""
    out = tmp_path / "eval"
    args = ["eval", "--tasks", f"harbor:{EXAMPLES}", "--backend", "docker", "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(cli, [*args, *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert (report["rollouts"], report["status"]) == (3, {"done": 3}), report
    assert report["outcomes"] == {"ok": 3}, report  # the harness ran to its end in every image
    assert report["behaviour"]["turns_median"] >= 1 and report["tokens"]["completion"] > 0
    assert not ours(engine, out.name)


@pytest.mark.harness
@pytest.mark.parametrize("name", ["mini-swe-agent", "pi"])
def test_eval_runs_a_real_agent_cli_inside_a_tasks_image(
    name: str, base_image: str, engine: docker.DockerClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The CLI is not in the image: its install folder is bound read-only, and the host's runtime it
    runs on (mini-swe-agent's venv's base Python, pi's node: harnesses/launch.py runtime_binds).
    The tiny model's calls reach the gateway from inside the image, and the rollout ends with a
    verdict, the CLI having run to its own end."""
    from openforgerl.harnesses.adapters import get

    if not get(name).check().ok:
        pytest.skip(f"{name} is not installed: {get(name).check().missing} (make test-docker installs it)")
    out = tmp_path / "eval"
    args = ["eval", "--tasks", f"harbor:{EXAMPLES}/word-count", "--backend", "docker", "--harness", name]
    result = CliRunner().invoke(cli, [*args, "--model", str(tiny_model_dir), *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert (report["status"], report["outcomes"]) == ({"done": 1}, {"ok": 1}), report
    assert report["tokens"]["training"]["calls"] >= 1 and report["tokens"]["completion"] > 0, report
    assert not ours(engine, out.name)


@pytest.mark.real_model
def test_eval_runs_smollm2_inside_a_tasks_image(
    base_image: str, engine: docker.DockerClient, smollm2_dir: Path, tmp_path: Path
) -> None:
    """The real pretrained model (`make test-real-model`) on one image-bound task, one sample: its
    tokenizer and template through the gateway, the ReAct harness on the image's python3."""
    from tests.harness_helpers import recorded_calls

    out = tmp_path / "eval"
    args = ["eval", "--tasks", f"harbor:{EXAMPLES}/word-count", "--backend", "docker"]
    args += ["--model", str(smollm2_dir), "--max-turns", "2", "--max-tokens", "32", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert (report["status"], report["outcomes"]) == ({"done": 1}, {"ok": 1}), report
    calls = [r for r in recorded_calls(out / "gateway.db") if r.status == "ok"]
    assert calls and all(r.completion_ids for r in calls)
    assert any(lp < -1e-3 for r in calls for lp in r.completion_logprobs)  # sampled by the model
    assert not ours(engine, out.name)


def test_one_grpo_step_on_image_bound_tasks(base_image: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--tasks", f"harbor:{EXAMPLES}", "--backend", "docker", "--model", str(tiny_model_dir)]
    args += ["--out", str(run), "--steps", "1", "--batch-tasks", "1", "--group", "2", "--keep-zero-variance"]
    result = CliRunner().invoke(cli, [*args, *TINY])
    assert result.exit_code == 0, result.output
    assert "1 steps, policy version 1" in result.output, result.output
    [row] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["outcomes"] == {"ok": 2} and row["rollout_tokens"] > 0, row  # both in their image


@pytest.mark.harness
def test_one_grpo_step_with_the_model_generating_inside_pi_in_the_tasks_images(
    base_image: str, engine: docker.DockerClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`train --backend docker --harness pi`: 2 tasks x 2 rollouts, each pi inside its task's image,
    every turn sampled by the tiny model; the step trains on them and pushes version 1."""
    from openforgerl.harnesses.adapters import get
    from tests.harness_helpers import recorded_calls

    if not get("pi").check().ok:
        pytest.skip(f"pi is not installed: {get('pi').check().missing} (make test-docker installs it)")
    run = tmp_path / "run"
    args = ["train", "--tasks", f"harbor:{EXAMPLES}", "--backend", "docker", "--harness", "pi"]
    args += ["--model", str(tiny_model_dir), "--out", str(run), "--steps", "1", "--batch-tasks", "2"]
    result = CliRunner().invoke(cli, [*args, "--group", "2", "--keep-zero-variance", *TINY])
    assert result.exit_code == 0, result.output
    assert "1 steps, policy version 1" in result.output, result.output
    [row] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert (row["step"], row["updated"], row["outcomes"]) == (1, True, {"ok": 4}), row
    assert row["rollout_tokens"] > 0 and "loss" in row, row
    calls = [r for r in recorded_calls(run / "gateway.db") if r.status == "ok"]
    assert len({r.rollout_id for r in calls}) == 4 and {r.policy_version for r in calls} == {0}
    assert any(lp < -1e-3 for r in calls for lp in r.completion_logprobs)  # sampled by the model
    assert any("operating inside pi" in json.dumps(r.messages_delta) for r in calls)  # pi's own prompt
    assert not ours(engine, run.name)


def test_a_bad_image_fails_its_own_task_and_no_other(
    base_image: str, engine: docker.DockerClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A Dockerfile that fails to build and a FROM image that is neither present nor pullable (no
    registry here): each task is marked an infrastructure failure naming it and its image, at once
    (no retry makes an image), and the good task runs."""
    from tests.harbor_helpers import REWARD_TXT, SOLVE_42, harbor_task

    root = tmp_path / "set"
    shutil.copytree(EXAMPLES / "word-count", root / "word-count")
    harbor_task(
        root, "broken-build", test_sh=REWARD_TXT, solve_sh=SOLVE_42, dockerfile=f"FROM {IMAGE}\nRUN exit 3\n"
    )
    harbor_task(
        root, "missing-from", test_sh=REWARD_TXT, solve_sh=SOLVE_42, dockerfile="FROM openforgerl/absent:1\n"
    )
    out = tmp_path / "eval"
    args = ["eval", "--tasks", f"harbor:{root}", "--backend", "docker", "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(cli, [*args, *TINY, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == {"done": 1, "infra_failed": 2}, report
    broken, missing = report["infra_errors"]["broken-build"], report["infra_errors"]["missing-from"]
    assert "attempt 1: task 'broken-build': building its image openforge-task-broken-build:" in broken
    assert "failed" in broken and "attempt 2" not in broken
    assert "task 'missing-from': building its image openforge-task-missing-from:" in missing
    assert "(its FROM image openforgerl/absent:1 is neither on the engine nor pullable)" in missing
    assert "- infra broken-build: attempt 1: task 'broken-build'" in (out / "report.md").read_text()
    checked = CliRunner().invoke(cli, ["tasks", "check", str(root), "--backend", "docker"])
    assert checked.exit_code == 1, checked.output
    assert "ok   word-count" in checked.output, checked.output
    assert "FAIL broken-build" in checked.output and "FAIL missing-from" in checked.output


def _outward_address() -> str:
    """This host's address on its outward interface (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            pytest.skip("this host has no outward interface")
        address = str(s.getsockname()[0])
    if address.startswith("127."):
        pytest.skip("this host has no outward address")
    return address


def test_allow_internet_false_holds_in_the_tasks_image(base_image: str, tmp_path: Path) -> None:
    """Checked with the host's network allowed: the offline task's container still reaches nothing,
    not even a listener on this host's own address."""
    from tests.harbor_helpers import harbor_task

    address = _outward_address()
    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    reach = (
        "import socket; s = socket.socket(); s.settimeout(3)\n"
        f"try:\n    s.connect(({address!r}, {port})); print('reached')\n"
        "except OSError:\n    print('blocked')\n"
    )
    test_sh = (
        f'#!/bin/bash\nif [ -f /app/done ] && [ "$(python3 -c "{reach}")" = blocked ]; then echo 1; '
        "else echo 0; fi > /logs/verifier/reward.txt\n"
    )
    harbor_task(
        tmp_path / "set",
        "offline",
        test_sh=test_sh,
        solve_sh="#!/bin/bash\ntouch /app/done\n",
        environment="allow_internet = false",
        dockerfile=f"FROM {IMAGE}\nWORKDIR /app\n",
    )
    try:
        checked = CliRunner().invoke(
            cli, ["tasks", "check", str(tmp_path / "set"), "--backend", "docker", "--network", "host"]
        )
    finally:
        listener.close()
    assert checked.exit_code == 0, checked.output
    assert checked.output.startswith("ok   offline (untouched 0.00; solved 1.00, 1.00)"), checked.output


def test_one_backend_option_makes_the_runs_backend(tmp_path: Path) -> None:
    """No engine needed: --backend's settings reach the backend the run makes, a setting it does not
    know is a usage error before anything runs, and train keeps the choice for --resume."""
    from openforgerl.cli.options import backend_choice
    from openforgerl.rl.config import TrainOptions

    settings = tmp_path / "docker.yaml"
    settings.write_text("runtime: runsc\ntmpfs_size: 2g\n")
    kw = {
        "backend": "docker",
        "image": "img:1",
        "docker_host": "unix:///x.sock",
        "backend_config": str(settings),
    }
    choice = backend_choice(kw)
    made = choice.make("run-1")
    assert isinstance(made, DockerBackend) and not kw
    assert made.cfg == DockerConfig(
        run_id="run-1", image="img:1", base_url="unix:///x.sock", runtime="runsc", tmpfs_size="2g"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such: 1\n")
    args = ["--tasks", "tools-tiny", "--gateway", "http://127.0.0.1:9", "--backend", "docker"]
    for command in ("eval", "rollout"):
        result = CliRunner().invoke(cli, [command, *args, "--backend-config", str(bad)])
        assert result.exit_code == 2 and "the docker backend has no setting no_such" in result.output
    opts = TrainOptions(model="m", out=tmp_path, backend=choice)
    assert TrainOptions.from_json(json.loads(json.dumps(opts.to_json()))).backend == choice
    assert TrainOptions.from_json({**opts.to_json(), "backend": None}).backend.name == "local"  # older runs


def test_a_container_killed_mid_rollout_is_scored_or_retried_by_who_killed_it(
    engine: docker.DockerClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The reward's contract on a real engine, in one run: the agent's own program eating memory is
    OOM-killed (its doing: scored, the harness's own death by it 0); the agent ending its container
    from inside (`kill -9 -1`) is scored too; `docker kill` from outside is infrastructure, retried,
    and the retry scores. No other rollout of the run is lost."""
    import threading as th

    from openforgerl.harnesses.launch import HarnessLaunch
    from openforgerl.rollouts.results import Status
    from openforgerl.rollouts.runner import Runner, RunnerConfig
    from openforgerl.sandbox.docker import DockerSandbox
    from openforgerl.tasks import Task
    from tests.gateway_helpers import ScriptEngine, running_gateway

    hog = "python3 -c 'x = bytearray(512 << 20)'"
    commands = {  # each task's harness: a shell command, per attempt
        "plain": ["touch a.txt"],
        "hog-in-a-tool": [f"{hog}; touch a.txt"],  # the hog dies, the harness goes on
        "hog-is-the-harness": [f"exec {hog}"],
        "kills-its-container": ["kill -9 -1; sleep 30"],
        "killed-from-outside": ["sleep 60; touch a.txt", "touch a.txt"],
    }
    attempts: dict[str, int] = {}

    async def harness(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
        n = attempts[task.id] = attempts.get(task.id, 0) + 1
        if task.id == "killed-from-outside" and n == 1:
            assert isinstance(sandbox, DockerSandbox)
            th.Timer(3, sandbox._container.kill).start()
        return HarnessLaunch(["sh", "-c", commands[task.id][min(n, 2) - 1]], {})

    tasks = [
        Task(id=t, instruction="-", split="test", verifier=CommandVerifier(command="test -f a.txt"))
        for t in commands
    ]
    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        cfg = RunnerConfig(
            gateway_url=gw.url,
            admin_token=gw.gateway.admin_token,
            run_id="dock-kill",
            state_path=tmp_path / "runner.db",
            concurrency=5,
            limits=Limits(memory_bytes=128 << 20, pids=128, wall_time_s=120),
            ro_binds=[],
            hidden=[],
        )
        runner = Runner(cfg, backend("dock-kill"), harness)

        async def go() -> Any:
            try:
                return await runner.run(tasks)
            finally:
                await runner.close()

        results = {r.task_id: r for r in asyncio.run(go())}
    got = {t: (r.status, r.reward, r.outcome, r.attempts) for t, r in results.items()}
    assert got == {
        "plain": (Status.DONE, 1.0, "ok", 1),
        "hog-in-a-tool": (Status.DONE, 1.0, "ok", 1),
        "hog-is-the-harness": (Status.DONE, 0.0, "killed:oom", 1),
        "kills-its-container": (Status.DONE, 0.0, "killed:signal 9", 1),
        "killed-from-outside": (Status.DONE, 1.0, "ok", 2),
    }, got
    assert not ours(engine, "dock-kill")
