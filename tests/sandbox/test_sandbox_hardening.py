"""Local sandboxes against the agent inside them (issue #24, item 7): what the kernel hides from the
sandbox's host uid, the seccomp filter, and the package source kept out of sight.

The uid tests need a root runner (as CI's is); the rest need only bubblewrap.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import stat
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from openforgerl.harnesses.launch import SANDBOX_MODULES, HarnessLaunch, python_binds, python_hidden
from openforgerl.rollouts.runner import Runner, RunnerConfig
from openforgerl.sandbox import ExecResult, Limits, Sandbox, SandboxSpec, SandboxUnavailable, seccomp
from openforgerl.sandbox import local as local_module
from openforgerl.sandbox.local import LocalBackend
from openforgerl.tasks import CommandVerifier, Task, load_tasks
from tests.gateway_helpers import ScriptEngine, running_gateway

T = TypeVar("T")

PYTHON = os.path.realpath(sys.executable)
PY_BINDS = () if PYTHON.startswith("/usr/") else (os.path.realpath(sys.base_prefix),)
SMALL = Limits(memory_bytes=256 << 20, cpus=1.0, pids=64, wall_time_s=60)
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the runner drops to another uid only as root")


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


def backend(**kw: Any) -> LocalBackend:
    try:
        return LocalBackend(bwrap=True, **kw)
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap unusable here ({e}); CI installs the Debian package bubblewrap")


@pytest.fixture(scope="module")
def bwrap() -> LocalBackend:
    return backend()


async def with_sandbox(
    backend: LocalBackend, spec: SandboxSpec, name: str, body: Callable[[Sandbox], Awaitable[T]]
) -> T:
    sb = backend.create(spec, name)
    await sb.start()
    try:
        return await body(sb)
    finally:
        await sb.stop()


def secrets(top: Path) -> Path:
    """A bound tree with what only root may read: a 0600 file, a 0640 root:root file, a 0700 dir."""
    bound = top / "bound"
    (bound / "private").mkdir(parents=True)
    (bound / "public.txt").write_text("public\n")
    (bound / "secret.txt").write_text("secret\n")
    (bound / "secret.txt").chmod(0o600)
    (bound / "group.txt").write_text("group secret\n")
    (bound / "group.txt").chmod(0o640)
    (bound / "private" / "inside.txt").write_text("hidden inside\n")
    (bound / "private" / "inside.txt").chmod(0o644)
    (bound / "private").chmod(0o700)
    return bound


READ = 'for f in public.txt secret.txt group.txt private/inside.txt; do cat "$1/$f" || echo "DENIED $f"; done'


@needs_root
def test_root_only_files_under_binds_are_unreadable(tmp_path: Path) -> None:
    # The state dir, the bound tree and the interpreter all lie under dirs (pytest's 0700 /tmp/pytest-of-root,
    # /root) that the sandbox's uid may not enter: the backend binds them through mount points it can.
    state = tmp_path / "state"
    state.mkdir()
    bound = secrets(tmp_path)
    sandboxes = backend(state_dir=state)
    uid, gid = sandboxes.host_user or (0, 0)
    assert uid != 0 and "user" in sandboxes.check().available, sandboxes.check()
    spec = SandboxSpec(files={"task/input.txt": "x"}, limits=SMALL, ro_binds=(str(bound), *PY_BINDS))

    async def body(sb: Sandbox) -> tuple[ExecResult, str]:
        r = await sb.exec(["sh", "-c", READ, "sh", str(bound)])
        # Ordinary work goes on: its own files (the runner's included) are its to change.
        work = await sb.exec(
            "cat /etc/shadow || echo DENIED shadow; echo more >> task/input.txt; echo made > made.txt"
        )
        assert work.ok and work.stdout.endswith("DENIED shadow\n"), work
        assert (await sb.exec([PYTHON, "-I", "-c", "print(6 * 7)"])).stdout == "42\n"
        assert await sb.get_file("task/input.txt") == b"xmore\n"
        assert sb.info.host_dir
        host = Path(sb.info.host_dir) / "work"
        for name in ("made.txt", "task", "task/input.txt"):
            st = os.stat(host / name)
            assert (st.st_uid, st.st_gid) == (uid, gid), name
        assert stat.S_IMODE(os.stat(sb.info.host_dir).st_mode) == 0o710
        return r, sb.name

    r, name = run(with_sandbox(sandboxes, spec, "hidden-files", body))
    assert r.stdout.splitlines() == [
        "public",
        "DENIED secret.txt",
        "DENIED group.txt",
        "DENIED private/inside.txt",
    ], r
    assert r.stderr.count("Permission denied") == 3
    assert not any(state.iterdir())
    # The mount points it bound through (outside the unreachable state dir) are gone too.
    assert not list(Path("/tmp").glob(f"openforgerl-{name}-*"))


def test_a_runner_that_keeps_root_reads_as_before(tmp_path: Path) -> None:
    """host_user uid 0 (or a runner that is not root) keeps today's mapping: the sandbox's uid is the
    runner's, /etc is masked where others may not read, and the backend says what it does not hide."""
    bound = secrets(tmp_path)
    if ROOT:
        sandboxes = backend(host_user=(0, 0))
        assert "readable" in sandboxes.check().missing["user"]
    else:
        sandboxes = backend()
        assert "own uid" in sandboxes.check().available["user"]
    assert sandboxes.host_user is None and sandboxes.drop_argv == []

    async def body(sb: Sandbox) -> ExecResult:
        shadow = "; [ -s /etc/shadow ] && echo READ shadow || echo masked shadow"
        return await sb.exec(["sh", "-c", READ + shadow, "sh", str(bound)])

    r = run(with_sandbox(sandboxes, SandboxSpec(limits=SMALL, ro_binds=(str(bound),)), "as-before", body))
    # The runner's own files: readable, as they are to the runner (the private dir's 0700 included).
    lines = r.stdout.splitlines()
    assert lines[:2] == ["public", "secret"] and lines[-1] == "masked shadow", r
    with pytest.raises(ValueError, match="uid"):
        local_module._host_user("nobody")
    assert local_module._host_user("1234") == (1234, 1234)
    assert local_module._host_user("1234:99") == (1234, 99)


