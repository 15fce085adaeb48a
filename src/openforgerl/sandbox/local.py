"""The local backend: bubblewrap namespaces, cgroup v1 limits; a plain subprocess where bwrap is missing.

Each exec is one bwrap run over the sandbox's own work dir, HOME and /tmp (host temp dirs that persist
between execs): new user, pid, net, ipc, uts and cgroup namespaces; a root holding only the read-only
system dirs (/usr, /etc minus what other users may not read, the lib links) and the spec's binds; uid
1000, no capabilities. The pid namespace dies with its command, so nothing one exec starts outlives it.
With network "gateway" the command's loopback has a relay (bridge.py) to a Unix socket that the host
end forwards to the gateway; nothing else is reachable. With network "host" (for tasks on live web
sites) the command shares the host's network namespace: it reaches the internet, the gateway at its
host URL, and whatever else listens on the host, its loopback included; the other namespaces stay.

Limits: a cgroup v1 per sandbox (memory, cpu, pids) that every exec joins before it starts, which also
tells OOM kills and pids-limit hits apart; rlimits through `prlimit` where cgroups are not writable.

Without bwrap, commands run as plain subprocesses in the sandbox's temp dirs: no isolation at all, and
the backend says so (a warning at every creation, isolation "none" in check() and info). Paths inside are
then those host dirs: `workdir`, HOME and `tmpdir` (TMPDIR), never the host's own /tmp.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import math
import os
import posixpath
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from openforgerl.sandbox import bridge
from openforgerl.sandbox.base import (
    BackendCheck,
    ExecResult,
    Limits,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
    SandboxStartError,
    SandboxUnavailable,
)

log = logging.getLogger(__name__)

INSIDE_WORKDIR = "/workspace"
INSIDE_HOME = "/home/sandbox"
INSIDE_RUN = "/run/openforgerl"
SANDBOX_UID = 1000
OUTPUT_LIMIT = 1 << 20
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_CONTROLLERS = ("memory", "cpu", "pids")
_CGROUP_PARENT = "openforgerl"
_CPU_PERIOD_US = 100_000
_POLL_S = 0.05
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
# Joins the cgroups named before "--", then execs the rest: Python's subprocess has no cgroup option,
# and preexec_fn is unsafe in a threaded runner.
_JOIN_CGROUPS = 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
_PASSWD = f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{INSIDE_HOME}:/bin/sh\n"
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n"


class _State(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(slots=True, frozen=True)
class _Counters:
    oom_kills: int
    pids_hits: int


class _Cgroup:
    """One sandbox's cgroups (memory, cpu, pids) under <root>/<controller>/openforgerl/<name>."""

    def __init__(self) -> None:
        self.dirs: dict[str, Path] = {}

    @classmethod
    def create(cls, root: Path, name: str, limits: Limits) -> _Cgroup:
        cg = cls()
        try:
            for c in _CONTROLLERS:
                d = root / c / _CGROUP_PARENT / name
                d.parent.mkdir(exist_ok=True)
                try:
                    d.mkdir()
                except FileExistsError:
                    # Left by a runner that died; one with processes belongs to a live sandbox.
                    if (d / "cgroup.procs").read_text().strip():
                        raise FileExistsError(
                            errno.EEXIST, "a live sandbox has this cgroup", str(d)
                        ) from None
                    d.rmdir()
                    d.mkdir()
                cg.dirs[c] = d
            if limits.memory_bytes is not None:
                cg._write("memory", "memory.limit_in_bytes", limits.memory_bytes)
                # Swap would let a hog outlive its limit; memsw exists only with swap accounting on.
                if (cg.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():
                    cg._write("memory", "memory.memsw.limit_in_bytes", limits.memory_bytes)
            if limits.cpus is not None:
                cg._write("cpu", "cpu.cfs_period_us", _CPU_PERIOD_US)
                cg._write("cpu", "cpu.cfs_quota_us", max(1000, int(limits.cpus * _CPU_PERIOD_US)))
            if limits.pids is not None:
                cg._write("pids", "pids.max", limits.pids)
        except OSError:
            for d in cg.dirs.values():
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        return cg

    def _write(self, controller: str, key: str, value: int) -> None:
        (self.dirs[controller] / key).write_text(str(value))

    def _read_key(self, controller: str, file: str, key: str) -> int:
        for line in (self.dirs[controller] / file).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def counters(self) -> _Counters:
        return _Counters(
            oom_kills=self._read_key("memory", "memory.oom_control", "oom_kill"),
            pids_hits=self._read_key("pids", "pids.events", "max"),
        )

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return found

    async def pids_limit_hit(self, before: int) -> None:
        """Returns once a fork failed on the pids limit (a fork bomb never ends by itself)."""
        # A kernel counter: nothing to wait on but the file itself.
        while self.counters().pids_hits == before:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)

    async def destroy(self, grace_s: float = 5.0) -> None:
        """Kill every process in it, then remove it."""
        deadline = time.monotonic() + grace_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.01)
        for d in list(self.dirs.values()):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    # EBUSY while killed processes are still exiting.
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.01)
        self.dirs.clear()


