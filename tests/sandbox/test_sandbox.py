"""The local sandbox backend: isolation, the gateway bridge, limits, timeouts, output caps, clean-up.

bwrap tests skip where bubblewrap is missing, limit tests where cgroup v1 is not writable (CI has both).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from openforgerl.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    SandboxUnavailable,
)
from openforgerl.sandbox.local import LocalBackend, LocalSandbox

T = TypeVar("T")

PYTHON = os.path.realpath(sys.executable)
# The test interpreter, visible inside (pyenv and venv interpreters live outside /usr).
PY_BINDS = () if PYTHON.startswith("/usr/") else (os.path.realpath(sys.base_prefix),)
SMALL = Limits(memory_bytes=256 << 20, cpus=1.0, pids=64, wall_time_s=30)


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@pytest.fixture(scope="module")
def bwrap() -> LocalBackend:
    try:
        return LocalBackend(bwrap=True)
    except SandboxUnavailable as e:
        pytest.skip(f"bubblewrap unusable here ({e}); CI installs the Debian package bubblewrap")


@pytest.fixture(scope="module")
def plain() -> LocalBackend:
    return LocalBackend(bwrap=False)


@pytest.fixture(params=["bwrap", "plain"])
def backend(request: pytest.FixtureRequest) -> LocalBackend:
    return request.getfixturevalue(request.param)


def needs_cgroups(backend: LocalBackend) -> None:
    if not backend.cgroups:
        pytest.skip(f"cgroup v1 not writable here: {backend.check().missing.get('cgroups')}")


async def with_sandbox(
    backend: SandboxBackend, spec: SandboxSpec, name: str, body: Callable[[Sandbox], Awaitable[T]]
) -> T:
    sb = backend.create(spec, name)
    await sb.start()
    try:
        return await body(sb)
    finally:
        await sb.stop()


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{check} still false after {within} s")


def live_processes(command: str) -> list[psutil.Process]:
    """Live processes running exactly `command` (not the shells or bwraps that mention it)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and p.info["cmdline"] == command.split():
            found.append(p)
    return found


def test_protocols_and_spec_checks(plain: LocalBackend) -> None:
    assert isinstance(plain, SandboxBackend)

    async def is_sandbox(sb: Sandbox) -> bool:
        return isinstance(sb, Sandbox)

    assert run(with_sandbox(plain, SandboxSpec(), "proto", is_sandbox))
    with pytest.raises(ValueError, match="gateway_url"):
        SandboxSpec(network="gateway")
    with pytest.raises(ValueError, match="gateway_url"):
        SandboxSpec(network="gateway", gateway_url="localhost:8000")
    with pytest.raises(ValueError, match="absolute"):
        SandboxSpec(ro_binds=("relative/dir",))
    with pytest.raises(ValueError, match="does not exist"):
        plain.create(SandboxSpec(ro_binds=("/no/such/dir",)), "binds")
    with pytest.raises(ValueError, match="name"):
        plain.create(SandboxSpec(), "../escape")


def test_exec_put_get_round_trip(backend: LocalBackend, tmp_path: Path) -> None:
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("X = 1\n")
    (tmp_path / "src" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "src" / "run.sh").chmod(0o755)
    spec = SandboxSpec(files={"task/README": "do it"}, env={"GREETING": "hi"}, limits=SMALL)

    async def body(sb: Sandbox) -> None:
        assert (await sb.exec("cat task/README")).stdout == "do it"
        r = await sb.exec(
            ["sh", "-c", 'echo "$GREETING $EXTRA"; pwd; cat; exit 3'],
            env={"EXTRA": "x"},
            cwd="task",
            stdin="in",
        )
        assert (r.exit_code, r.stdout, r.killed_by) == (3, f"hi x\n{sb.workdir}/task\nin", None)
        await sb.put_file("out/deep/a.bin", b"\x00\xff", mode=0o600)
        assert await sb.get_file(f"{sb.workdir}/out/deep/a.bin") == b"\x00\xff"
        await sb.put_dir(tmp_path / "src", "tools")
        assert (await sb.exec("./tools/run.sh && cat tools/pkg/mod.py")).stdout == "ran\nX = 1\n"
        await sb.exec("echo made > made.txt")
        assert await sb.get_file("made.txt") == b"made\n"
        r = await sb.exec("kill -TERM $$")
        assert (r.exit_code, r.killed_by) == (143, "signal 15")
        assert (await sb.exec(["no-such-command"])).exit_code != 0

    run(with_sandbox(backend, spec, f"rt-{backend.isolation}", body))