# -- seccomp --------------------------------------------------------------------------------------

PROBE = """
import ctypes, errno, json, os, socket, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(NUMBERS[name]), *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
NUMBERS = json.loads(sys.argv[1])
out["ptrace"] = call("ptrace", 7, os.getpid(), 0, 0)  # PTRACE_CONT on itself: ESRCH without a filter
out["unshare"] = call("unshare", 0)  # a no-op without a filter
out["io_uring_setup"] = call("io_uring_setup", 1, 0)  # EFAULT without a filter
out["keyctl"] = call("keyctl", 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
out["seccomp"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
# What agents do all day still works: processes, threads, pipes, sockets, files.
t = threading.Thread(target=lambda: None); t.start(); t.join()
a, b = socket.socketpair(); a.send(b"x"); assert b.recv(1) == b"x"
shell = subprocess.run(["sh", "-c", "echo hi > f && cat f && rm f"], capture_output=True, text=True)
out["shell"] = shell.stdout
print(json.dumps(out))
"""


def probe(sandboxes: LocalBackend) -> tuple[dict[str, Any], ExecResult]:
    import json

    arch = seccomp.native_arch()
    if arch is None:
        pytest.skip(f"no system call table for {os.uname().machine}")
    numbers = {n: seccomp.SYSCALLS[arch][n] for n in ("ptrace", "unshare", "io_uring_setup", "keyctl")}

    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec([PYTHON, "-I", "-c", PROBE, json.dumps(numbers)])

    r = run(with_sandbox(sandboxes, SandboxSpec(limits=SMALL, ro_binds=PY_BINDS), "seccomp", body))
    assert r.ok, r
    return json.loads(r.stdout), r


