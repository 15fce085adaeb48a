"""One sandbox of the local backend (`local.py`, whose docstring tells the design): its dirs on the
host, its bwrap mounts, the user and the limits each exec runs under, and the exec itself (a
subprocess whose output is bounded and whose tree is killed with it)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import posixpath
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Protocol

from openforgerl.sandbox import bridge
from openforgerl.sandbox.base import (
    Counters,
    ExecResult,
    Output,
    Sandbox,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
    SandboxStartError,
    State,
    rewrite_gateway,
)
from openforgerl.sandbox.cgroups import JOIN_CGROUPS, Cgroup
from openforgerl.sandbox.hostfs import copy_tree_beneath, read_beneath, rmtree, write_beneath

INSIDE_WORKDIR = "/workspace"
INSIDE_HOME = "/home/sandbox"
INSIDE_RUN = "/run/openforgerl"
SANDBOX_UID = 1000
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Binds each (source, mount point) pair given before "--" in a mount namespace of its own, then
# execs the rest: what the sandbox's uid may not reach on the host (an interpreter under /root) it
# reaches through mount points it can (in the sandbox's dir). Run by root, before the uid is dropped.
STAGE = 'while [ "$1" != -- ]; do {mount} --bind "$1" "$2" || exit 125; shift 2; done; shift; exec "$@"'
_PASSWD = (
    f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{INSIDE_HOME}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
)
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"


class _Command(asyncio.SubprocessProtocol):
    """One exec's output and exit. Not asyncio's Process: on Python 3.11 its wait() also waits for the
    pipes to close, which a daemon the command left behind can hold open forever."""

    def __init__(self, output_limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.output = Output(output_limit)
        self.exited = loop.create_future()
        self.closed = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        (self.output.stdout if fd == 1 else self.output.stderr).feed(data)

    def process_exited(self) -> None:
        self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)


def _resolver_binds() -> list[str]:
    """Binds that make the host's DNS resolver config visible inside: /etc/resolv.conf is often a
    link out of /etc (systemd-resolved's /run/systemd/resolve/stub-resolv.conf), which the sandbox's
    root lacks."""
    target = os.path.realpath("/etc/resolv.conf")
    if target.startswith(("/etc/", "/usr/")) or not os.path.isfile(target):
        return []
    return ["--ro-bind", target, target]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def reachable(path: str, user: tuple[int, int]) -> bool:
    """Whether `user` (no supplementary groups) may look up `path`: search permission on every dir
    above it. bwrap resolves its bind sources as the uid it runs as."""
    uid, gid = user
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if not st.st_mode & bit:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


class LocalHost(Protocol):
    """What a sandbox reads of its backend (`local.py` LocalBackend): what the host offers and how
    the backend chose to run its sandboxes there."""

    name: str
    state_dir: Path | None
    cgroup_root: Path
    output_limit: int
    bwrap: str | None
    seccomp_program: bytes | None
    bwrap_base: list[str]
    cgroups: bool
    prlimit: str | None
    host_user: tuple[int, int] | None  # None: sandboxes run as the runner
    drop_argv: list[str]  # becomes host_user, with no privileges
    stage_argv: list[str]  # unshare and the staging script (see STAGE)

    @property
    def isolation(self) -> str: ...

    @property
    def limits(self) -> str: ...


class LocalSandbox(Sandbox):
    """A sandbox of `LocalBackend`: see the module's doc."""

    def __init__(self, backend: LocalHost, spec: SandboxSpec, name: str) -> None:
        super().__init__(spec, name)
        self.backend = backend
        self._dir: Path | None = None
        self._cgroup: Cgroup | None = None
        self._bridge: bridge.HostBridge | None = None
        self._running: dict[asyncio.SubprocessTransport, _Command] = {}
        # Set at start: the host path bwrap binds the sandbox's dir from, the bwrap args for the
        # spec's binds and hidden paths, and the (host path, mount point) pairs staged for a uid that
        # cannot reach them (see STAGE).
        self._dir_source = ""
        self._mounts: list[str] = []
        self._staged: list[tuple[str, str]] = []
        self._stage_dir: Path | None = None  # where the staged mount points are

    # -- where things are -------------------------------------------------------------------------

    @property
    def _isolated(self) -> bool:
        return self.backend.bwrap is not None

    def _host(self, sub: str) -> Path:
        if self._dir is None:
            raise SandboxError(f"sandbox {self.name} is {self._state.value}")
        return self._dir / sub

    @property
    def _roots(self) -> dict[str, Path]:
        """Inside path -> host dir, for the dirs that files can be put into and read from."""
        host = self._host
        roots = {self.workdir: host("work"), self._home: host("home"), self.tmpdir: host("tmp")}
        for i, inside in enumerate(self.spec.extra_dirs):
            roots[posixpath.normpath(inside)] = host(f"extra/{i}")
        return roots

    @property
    def workdir(self) -> str:
        if not self._isolated:
            return str(self._host("work"))
        return posixpath.normpath(self.spec.workdir) if self.spec.workdir else INSIDE_WORKDIR

    @property
    def tmpdir(self) -> str:
        return "/tmp" if self._isolated else str(self._host("tmp"))

    @property
    def _home(self) -> str:
        return INSIDE_HOME if self._isolated else str(self._host("home"))

    @property
    def _bridged(self) -> bool:
        return self._isolated and self.spec.network == "gateway"

    @property
    def gateway_url(self) -> str | None:
        if self._gateway is None or self.spec.network == "none":
            return None
        if not self._bridged:  # network "host", or no isolation: the host's own address
            return self.spec.gateway_url
        return self._relay_url

    @property
    def info(self) -> SandboxInfo:
        network = self.spec.network if self._isolated else "host"
        return SandboxInfo(
            name=self.name,
            backend=self.backend.name,
            isolation=self.backend.isolation,
            limits=self.backend.limits,
            network=network,
            host_dir=str(self._dir) if self._dir else None,
        )

    def _resolve(self, path: str) -> tuple[Path, PurePosixPath]:
        """(host dir, relative path) for a path inside, which must lie in the work dir, HOME or the
        temp dir (/tmp, or its host dir without isolation: see `tmpdir`)."""
        full = posixpath.normpath(posixpath.join(self.workdir, path))
        for inside, host in self._roots.items():
            if full == inside or full.startswith(inside + "/"):
                return host, PurePosixPath(full[len(inside) :].lstrip("/"))
        roots = ", ".join(self._roots)
        raise ValueError(f"{path!r} is outside the sandbox's work dir, HOME and temp dir ({roots})")

    # -- lifecycle ----------------------------------------------------------------------------------

    async def _provision(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=f"openforgerl-{self.name}-", dir=self.backend.state_dir))
        owner = self._owner
        extra = [f"extra/{i}" for i in range(len(self.spec.extra_dirs))]
        for sub in ("work", "home", "tmp", "run", *(["extra"] if extra else []), *extra):
            (self._dir / sub).mkdir()
        if owner is not None:
            # The sandbox's uid may pass through its dir (the group's x bit), not list it; what it
            # writes is its own, the rest (run: passwd, the bridge) stays root's and read-only.
            os.chown(self._dir, -1, owner[1])
            os.chmod(self._dir, 0o710)
            if extra:
                os.chown(self._dir / "extra", -1, owner[1])
                os.chmod(self._dir / "extra", 0o710)
            for sub in ("work", "home", "tmp", *extra):
                os.chown(self._dir / sub, *owner)
                os.chmod(self._dir / sub, 0o700)
            os.chmod(self._dir / "run", 0o755)
        if self.backend.cgroups:
            self._cgroup = Cgroup.create(self.backend.cgroup_root, self.name, self.spec.limits)
        if self._isolated:
            run = self._dir / "run"
            for file, text in (("passwd", _PASSWD), ("group", _GROUP)):
                (run / file).write_text(text)
                (run / file).chmod(0o644)
            self._plan_mounts()
        if self._bridged:
            run = self._dir / "run"
            shutil.copyfile(bridge.__file__, run / "bridge.py")
            (run / "bridge.py").chmod(0o644)
            assert self._gateway is not None and self._gateway.hostname
            sock = str(run / "gw.sock")
            self._bridge = bridge.HostBridge(sock, self._gateway.hostname, self._gateway_port)
            await self._bridge.start()
            if owner is not None:
                # Connecting to a Unix socket takes write permission on it.
                os.chown(sock, *owner)
                os.chmod(sock, 0o600)

    async def _ready(self) -> None:
        await self._put_workspace()
        for path, data in self.spec.files.items():
            await self.put_file(path, data)
        probe = await self.exec(["true"], timeout=60)
        if not probe.ok:
            raise SandboxStartError(f"sandbox {self.name} cannot run commands: {probe.stderr.strip()}")

    def _start_failure(self, error: BaseException) -> BaseException | None:
        if isinstance(error, OSError):
            return SandboxStartError(f"sandbox {self.name} failed to start: {error}")
        return None

    @property
    def _owner(self) -> tuple[int, int] | None:
        """Who owns what the runner writes into the sandbox, where that is not the runner itself."""
        return self.backend.host_user if self._isolated else None

    def _source(self, path: str) -> str:
        """The path bwrap binds `path` from: itself, or a mount point in the sandbox's dir that the
        launcher binds it on first (see STAGE) where the sandbox's uid could not reach it."""
        user = self.backend.host_user
        if user is None:
            return path
        real = os.path.realpath(path)
        if reachable(real, user):
            return real
        stage = self._stage_root(user) / str(len(self._staged))
        if os.path.isdir(real):
            stage.mkdir(mode=0o755)
        else:
            stage.touch(mode=0o644)
        self._staged.append((real, str(stage)))
        return str(stage)

    def _stage_root(self, user: tuple[int, int]) -> Path:
        """The dir of the staged mount points: in the sandbox's dir, or, where the sandbox's uid
        cannot reach that (a state dir under /root), one of its own in a temp dir it can reach."""
        if self._stage_dir is None:
            assert self._dir is not None
            if reachable(str(self._dir / "stage"), user):
                self._stage_dir = self._dir / "stage"
                self._stage_dir.mkdir()
            else:
                for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
                    if os.path.isdir(base) and reachable(os.path.join(base, "x"), user):
                        self._stage_dir = Path(tempfile.mkdtemp(prefix=f"openforgerl-{self.name}-", dir=base))
                        break
                else:
                    raise SandboxStartError(f"no temp dir that uid {user[0]} can reach, to bind from")
            self._stage_dir.chmod(0o755)
        return self._stage_dir

    def _plan_mounts(self) -> None:
        """What every exec mounts besides the system: the spec's read-only binds, then an empty dir
        (a read-only tmpfs) or /dev/null over each of its hidden paths, then the binds that lie inside
        a hidden path (so a hidden package can show a few of its files)."""
        assert self._dir is not None
        self._dir_source = self._source(str(self._dir))
        binds = [(p, p) if isinstance(p, str) else p for p in self.spec.ro_binds]
        python = os.path.realpath(sys.executable)
        if self._bridged and not python.startswith("/usr/"):
            prefix = os.path.realpath(sys.base_prefix)
            binds.append((prefix, prefix))
        hidden = [os.path.realpath(h) for h in self.spec.hidden if os.path.exists(h)]

        def within(path: str, top: str) -> str | None:
            """path's place below top ("" for top itself), or None."""
            if path == top:
                return ""
            return path[len(top) :] if path.startswith(top.rstrip("/") + "/") else None

        outer: list[tuple[str, str]] = []
        inner: list[tuple[str, str]] = []
        for src, dst in binds:
            real = os.path.realpath(src)
            shown = any(within(real, h) not in (None, "") for h in hidden)
            (inner if shown else outer).append((real, dst))
        masks: list[str] = []
        read_only: list[str] = []
        for h in hidden:
            for real, dst in outer:
                rest = within(h, real)
                if rest is None:
                    continue
                inside = dst.rstrip("/") + rest if rest else dst
                if inside in masks:
                    continue  # seen through two binds (a package inside a bound venv)
                if os.path.isdir(h):
                    masks += ["--tmpfs", inside]
                    read_only += ["--remount-ro", inside]
                else:
                    masks += ["--ro-bind", os.devnull, inside]
        self._mounts = [arg for real, dst in outer for arg in ("--ro-bind", self._source(real), dst)]
        self._mounts += masks
        self._mounts += [arg for real, dst in inner for arg in ("--ro-bind", self._source(real), dst)]
        self._mounts += read_only

    async def _teardown(self) -> None:
        errors: list[BaseException] = []
        for transport in list(self._running):
            self._kill_tree(transport)
        if self._bridge is not None:
            self._bridge.close()
        if self._running:
            await asyncio.wait([command.exited for command in self._running.values()], timeout=5)
        if self._cgroup is not None:
            try:
                await self._cgroup.destroy()
            except OSError as e:
                errors.append(e)
        for path in (self._dir, self._stage_dir):
            if path is not None:
                try:
                    await asyncio.to_thread(rmtree, path)
                except OSError as e:
                    errors.append(e)
        if errors:
            raise SandboxError(f"sandbox {self.name} left traces behind: {errors}")

    # -- files -----------------------------------------------------------------------------------

    async def _put_file(self, path: str, data: bytes, mode: int) -> None:
        root, rel = self._resolve(path)
        await asyncio.to_thread(write_beneath, root, rel, data, mode, self._owner)

    async def _put_dir(self, src: Path, dest: str) -> None:
        root, rel = self._resolve(dest)
        await asyncio.to_thread(copy_tree_beneath, src, root, rel, self._owner)

    async def _get_file(self, path: str) -> bytes:
        root, rel = self._resolve(path)
        return await asyncio.to_thread(read_beneath, root, rel)

    # -- exec ------------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        # Never the runner's own environment: it holds the runner's secrets.
        env = {"PATH": DEFAULT_PATH, "HOME": self._home, "USER": "sandbox", "LOGNAME": "sandbox"}
        env |= {"LANG": "C.UTF-8", "TMPDIR": self.tmpdir, **self.spec.env, **extra}
        return rewrite_gateway(env, self.spec.gateway_url, self.gateway_url)

    def _launcher(self) -> list[str]:
        """Joins the cgroups (or takes the rlimits) that every process of the command inherits."""
        cgroups = self._cgroup.procs_files if self._cgroup else []
        argv = ["/bin/sh", "-c", JOIN_CGROUPS, "sh", *cgroups, "--"]
        limits = self.spec.limits
        if self.backend.prlimit:
            argv.append(self.backend.prlimit)
            if limits.memory_bytes is not None:
                argv.append(f"--as={limits.memory_bytes}")
            # A backstop for the wall-time kill: no process can use more CPU time than that in time.
            if limits.wall_time_s is not None:
                argv.append(f"--cpu={math.ceil(limits.wall_time_s * (limits.cpus or 1))}")
            # RLIMIT_NPROC counts every process of the uid: as root it is either ignored or host-wide.
            if limits.pids is not None and os.geteuid() != 0:
                argv.append(f"--nproc={limits.pids}")
            argv.append("--")
        return argv

    def _drop(self) -> list[str]:
        """Root's last steps before bwrap, with host_user: the staging binds, then setpriv."""
        backend = self.backend
        if backend.host_user is None:
            return []
        stage = []
        if self._staged:
            stage = [*backend.stage_argv, *(p for pair in self._staged for p in pair), "--"]
        return stage + backend.drop_argv

    def _bwrap_argv(self, argv: list[str], cwd: str, seccomp_fd: int | None) -> list[str]:
        top = self._dir_source
        args = [*self.backend.bwrap_base]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        args += [
            "--ro-bind",
            f"{top}/run/passwd",
            "/etc/passwd",
            "--ro-bind",
            f"{top}/run/group",
            "/etc/group",
        ]
        if self.spec.network == "host":
            # After --unshare-all: keeps the host's network namespace (and only that).
            args.append("--share-net")
            args += _resolver_binds()
        args += ["--proc", "/proc", "--dev", "/dev", "--bind", f"{top}/work", self.workdir]
        args += ["--bind", f"{top}/home", INSIDE_HOME, "--bind", f"{top}/tmp", "/tmp"]
        for i, inside in enumerate(self.spec.extra_dirs):  # e.g. Harbor's /tests and /logs/verifier
            args += ["--bind", f"{top}/extra/{i}", posixpath.normpath(inside)]
        # After /tmp and HOME: a bind below them (a venv checked out under /tmp) must stay visible.
        args += self._mounts
        args += ["--ro-bind", f"{top}/run", INSIDE_RUN, "--remount-ro", "/", "--chdir", cwd, "--"]
        if self._bridged:
            python = os.path.realpath(sys.executable)
            args += [python, "-I", "-S", f"{INSIDE_RUN}/bridge.py", str(self._relay_port)]
            args += [f"{INSIDE_RUN}/gw.sock", "--"]
        return args + argv

    def _kill_tree(self, transport: asyncio.SubprocessTransport) -> None:
        if transport.get_returncode() is not None:
            return
        pid = transport.get_pid()
        if self._isolated:
            # Killing the pid namespace's init kills everything in it, and bwrap reaps it and exits.
            for target in _children(pid) or [pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(target, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def _kill_spawned(self, spawn: asyncio.Future[tuple[asyncio.SubprocessTransport, _Command]]) -> None:
        if not spawn.cancelled() and spawn.exception() is None:
            transport, _ = spawn.result()
            self._kill_tree(transport)
            transport.close()

    def _ended_by(self, code: int, signalled: bool, before: Counters | None) -> str | None:
        """What ended a failed command that the sandbox did not kill itself, if not the command."""
        if code == 0:
            return None
        if self._state is not State.RUNNING and code == 128 + signal.SIGKILL:
            return "stopped"
        if self._cgroup is not None and before is not None:
            # "pids": a fork failed, and the command gave up before the watch saw it.
            hit = before.limit_hit(self._cgroup.counters())
            if hit:
                return hit
        # bwrap reports a command's death by signal N as 128 + N, like a shell.
        if signalled or (self._isolated and 128 < code <= 128 + signal.SIGRTMAX):
            return f"signal {code - 128}"
        return None

    async def _wait(
        self,
        transport: asyncio.SubprocessTransport,
        command: _Command,
        pids_hit: asyncio.Task[None] | None,
        deadline: float | None,
    ) -> str | None:
        """Wait for the command; kill its tree at the deadline or at the pids limit and say which."""
        waits: list[asyncio.Future[None]] = [command.exited, *([pids_hit] if pids_hit else [])]
        done, _ = await asyncio.wait(waits, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
        killed_by = None
        if command.exited not in done:
            killed_by = "pids" if pids_hit in done else "wall-time"
            self._kill_tree(transport)
            try:
                await asyncio.wait_for(asyncio.shield(command.exited), 5)
            except TimeoutError:
                transport.kill()
                await command.exited
        if not self._isolated:
            # As the pid namespace does under bwrap: what the command left running goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(transport.get_pid(), signal.SIGKILL)
        return killed_by

    async def _exec(
        self, argv: list[str], *, env: Mapping[str, str], cwd: str, limit_s: float | None, stdin: bytes | None
    ) -> ExecResult:
        seccomp_fd = None
        if self._isolated and self.backend.seccomp_program is not None:
            # bwrap reads the filter from a pipe to its end: one pipe per exec, since two bwraps
            # reading one file description would share its offset.
            seccomp_fd, writer = os.pipe()
            try:
                os.write(writer, self.backend.seccomp_program)
            finally:
                os.close(writer)
        if self._isolated:
            full = self._launcher() + self._drop() + self._bwrap_argv(argv, cwd, seccomp_fd)
        else:
            full = self._launcher() + argv
        before = self._cgroup.counters() if self._cgroup else None
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        spawn = asyncio.ensure_future(
            loop.subprocess_exec(
                lambda: _Command(self.backend.output_limit),
                *full,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env(env),
                cwd=str(self._host("work")) if self._isolated else cwd,
                start_new_session=True,
                pass_fds=() if seccomp_fd is None else (seccomp_fd,),
            )
        )
        if seccomp_fd is not None:
            # Once the child has its copy (or never will); a cancelled exec's spawn finishes later.
            spawn.add_done_callback(lambda _: os.close(seccomp_fd))
        try:
            # Cancelled mid-spawn, asyncio would kill the command's leader only: its tree must go too.
            transport, command = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            spawn.add_done_callback(self._kill_spawned)
            raise
        except (FileNotFoundError, NotADirectoryError) as e:
            # Only the plain process's cwd can be missing: /bin/sh runs the command and reports it.
            raise NotADirectoryError(f"no directory {cwd} in sandbox {self.name}") from e
        except OSError as e:
            raise SandboxStartError(f"could not start a command in sandbox {self.name}: {e}") from e
        self._running[transport] = command
        watch = None
        if self._cgroup is not None and before is not None and self.spec.limits.pids is not None:
            watch = asyncio.create_task(self._cgroup.pids_limit_hit(before.pids_hits))
        try:
            if stdin is not None:
                pipe = transport.get_pipe_transport(0)
                assert isinstance(pipe, asyncio.WriteTransport)
                pipe.write(stdin)
                pipe.close()  # after the data is flushed; a command that exits unread just loses it
            killed_by = await self._wait(transport, command, watch, limit_s)
            # The pipes close once the whole tree is gone; a plain process's daemon may hold them on.
            await asyncio.wait([command.closed], timeout=5)
        finally:
            self._kill_tree(transport)
            transport.close()
            del self._running[transport]
            if watch is not None:
                watch.cancel()
        returncode = transport.get_returncode()
        assert returncode is not None
        code = 128 - returncode if returncode < 0 else returncode
        killed_by = killed_by or self._ended_by(code, returncode < 0, before)
        return command.output.result(code, killed_by=killed_by, started=started, ended=time.monotonic())