def test_file_ops_refuse_escapes(backend: LocalBackend, tmp_path: Path) -> None:
    outside = tmp_path / "host-file"
    outside.write_text("host secret")

    async def body(sb: Sandbox) -> None:
        # A link the sandbox plants must never make the runner read or write the host through it.
        await sb.exec(f"ln -s {outside} link && ln -s {tmp_path} dirlink && mkfifo fifo")
        with pytest.raises(OSError):
            await sb.get_file("link")
        with pytest.raises(OSError):
            await sb.put_file("link", "overwritten")
        with pytest.raises(OSError):
            await sb.put_file("dirlink/new", "x")
        with pytest.raises(OSError):
            await sb.get_file("fifo")
        with pytest.raises(ValueError, match="outside"):
            await sb.get_file("../../../etc/passwd")
        with pytest.raises(ValueError, match="outside"):
            await sb.put_file("/usr/evil", "x")

    run(with_sandbox(backend, SandboxSpec(limits=SMALL), f"esc-{backend.isolation}", body))
    assert outside.read_text() == "host secret"
    assert not (tmp_path / "new").exists()


def test_cannot_read_host_or_other_sandboxes(
    bwrap: LocalBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store.sqlite"
    store.write_text("the store")
    monkeypatch.setenv("OPENFORGERL_RUNNER_SECRET", "runner-only")
    home_secret = Path.home() / f".openforgerl-test-{os.getpid()}"
    home_secret.write_text("home secret")

    check = bwrap.check()
    assert (check.isolation, check.missing.get("bwrap")) == ("bwrap", None)

    async def main() -> None:
        other = bwrap.create(SandboxSpec(files={"mine.txt": "other's"}, limits=SMALL), "iso-other")
        me = bwrap.create(SandboxSpec(limits=SMALL), "iso-me")
        await other.start()
        await me.start()
        try:
            assert other.info.host_dir
            for target in (
                store,
                home_secret,
                Path(other.info.host_dir) / "work" / "mine.txt",
                Path("/etc/shadow"),
            ):
                r = await me.exec(["cat", str(target)])
                assert r.exit_code != 0 and r.stdout == "", (target, r)
            r = await me.exec("ls -A /tmp /root 2>&1; ls /home; env")
            assert "iso-other" not in r.stdout and "store" not in r.stdout
            assert "runner-only" not in r.stdout and "OPENFORGERL_RUNNER_SECRET" not in r.stdout
            # Only the sandbox's own processes are visible, and it cannot write the system.
            assert int((await me.exec("ls /proc | grep -c '^[0-9]'")).stdout) <= 5
            for path in ("/usr/x", "/etc/x", "/x"):
                assert (await me.exec(["touch", path])).exit_code != 0
            assert (await me.exec("id -u")).stdout == "1000\n"
            if "--disable-userns" in bwrap.bwrap_base:
                assert (await me.exec("unshare -U true")).exit_code != 0
        finally:
            await me.stop()
            await other.stop()

    try:
        run(main())
    finally:
        home_secret.unlink()


class _Server:
    """A loopback HTTP server answering every GET with `body` and counting requests."""

    def __init__(self, body: bytes) -> None:
        outer = self
        self.hits = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.hits += 1
                data = body * 100_000 if self.path == "/big" else body
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[_Server, _Server]]:
    gateway, other = _Server(b"gateway says hi"), _Server(b"not the gateway")
    yield gateway, other
    gateway.close()
    other.close()


PROBE = """
import socket, sys, time, urllib.request
for url in sys.argv[1:3]:
    try:
        print(url, urllib.request.urlopen(url, timeout=5).read().decode())
    except Exception as e:
        print(url, "ERROR", type(e).__name__)
t = time.monotonic()
try:
    socket.create_connection(("10.255.255.1", 80), timeout=5)
    print("outside CONNECTED")
except OSError as e:
    print("outside ERROR", e.errno, round(time.monotonic() - t, 2))
"""


CONCURRENT = """
import concurrent.futures, sys, urllib.request
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    for n in pool.map(lambda _: len(urllib.request.urlopen(sys.argv[1], timeout=10).read()), range(8)):
        print(n)
"""


def test_network_reaches_only_the_gateway(bwrap: LocalBackend, servers: tuple[_Server, _Server]) -> None:
    gateway, other = servers
    spec = SandboxSpec(
        network="gateway",
        gateway_url=gateway.url,
        env={"OPENAI_BASE_URL": f"{gateway.url}/r/rollout-1/v1"},
        limits=SMALL,
        ro_binds=PY_BINDS,
    )

    async def body(sb: Sandbox) -> list[str]:
        assert sb.gateway_url and sb.gateway_url.startswith("http://127.0.0.1:")
        assert (await sb.exec("echo $OPENAI_BASE_URL")).stdout == f"{sb.gateway_url}/r/rollout-1/v1\n"
        r = await sb.exec([PYTHON, "-I", "-c", PROBE, sb.gateway_url, other.url])
        assert r.exit_code == 0, r
        # Concurrent connections and large bodies go through the bridge intact.
        big = await sb.exec([PYTHON, "-I", "-c", CONCURRENT, f"{sb.gateway_url}/big"])
        assert big.stdout == "1500000\n" * 8, big
        return r.stdout.splitlines()

    lines = run(with_sandbox(bwrap, spec, "net-gw", body))
    assert lines[0].endswith("gateway says hi")
    assert lines[1] == f"{other.url} ERROR URLError"
    # ENETUNREACH at once: the namespace has no route, so nothing is sent anywhere.
    outside, _, took = lines[2].rpartition(" ")
    assert outside == "outside ERROR 101" and float(took) < 1.0
    assert other.hits == 0 and gateway.hits == 9

    async def closed(sb: Sandbox) -> str:
        assert sb.gateway_url is None
        return (await sb.exec([PYTHON, "-I", "-c", PROBE, gateway.url, other.url])).stdout

    out = run(with_sandbox(bwrap, SandboxSpec(limits=SMALL, ro_binds=PY_BINDS), "net-none", closed))
    assert "ERROR URLError" in out.splitlines()[0] and gateway.hits == 9