class _Capture:
    """A stream's first and last `limit / 2` bytes, so a flooding command cannot eat the runner's memory."""

    def __init__(self, limit: int) -> None:
        self._half = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self._half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > self._half:
            del self.tail[: len(self.tail) - self._half]

    def text(self) -> tuple[str, bool]:
        omitted = self.total - len(self.head) - len(self.tail)
        if omitted <= 0:
            return (self.head + self.tail).decode(errors="replace"), False
        marker = f"\n[... {omitted} bytes omitted ...]\n"
        return self.head.decode(errors="replace") + marker + self.tail.decode(errors="replace"), True


class _Command(asyncio.SubprocessProtocol):
    """One exec's output and exit. Not asyncio's Process: on Python 3.11 its wait() also waits for the
    pipes to close, which a daemon the command left behind can hold open forever."""

    def __init__(self, output_limit: int) -> None:
        loop = asyncio.get_running_loop()
        self.output = {1: _Capture(output_limit), 2: _Capture(output_limit)}
        self.exited = loop.create_future()
        self.closed = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.output[fd].feed(data)

    def process_exited(self) -> None:
        self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(None)


def _dir_beneath(root: Path, parts: Sequence[str], create: bool) -> int:
    """An fd for root/parts, refusing symlinks on the way: the sandbox owns these dirs, and the runner
    must never read or write through a link it planted (docker cp's CVE-2018-15664)."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_beneath(root: Path, rel: PurePosixPath, flags: int, mode: int = 0o644) -> int:
    if not rel.parts:
        raise IsADirectoryError(f"{root} is a directory")
    parent = _dir_beneath(root, rel.parts[:-1], create=bool(flags & os.O_CREAT))
    try:
        # O_NONBLOCK: a FIFO planted in place of a file must not hang the runner.
        fd = os.open(rel.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent)
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{rel} is not a regular file")
    return fd


def _write_beneath(root: Path, rel: PurePosixPath, data: bytes, mode: int) -> None:
    fd = _open_beneath(root, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with open(fd, "wb") as f:
        f.write(data)
        os.fchmod(fd, mode)


def _read_beneath(root: Path, rel: PurePosixPath) -> bytes:
    with open(_open_beneath(root, rel, os.O_RDONLY), "rb") as f:
        return f.read()


def _copy_tree_beneath(src: Path, root: Path, rel: PurePosixPath) -> None:
    if not src.is_dir():
        raise NotADirectoryError(f"{src} is not a directory")
    os.close(_dir_beneath(root, rel.parts, create=True))
    for dirpath, dirnames, filenames in os.walk(src):
        sub = rel / Path(dirpath).relative_to(src).as_posix()
        parent = _dir_beneath(root, sub.parts, create=True)
        try:
            for name in [*dirnames, *filenames]:
                host = Path(dirpath, name)
                if host.is_symlink():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=parent)
                    os.symlink(os.readlink(host), name, dir_fd=parent)
                elif host.is_dir():
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=parent)
                else:
                    fd = _open_beneath(root, sub / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    with open(fd, "wb") as out, host.open("rb") as inp:
                        shutil.copyfileobj(inp, out)
                        os.fchmod(fd, stat.S_IMODE(host.stat().st_mode))
        finally:
            os.close(parent)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        # The sandbox may have left dirs that its uid (the runner's own, when not root) cannot enter.
        for dirpath, dirnames, _ in os.walk(path):
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
        shutil.rmtree(path)


def _unreadable_under(top: str) -> tuple[list[str], list[str]]:
    """Files and dirs under `top` that other users may not read. The sandbox's uid maps to the runner's
    (root here), so unmasked it would read what the host keeps from unprivileged users (/etc/shadow)."""
    files: list[str] = []
    dirs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        for d in list(dirnames):
            p = os.path.join(dirpath, d)
            mode = os.lstat(p).st_mode
            if stat.S_ISDIR(mode) and mode & 0o005 != 0o005:
                dirs.append(p)
                dirnames.remove(d)
        for f in filenames:
            p = os.path.join(dirpath, f)
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode) and not mode & stat.S_IROTH:
                files.append(p)
    return files, dirs


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


class LocalBackend:
    """Sandboxes on this machine. bwrap/cgroups: None detects them, True requires them, False skips them."""

    name = "local"

    def __init__(
        self,
        *,
        bwrap: bool | None = None,
        cgroups: bool | None = None,
        state_dir: str | Path | None = None,
        cgroup_root: str | Path = "/sys/fs/cgroup",
        output_limit: int = OUTPUT_LIMIT,
    ) -> None:
        self.state_dir = Path(state_dir) if state_dir else None
        self.cgroup_root = Path(cgroup_root)
        self.output_limit = output_limit
        self._available: dict[str, str] = {}
        self._missing: dict[str, str] = {}
        self.bwrap = self._find_bwrap(bwrap)
        self.bwrap_base = self._bwrap_base() if self.bwrap else []
        self.cgroups = self._probe_cgroups(cgroups)
        self.prlimit = shutil.which("prlimit") if not self.cgroups else None
        if not self.cgroups:
            if self.prlimit:
                self._available["rlimits"] = (
                    f"{self.prlimit}: memory as RLIMIT_AS, pids as RLIMIT_NPROC unless root; "
                    "cpus not enforced, OOM not reported"
                )
            else:
                self._missing["rlimits"] = "prlimit not found (Debian package util-linux): no limits at all"
        if not self.bwrap:
            log.warning(
                "NO SANDBOX ISOLATION: bubblewrap is unavailable (%s); commands run as plain subprocesses "
                "that see the whole host, its files and its network. Install the Debian package bubblewrap.",
                self._missing.get("bwrap", "disabled"),
            )

    def _find_bwrap(self, want: bool | None) -> str | None:
        if want is False:
            self._missing["bwrap"] = "disabled by configuration"
            return None
        path = shutil.which("bwrap")
        if path is None:
            self._missing["bwrap"] = "bwrap not found: install the Debian package bubblewrap"
        else:
            probe = subprocess.run(
                [path, "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "true"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode == 0:
                self._available["bwrap"] = path
                return path
            self._missing["bwrap"] = (
                f"{path} cannot create namespaces here ({probe.stderr.strip()}): "
                "unprivileged user namespaces may be disabled"
            )
        if want:
            raise SandboxUnavailable(self._missing["bwrap"])
        return None

    def _probe_cgroups(self, want: bool | None) -> bool:
        if want is False:
            self._missing["cgroups"] = "disabled by configuration"
            return False
        try:
            for c in _CONTROLLERS:
                if not (self.cgroup_root / c / "cgroup.procs").exists():
                    raise FileNotFoundError(f"no cgroup v1 {c} hierarchy at {self.cgroup_root / c}")
                (self.cgroup_root / c / _CGROUP_PARENT).mkdir(exist_ok=True)
        except OSError as e:
            self._missing["cgroups"] = f"cgroup v1 memory/cpu/pids not writable ({e}); rlimits instead"
            if want:
                raise SandboxUnavailable(self._missing["cgroups"]) from e
            return False
        where = f"{self.cgroup_root}/{{memory,cpu,pids}}/{_CGROUP_PARENT}"
        self._available["cgroups"] = f"cgroup v1 under {where}"
        return True

    @property
    def isolation(self) -> str:
        return "bwrap" if self.bwrap else "none"

    @property
    def limits(self) -> str:
        return "cgroup" if self.cgroups else "rlimit" if self.prlimit else "none"

    def _bwrap_base(self) -> list[str]:
        """The bwrap args every sandbox shares: namespaces, identity, and the read-only system (/usr, the
        lib and bin links, /etc minus what other users may not read)."""
        assert self.bwrap
        args = [self.bwrap, "--unshare-all", "--unshare-user"]
        # bwrap >= 0.8 can forbid nested user namespaces, the usual door to kernel exploits.
        if (
            "--disable-userns"
            in subprocess.run([self.bwrap, "--help"], capture_output=True, text=True).stdout
        ):
            args.append("--disable-userns")
        args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
        args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        for d in _SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        files, dirs = _unreadable_under("/etc")
        for f in files:
            args += ["--ro-bind", os.devnull, f]
        for d in dirs:
            args += ["--tmpfs", d]
        return args

    def check(self) -> BackendCheck:
        return BackendCheck(
            backend=self.name,
            isolation=self.isolation,
            limits=self.limits,
            available=dict(self._available),
            missing=dict(self._missing),
        )

    def create(self, spec: SandboxSpec, name: str) -> LocalSandbox:
        if not _NAME.fullmatch(name):
            raise ValueError(f"sandbox name {name!r} must match {_NAME.pattern}")
        for bind in spec.ro_binds:
            src = bind if isinstance(bind, str) else bind[0]
            if not os.path.exists(src):
                raise ValueError(f"ro_binds: {src} does not exist")
        if not self.bwrap:
            log.warning(
                "sandbox %s runs WITHOUT ISOLATION (no bwrap): it can read the host's files%s",
                name,
                " and reach any address" if spec.network == "gateway" else " and reach the network",
            )
        return LocalSandbox(self, spec, name)


class LocalSandbox:
    """A sandbox of `LocalBackend`: see the module's doc."""

    def __init__(self, backend: LocalBackend, spec: SandboxSpec, name: str) -> None:
        self.backend = backend
        self.spec = spec
        self.name = name
        self._state = _State.CREATED
        self._dir: Path | None = None
        self._cgroup: _Cgroup | None = None
        self._bridge: bridge.HostBridge | None = None
        self._running: dict[asyncio.SubprocessTransport, _Command] = {}
        self._gateway = urlsplit(spec.gateway_url) if spec.gateway_url else None

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
        return {self.workdir: host("work"), self._home: host("home"), self.tmpdir: host("tmp")}

    @property
    def workdir(self) -> str:
        return INSIDE_WORKDIR if self._isolated else str(self._host("work"))

    @property
    def tmpdir(self) -> str:
        return "/tmp" if self._isolated else str(self._host("tmp"))

    @property
    def _home(self) -> str:
        return INSIDE_HOME if self._isolated else str(self._host("home"))

    @property
    def _gateway_port(self) -> int:
        assert self._gateway is not None
        return self._gateway.port or (443 if self._gateway.scheme == "https" else 80)

    @property
    def _inner_port(self) -> int:
        # Ports below 1024 need a capability the sandbox does not have.
        return self._gateway_port if self._gateway_port >= 1024 else 8080

    @property
    def _bridged(self) -> bool:
        return self._isolated and self.spec.network == "gateway"

    @property
    def gateway_url(self) -> str | None:
        if self._gateway is None or self.spec.network == "none":
            return None
        if not self._bridged:  # network "host", or no isolation: the host's own address
            return self.spec.gateway_url
        return f"{self._gateway.scheme}://127.0.0.1:{self._inner_port}{self._gateway.path}"

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

    async def __aenter__(self) -> LocalSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._state is not _State.CREATED:
            raise SandboxError(f"sandbox {self.name} is {self._state.value}; it starts once")
        self._state = _State.RUNNING
        try:
            self._dir = Path(tempfile.mkdtemp(prefix=f"openforgerl-{self.name}-", dir=self.backend.state_dir))
            for sub in ("work", "home", "tmp", "run"):
                (self._dir / sub).mkdir()
            if self.backend.cgroups:
                self._cgroup = _Cgroup.create(self.backend.cgroup_root, self.name, self.spec.limits)
            if self._isolated:
                run = self._dir / "run"
                (run / "passwd").write_text(_PASSWD)
                (run / "group").write_text(_GROUP)
            if self._bridged:
                run = self._dir / "run"
                shutil.copyfile(bridge.__file__, run / "bridge.py")
                assert self._gateway is not None and self._gateway.hostname
                sock = str(run / "gw.sock")
                self._bridge = bridge.HostBridge(sock, self._gateway.hostname, self._gateway_port)
                await self._bridge.start()
            for path, data in self.spec.files.items():
                await self.put_file(path, data)
            probe = await self.exec(["true"], timeout=60)
            if not probe.ok:
                raise SandboxStartError(f"sandbox {self.name} cannot run commands: {probe.stderr.strip()}")
        except OSError as e:
            await self.stop()
            raise SandboxStartError(f"sandbox {self.name} failed to start: {e}") from e
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self._state in (_State.STOPPING, _State.STOPPED):
            return
        self._state = _State.STOPPING
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
        if self._dir is not None:
            try:
                await asyncio.to_thread(_rmtree, self._dir)
            except OSError as e:
                errors.append(e)
        self._state = _State.STOPPED
        if errors:
            raise SandboxError(f"sandbox {self.name} left traces behind: {errors}")

    # -- files -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _State.RUNNING:
            raise SandboxError(f"sandbox {self.name} is {self._state.value}")

    async def put_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        root, rel = self._resolve(path)
        payload = data.encode() if isinstance(data, str) else data
        await asyncio.to_thread(_write_beneath, root, rel, payload, mode)

    async def put_dir(self, src: str | Path, dest: str) -> None:
        self._check_open()
        root, rel = self._resolve(dest)
        await asyncio.to_thread(_copy_tree_beneath, Path(src), root, rel)

    async def get_file(self, path: str) -> bytes:
        self._check_open()
        root, rel = self._resolve(path)
        return await asyncio.to_thread(_read_beneath, root, rel)

    # -- exec ------------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        # Never the runner's own environment: it holds the runner's secrets.
        env = {"PATH": DEFAULT_PATH, "HOME": self._home, "USER": "sandbox", "LOGNAME": "sandbox"}
        env |= {"LANG": "C.UTF-8", "TMPDIR": self.tmpdir, **self.spec.env, **(extra or {})}
        if self._bridged and self._gateway is not None:
            outside = f"{self._gateway.scheme}://{self._gateway.netloc}"
            inside = f"{self._gateway.scheme}://127.0.0.1:{self._inner_port}"
            env = {k: v.replace(outside, inside) for k, v in env.items()}
        return env

    def _launcher(self) -> list[str]:
        """Joins the cgroups (or takes the rlimits) that every process of the command inherits."""
        cgroups = self._cgroup.procs_files if self._cgroup else []
        argv = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", *cgroups, "--"]
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

    def _bwrap_argv(self, argv: list[str], cwd: str) -> list[str]:
        assert self._dir is not None
        run = self._dir / "run"
        args = [*self.backend.bwrap_base, "--ro-bind", str(run / "passwd"), "/etc/passwd"]
        args += ["--ro-bind", str(run / "group"), "/etc/group"]
        if self.spec.network == "host":
            # After --unshare-all: keeps the host's network namespace (and only that).
            args.append("--share-net")
            args += _resolver_binds()
        binds = [(p, p) if isinstance(p, str) else p for p in self.spec.ro_binds]
        python = os.path.realpath(sys.executable)
        if self._bridged and not python.startswith("/usr/"):
            prefix = os.path.realpath(sys.base_prefix)
            binds.append((prefix, prefix))
        args += ["--proc", "/proc", "--dev", "/dev", "--bind", str(self._dir / "work"), INSIDE_WORKDIR]
        args += ["--bind", str(self._dir / "home"), INSIDE_HOME, "--bind", str(self._dir / "tmp"), "/tmp"]
        # After /tmp and HOME: a bind below them (a venv checked out under /tmp) must stay visible.
        for src, dst in binds:
            args += ["--ro-bind", src, dst]
        args += ["--ro-bind", str(run), INSIDE_RUN, "--remount-ro", "/", "--chdir", cwd, "--"]
        if self._bridged:
            args += [python, "-I", "-S", f"{INSIDE_RUN}/bridge.py", str(self._inner_port)]
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

    def _ended_by(self, code: int, signalled: bool, before: _Counters | None) -> str | None:
        """What ended a failed command that the sandbox did not kill itself, if not the command."""
        if code == 0:
            return None
        if self._state is not _State.RUNNING and code == 128 + signal.SIGKILL:
            return "stopped"
        if self._cgroup is not None and before is not None:
            after = self._cgroup.counters()
            if after.oom_kills > before.oom_kills:
                return "oom"
            if after.pids_hits > before.pids_hits:
                return "pids"  # a fork failed, and the command gave up before the watch saw it
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

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (a limit with a result, not a cancel scope)
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        self._check_open()
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("empty command")
        cwd = posixpath.join(self.workdir, cwd) if cwd else self.workdir
        deadlines = [t for t in (timeout, self.spec.limits.wall_time_s) if t is not None]
        deadline = min(deadlines) if deadlines else None
        full = self._launcher() + (self._bwrap_argv(argv, cwd) if self._isolated else argv)
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
            )
        )
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
                pipe.write(stdin.encode() if isinstance(stdin, str) else stdin)
                pipe.close()  # after the data is flushed; a command that exits unread just loses it
            killed_by = await self._wait(transport, command, watch, deadline)
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
        stdout, stdout_truncated = command.output[1].text()
        stderr, stderr_truncated = command.output[2].text()
        return ExecResult(
            exit_code=code,
            stdout=stdout,
            stderr=stderr,
            timed_out=killed_by == "wall-time",
            killed_by=killed_by,
            stdout_truncated=stdout_truncated,
            stderr_truncated=stderr_truncated,
            duration_s=time.monotonic() - started,
        )