def test_seccomp_denies_what_agents_never_need(bwrap: LocalBackend) -> None:
    assert "seccomp" in bwrap.check().available
    out, _ = probe(bwrap)
    assert out["seccomp"] == "2"  # filter mode
    assert {k: out[k] for k in ("ptrace", "unshare", "io_uring_setup", "keyctl")} == dict.fromkeys(
        ("ptrace", "unshare", "io_uring_setup", "keyctl"), "EPERM"
    ), out
    assert out["shell"] == "hi\n"

    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec(
            "unshare -U true || echo refused; unshare -m true || echo refused; "
            "mkdir m && mount -t tmpfs none m || echo refused"
        )

    r = run(with_sandbox(bwrap, SandboxSpec(limits=SMALL), "no-ns", body))
    assert r.stdout == "refused\n" * 3 and r.stderr.count("Operation not permitted") >= 2, r


def test_without_the_filter_the_same_calls_pass(bwrap: LocalBackend) -> None:
    """The control: with seccomp=False the probe's calls get the kernel's own answers, so the EPERMs
    above are the filter's."""
    unfiltered = backend(seccomp=False)
    assert unfiltered.check().missing["seccomp"] == "disabled by configuration"
    out, _ = probe(unfiltered)
    assert out["seccomp"] == "0" and out["ptrace"] == "ESRCH" and out["unshare"] == "ok"
    assert out["io_uring_setup"] != "EPERM" and out["shell"] == "hi\n"


@pytest.mark.parametrize("arch", sorted(seccomp.SYSCALLS))
def test_filter_program(arch: str) -> None:
    prog = seccomp.program(arch)
    assert prog is not None and len(prog) % 8 == 0
    native = seccomp.AUDIT_ARCH[arch]
    table = seccomp.SYSCALLS[arch]
    assert set(table) <= set(seccomp.DENIED) and len(set(seccomp.DENIED) - set(table)) <= 3
    deny = seccomp.RET_ERRNO | errno.EPERM
    for name, nr in table.items():
        assert seccomp.evaluate(prog, nr, native) == deny, name
    denied = set(table.values())
    for nr in [n for n in range(0, 460) if n not in denied] + [-1]:
        assert seccomp.evaluate(prog, nr, native) == seccomp.RET_ALLOW, nr
    # Another ABI's numbers mean other calls: refused whole.
    other = next(a for a in seccomp.AUDIT_ARCH.values() if a != native)
    assert seccomp.evaluate(prog, 0, other) == seccomp.RET_KILL_PROCESS
    assert seccomp.evaluate(prog, 0, 0x40000003) == seccomp.RET_KILL_PROCESS  # i386
    if arch == "x86_64":
        assert seccomp.evaluate(prog, 0x40000000 | 101, native) == seccomp.RET_KILL_PROCESS  # x32


HEADERS = {
    "x86_64": ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"],
    "aarch64": ["/usr/include/asm-generic/unistd.h"],
}


@pytest.mark.parametrize("arch", sorted(seccomp.SYSCALLS))
def test_syscall_numbers_match_the_kernel_headers(arch: str) -> None:
    header = next((Path(h) for h in HEADERS[arch] if Path(h).is_file()), None)
    if header is None:
        pytest.skip(f"no {arch} system call header here (Debian package linux-libc-dev)")
    numbers = {k: int(v) for k, v in re.findall(r"#define __NR_(\w+)\s+(\d+)\b", header.read_text())}
    assert {n: numbers.get(n) for n in seccomp.SYSCALLS[arch]} == seccomp.SYSCALLS[arch]
    # What the table leaves out, the architecture lacks.
    assert not [n for n in seccomp.DENIED if n not in seccomp.SYSCALLS[arch] and n in numbers]


# -- the package source ---------------------------------------------------------------------------