def test_fork_bomb_is_stopped_by_pids_limit(bwrap: LocalBackend) -> None:
    needs_cgroups(bwrap)

    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec("bomb() { bomb | bomb & }; bomb; sleep 60")

    r = run(with_sandbox(bwrap, SandboxSpec(limits=SMALL), "forkbomb", body))
    assert (r.killed_by, r.timed_out) == ("pids", False) and r.duration_s < 10, r


def test_memory_hog_is_oom_killed(bwrap: LocalBackend) -> None:
    needs_cgroups(bwrap)
    spec = SandboxSpec(limits=Limits(memory_bytes=64 << 20, pids=64, wall_time_s=30), ro_binds=PY_BINDS)

    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec([PYTHON, "-I", "-c", "b = bytearray(1 << 30); b[::4096] = b'x' * (1 << 18)"])

    r = run(with_sandbox(bwrap, spec, "memhog", body))
    assert (r.killed_by, r.exit_code) == ("oom", 137), r


def test_timeout_and_cancel_kill_the_whole_tree(backend: LocalBackend) -> None:
    marker = f"sleep {900 + os.getpid() % 97}"

    async def body(sb: Sandbox) -> ExecResult:
        # What a command leaves running ends with it.
        assert (await sb.exec(f"{marker} >/dev/null 2>&1 &")).ok
        await eventually(lambda: not live_processes(marker))
        r = await sb.exec(f"{marker} & {marker} & wait", timeout=0.5)
        assert not live_processes(marker)
        task = asyncio.create_task(sb.exec(f"sh -c '{marker}' & {marker}"))
        await eventually(lambda: len(live_processes(marker)) >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(lambda: not live_processes(marker))
        return r

    r = run(with_sandbox(backend, SandboxSpec(limits=SMALL), f"hang-{backend.isolation}", body))
    assert (r.timed_out, r.killed_by, r.exit_code) == (True, "wall-time", 137) and r.duration_s < 5


def test_output_flood_is_truncated(bwrap: LocalBackend) -> None:
    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec("echo first; yes flood | head -c 48000000; echo last; echo err >&2")

    r = run(with_sandbox(bwrap, SandboxSpec(limits=SMALL), "flood", body))
    assert r.exit_code == 0 and r.stdout_truncated and not r.stderr_truncated and r.stderr == "err\n"
    assert r.stdout.startswith("first\nflood\n") and r.stdout.endswith("flood\nlast\n")
    assert "bytes omitted ...]" in r.stdout and len(r.stdout) < (1 << 20) + 100


def test_stop_leaves_nothing_behind(backend: LocalBackend) -> None:
    marker = f"sleep {800 + os.getpid() % 97}"

    async def main() -> tuple[ExecResult, LocalSandbox]:
        sb = backend.create(SandboxSpec(files={"f": "x"}, limits=SMALL), f"stop-{backend.isolation}")
        await sb.start()
        task = asyncio.create_task(sb.exec(f"{marker} & {marker}"))
        try:
            await eventually(lambda: len(live_processes(marker)) == 2)
        finally:
            await sb.stop()
        await sb.stop()
        with pytest.raises(SandboxError):
            await sb.exec("true")
        return await task, sb

    r, sb = run(main())
    assert r.killed_by == "stopped"
    assert not live_processes(marker)
    assert sb.info.host_dir is not None and not Path(sb.info.host_dir).exists()
    for controller in ("memory", "cpu", "pids"):
        assert not (backend.cgroup_root / controller / "openforgerl" / sb.name).exists()


def test_fallback_runs_without_isolation_and_says_so(
    plain: LocalBackend, caplog: pytest.LogCaptureFixture
) -> None:
    assert plain.check().isolation == "none" and "bwrap" in plain.check().missing
    with caplog.at_level(logging.WARNING, logger="openforgerl.sandbox.local"):
        sb = plain.create(SandboxSpec(network="gateway", gateway_url="http://127.0.0.1:9"), "plain-warn")
    assert "WITHOUT ISOLATION" in caplog.text
    assert (sb.info.isolation, sb.info.network) == ("none", "host")
    assert sb.gateway_url == "http://127.0.0.1:9"

    async def body(sb: Sandbox) -> ExecResult:
        return await sb.exec("pwd; echo $HOME")

    r = run(with_sandbox(plain, SandboxSpec(), "plain-run", body))
    work, home = r.stdout.splitlines()
    assert work.endswith("/work") and home.endswith("/home") and r.ok