def test_only_the_harness_modules_of_the_package_are_visible(bwrap: LocalBackend) -> None:
    import openforgerl

    package = Path(openforgerl.__file__).parent
    solutions = package / "tasks" / "suites" / "claw_basic" / "solutions"
    assert any(solutions.iterdir())
    spec = SandboxSpec(limits=SMALL, ro_binds=python_binds(), hidden=python_hidden())

    async def body(sb: Sandbox) -> list[ExecResult]:
        return [
            await sb.exec(["sh", "-c", 'cd "$1" && find . -type f | sort', "sh", str(package)]),
            await sb.exec(f"cat {solutions}/*.sh; ls {package}/tasks; touch {package}/x"),
            await sb.exec([sys.executable, "-c", "import openforgerl.tasks"]),
            await sb.exec([sys.executable, "-c", "import openforgerl.web.verify"]),
            await sb.exec([sys.executable, "-m", "openforgerl.harnesses.react", "--help"]),
            await sb.exec(
                [
                    sys.executable,
                    "-c",
                    "import openforgerl.harnesses.gui, openforgerl.web.serve, openforgerl.web.shop",
                ]
            ),
        ]

    files, leak, tasks, verify, react, gui = run(with_sandbox(bwrap, spec, "pkg", body))
    assert files.stdout.splitlines() == sorted(f"./{m}" for m in SANDBOX_MODULES), files
    assert leak.stdout == "" and "Read-only file system" in leak.stderr, leak
    for r in (tasks, verify):
        assert r.exit_code == 1 and "No module named 'openforgerl." in r.stderr, r
    assert react.ok and "--base-url" in react.stdout, react
    assert gui.ok, gui


def test_the_runner_hides_the_package_from_its_agents(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Through the runner's defaults: an agent that looks for the tasks' code and reference solutions
    finds nothing, and the verifier (which reads the work dir back) says so."""
    import openforgerl

    task = load_tasks("tools-tiny", split="heldout")[0]
    package = Path(openforgerl.__file__).parent
    look = (
        f"cat {package}/tasks/suites/tools_tiny.py {package}/tasks/suites/claw_basic/solutions/*.sh"
        f" {package}/__pycache__/*.pyc > leaked.txt 2>/dev/null; ls {package} > seen.txt"
    )
    check = CommandVerifier(
        command='sh "$OPENFORGE_VERIFIER_DIR/check.sh"',
        files={
            "check.sh": "test ! -s leaked.txt && grep -qx harnesses seen.txt && ! grep -q tasks seen.txt\n"
        },
    )

    async def harness(task: Task, base_url: str, api_key: str, sandbox: Any) -> HarnessLaunch:
        return HarnessLaunch(["sh", "-c", look], {})

    with running_gateway(tiny_model_dir, tmp_path, ScriptEngine(tiny_model_dir)) as gw:
        cfg = RunnerConfig(
            gateway_url=gw.url, admin_token=gw.gateway.admin_token, run_id="t", state_path=tmp_path / "r.db"
        )
        assert cfg.hidden == python_hidden() and set(python_binds()) <= set(cfg.ro_binds)
        runner = Runner(cfg, backend(), harness)

        async def go() -> Any:
            try:
                return await runner.run([task.model_copy(update={"verifier": check})])
            finally:
                await runner.close()

        [r] = asyncio.run(go())
    assert r.reward == 1.0, r


def test_hidden_paths_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="absolute"):
        SandboxSpec(hidden=("relative",))


def test_hidden_paths_are_empty_inside_except_binds_below_them(bwrap: LocalBackend, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "pkg" / "deep").mkdir(parents=True)
    for name in ("pkg/deep/answer.txt", "pkg/shown.txt", "pkg/other.txt", "top.txt", "keep.txt"):
        (tree / name).write_text(name + "\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "all.txt").write_text("all\n")
    spec = SandboxSpec(
        limits=SMALL,
        # The same package seen through two binds, a bind below a hidden dir, a whole bind hidden.
        ro_binds=(str(tree), (str(tree / "pkg"), "/alias"), str(tree / "pkg" / "shown.txt"), str(other)),
        hidden=(str(tree / "pkg"), str(tree / "top.txt"), str(other), str(tmp_path / "no-such-path")),
    )

    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec(
            [
                "sh",
                "-c",
                'cd "$1" && find . "$2" /alias -type f | sort && cat top.txt keep.txt',
                "sh",
                str(tree),
                str(other),
            ]
        )

    r = run(with_sandbox(bwrap, spec, "masks", body))
    assert r.stdout.splitlines() == ["./keep.txt", "./pkg/shown.txt", "./top.txt", "keep.txt"], r
