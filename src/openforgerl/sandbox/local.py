"""The local backend: bubblewrap namespaces, cgroup v1 limits; a plain subprocess where bwrap is missing.

Each exec is one bwrap run over the sandbox's own work dir, HOME and /tmp (host temp dirs that persist
between execs): new user, pid, net, ipc, uts and cgroup namespaces; a root holding only the read-only
system dirs (/usr, /etc, the lib links) and the spec's binds, minus its hidden paths; uid 1000, no
capabilities, and the seccomp filter of seccomp.py (ptrace, mount, namespaces, bpf, io_uring... fail
with EPERM). The pid namespace dies with its command, so nothing one exec starts outlives it.

Who uid 1000 is on the host: a root runner drops to `host_user` (nobody:nogroup by default) before
bwrap starts (setpriv: no capabilities, no other groups, no_new_privs), so the kernel's own checks keep
from the agent every file that other users may not read, under /etc and under every bind alike (a
0600 file in the venv, a 0700 dir in the package). The sandbox's work dir, HOME and /tmp belong to that
uid, and so does every file the runner puts there. bwrap resolves its binds as that uid too: a bind the
uid could not reach (the interpreter under a 0700 /root) is first bound by root onto a mount point it
can reach, in a mount namespace of the exec's own. A runner that is not root runs sandboxes as itself,
and masks /etc where other users may not read instead.
With network "gateway" the command's loopback has a relay (bridge.py) to a Unix socket that the host
end forwards to the gateway; nothing else is reachable. With network "host" (for tasks on live web
sites) the command shares the host's network namespace: it reaches the internet, the gateway at its
host URL, and whatever else listens on the host, its loopback included; the other namespaces stay.

A spec's own work dir (`SandboxSpec.workdir`, Harbor's /app) is where bwrap binds the sandbox's work
dir, and each of its extra dirs (/tests, /logs/verifier) is a dir of the sandbox's own bound there;
without bwrap such a spec is refused (SandboxUnavailable), as the host has no /app to give.

Limits: a cgroup v1 per sandbox (memory, cpu, pids) that every exec joins before it starts, which also
tells OOM kills and pids-limit hits apart; rlimits through `prlimit` where cgroups are not writable.

Without bwrap, commands run as plain subprocesses in the sandbox's temp dirs: no isolation at all, and
the backend says so (a warning at every creation, isolation "none" in check() and info). Paths inside are
then those host dirs: `workdir`, HOME and `tmpdir` (TMPDIR), never the host's own /tmp.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import posixpath
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from openforgerl.sandbox import bridge
from openforgerl.sandbox import seccomp as seccomp_filter
from openforgerl.sandbox.base import (
    OUTPUT_LIMIT,
    BackendCheck,
    Counters,
    ExecResult,
    Limits,
    Output,
    Sandbox,
    SandboxError,
    SandboxInfo,
    SandboxSpec,
    SandboxStartError,
    SandboxUnavailable,
    State,
    read_counter,
    rewrite_gateway,
)

log = logging.getLogger(__name__)

INSIDE_WORKDIR = "/workspace"
INSIDE_HOME = "/home/sandbox"
INSIDE_RUN = "/run/openforgerl"
SANDBOX_UID = 1000
# The host uid:gid that sandboxes run as when the runner is root (nobody:nogroup unless this is set).
HOST_USER_ENV = "OPENFORGERL_SANDBOX_USER"
DEFAULT_HOST_USER = (65534, 65534)
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
# Binds each (source, mount point) pair given before "--" in a mount namespace of its own, then
# execs the rest: what the sandbox's uid may not reach on the host (an interpreter under /root) it
# reaches through mount points it can (in the sandbox's dir). Run by root, before the uid is dropped.
_STAGE = 'while [ "$1" != -- ]; do {mount} --bind "$1" "$2" || exit 125; shift 2; done; shift; exec "$@"'
_PASSWD = (
    f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{INSIDE_HOME}:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
)
_GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"


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

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def counters(self) -> Counters:
        return Counters(
            oom_kills=read_counter(self.dirs["memory"] / "memory.oom_control", "oom_kill"),
            pids_hits=read_counter(self.dirs["pids"] / "pids.events", "max"),
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


# Who owns what the runner writes into a sandbox: (uid, gid) on the host, or None to leave it the
# runner's (which is then the sandbox's own uid).
Owner = tuple[int, int] | None


def _dir_beneath(root: Path, parts: Sequence[str], create: bool, owner: Owner = None) -> int:
    """An fd for root/parts, refusing symlinks on the way: the sandbox owns these dirs, and the runner
    must never read or write through a link it planted (docker cp's CVE-2018-15664). Dirs it creates
    are given to `owner`."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            made = False
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made = True
            child = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            if made and owner is not None:
                os.fchown(fd, *owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_beneath(root: Path, rel: PurePosixPath, flags: int, mode: int = 0o644, owner: Owner = None) -> int:
    if not rel.parts:
        raise IsADirectoryError(f"{root} is a directory")
    parent = _dir_beneath(root, rel.parts[:-1], create=bool(flags & os.O_CREAT), owner=owner)
    try:
        # O_NONBLOCK: a FIFO planted in place of a file must not hang the runner.
        fd = os.open(rel.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent)
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{rel} is not a regular file")
    return fd


def _write_beneath(root: Path, rel: PurePosixPath, data: bytes, mode: int, owner: Owner = None) -> None:
    fd = _open_beneath(root, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode, owner)
    with open(fd, "wb") as f:
        f.write(data)
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)


def _read_beneath(root: Path, rel: PurePosixPath) -> bytes:
    with open(_open_beneath(root, rel, os.O_RDONLY), "rb") as f:
        return f.read()


def _copy_tree_beneath(src: Path, root: Path, rel: PurePosixPath, owner: Owner = None) -> None:
    if not src.is_dir():
        raise NotADirectoryError(f"{src} is not a directory")
    os.close(_dir_beneath(root, rel.parts, create=True, owner=owner))
    for dirpath, dirnames, filenames in os.walk(src):
        sub = rel / Path(dirpath).relative_to(src).as_posix()
        parent = _dir_beneath(root, sub.parts, create=True, owner=owner)
        try:
            for name in [*dirnames, *filenames]:
                host = Path(dirpath, name)
                if host.is_symlink():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=parent)
                    os.symlink(os.readlink(host), name, dir_fd=parent)
                    if owner is not None:
                        os.chown(name, *owner, dir_fd=parent, follow_symlinks=False)
                elif host.is_dir():
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=parent)
                        if owner is not None:
                            os.chown(name, *owner, dir_fd=parent, follow_symlinks=False)
                else:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                    fd = _open_beneath(root, sub / name, flags, owner=owner)
                    with open(fd, "wb") as out, host.open("rb") as inp:
                        shutil.copyfileobj(inp, out)
                        if owner is not None:
                            os.fchown(fd, *owner)
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


def _host_user(value: str) -> tuple[int, int]:
    """uid[:gid] (the gid defaults to the uid) as HOST_USER_ENV gives it."""
    uid, _, gid = value.partition(":")
    try:
        user = (int(uid), int(gid or uid))
    except ValueError:
        raise ValueError(f"{HOST_USER_ENV} must be uid[:gid], not {value!r}") from None
    if min(user) < 0:
        raise ValueError(f"{HOST_USER_ENV} must be uid[:gid], not {value!r}")
    return user


def _reachable(path: str, user: tuple[int, int]) -> bool:
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


class LocalBackend:
    """Sandboxes on this machine. bwrap/cgroups: None detects them, True requires them, False skips them.

    `host_user`: the host (uid, gid) that sandboxes run as when the runner is root; None takes
    OPENFORGERL_SANDBOX_USER (uid[:gid]) or else 65534:65534 (nobody:nogroup). A uid of 0 keeps them
    root, as they were before: then root-only files under the binds are readable inside. A runner that
    is not root runs them as itself. `seccomp`: load sandbox/seccomp.py's filter into every command.
    """

    name = "local"

    def __init__(
        self,
        *,
        bwrap: bool | None = None,
        cgroups: bool | None = None,
        state_dir: str | Path | None = None,
        cgroup_root: str | Path = "/sys/fs/cgroup",
        output_limit: int = OUTPUT_LIMIT,
        host_user: tuple[int, int] | None = None,
        seccomp: bool = True,
    ) -> None:
        self.state_dir = Path(state_dir) if state_dir else None
        self.cgroup_root = Path(cgroup_root)
        self.output_limit = output_limit
        self._available: dict[str, str] = {}
        self._missing: dict[str, str] = {}
        self.bwrap = self._find_bwrap(bwrap)
        self.host_user: tuple[int, int] | None = None
        self.drop_argv: list[str] = []  # setpriv and its args: becomes host_user, with no privileges
        self.stage_argv: list[str] = []  # unshare and the staging script (see _STAGE)
        if self.bwrap:
            self._find_host_user(host_user)
        self.seccomp_program = self._seccomp_program(seccomp) if self.bwrap else None
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

    def _find_host_user(self, want: tuple[int, int] | None) -> None:
        """Sets host_user and the commands that drop to it, where the runner is root and can."""
        if os.geteuid() != 0:
            self._available["user"] = f"sandboxes run as the runner's own uid {os.geteuid()}"
            return
        env = os.environ.get(HOST_USER_ENV)
        user = want if want is not None else _host_user(env) if env else DEFAULT_HOST_USER
        if user[0] == 0:
            self._missing["user"] = (
                "sandboxes run as host root (by configuration): root-only files are readable"
            )
            log.warning(
                "sandboxes run as host root: files only root may read, under every bind, are readable"
            )
            return
        tools = {t: shutil.which(t) for t in ("setpriv", "unshare", "mount")}
        lacking = [t for t, path in tools.items() if path is None]
        drop = [str(tools["setpriv"]), f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
        drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        stage = [str(tools["unshare"]), "--mount", "--propagation", "private", "--"]
        stage += ["/bin/sh", "-c", _STAGE.format(mount=shlex.quote(str(tools["mount"]))), "sh"]
        problem = f"{', '.join(lacking)} not found (Debian packages util-linux, mount)" if lacking else ""
        if not problem:
            assert self.bwrap
            # The whole chain an exec uses, once: a kernel or policy that refuses unprivileged user
            # namespaces (or mount namespaces to root) shows here, not in every sandbox.
            probe = subprocess.run(
                [
                    *stage[:5],
                    *drop,
                    self.bwrap,
                    "--unshare-all",
                    "--unshare-user",
                    "--ro-bind",
                    "/",
                    "/",
                    "true",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode != 0:
                problem = probe.stderr.strip() or f"exit {probe.returncode}"
        if problem:
            self._missing["user"] = (
                f"cannot run sandboxes as host uid {user[0]} ({problem}): they run as host root, "
                "and root-only files under the binds are readable inside"
            )
            log.warning("sandboxes run as host root: %s", self._missing["user"])
            return
        self.host_user, self.drop_argv, self.stage_argv = user, drop, stage
        self._available["user"] = (
            f"sandboxes run as host uid {user[0]}, gid {user[1]} (no capabilities, no other groups): "
            "files other users may not read stay unreadable under every bind"
        )

    def _seccomp_program(self, want: bool) -> bytes | None:
        if not want:
            self._missing["seccomp"] = "disabled by configuration"
            return None
        program = seccomp_filter.program()
        if program is None:
            self._missing["seccomp"] = f"no system call table for {os.uname().machine}: no filter"
            return None
        n = len(seccomp_filter.SYSCALLS[str(seccomp_filter.native_arch())])
        self._available["seccomp"] = f"{n} system calls fail with EPERM (openforgerl.sandbox.seccomp)"
        return program

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
        lib and bin links, /etc: without host_user, masked where other users may not read)."""
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
        if self.host_user is not None:
            return args  # the kernel keeps from the sandbox's uid what other users may not read
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
        if not self.bwrap and (spec.workdir or spec.extra_dirs):
            wanted = ", ".join(p for p in (spec.workdir, *spec.extra_dirs) if p)
            raise SandboxUnavailable(
                f"sandbox {name} needs {wanted} inside it, which the local backend makes only with "
                f"bubblewrap ({self._missing.get('bwrap', 'disabled')}): install the Debian package "
                "bubblewrap, or use the Docker backend"
            )
        if not self.bwrap:
            log.warning(
                "sandbox %s runs WITHOUT ISOLATION (no bwrap): it can read the host's files%s",
                name,
                " and reach any address" if spec.network == "gateway" else " and reach the network",
            )
        return LocalSandbox(self, spec, name)


class LocalSandbox(Sandbox):
    """A sandbox of `LocalBackend`: see the module's doc."""

    def __init__(self, backend: LocalBackend, spec: SandboxSpec, name: str) -> None:
        super().__init__(spec, name)
        self.backend = backend
        self._dir: Path | None = None
        self._cgroup: _Cgroup | None = None
        self._bridge: bridge.HostBridge | None = None
        self._running: dict[asyncio.SubprocessTransport, _Command] = {}
        # Set at start: the host path bwrap binds the sandbox's dir from, the bwrap args for the
        # spec's binds and hidden paths, and the (host path, mount point) pairs staged for a uid that
        # cannot reach them (see _STAGE).
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
            self._cgroup = _Cgroup.create(self.backend.cgroup_root, self.name, self.spec.limits)
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
        launcher binds it on first (see _STAGE) where the sandbox's uid could not reach it."""
        user = self.backend.host_user
        if user is None:
            return path
        real = os.path.realpath(path)
        if _reachable(real, user):
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
            if _reachable(str(self._dir / "stage"), user):
                self._stage_dir = self._dir / "stage"
                self._stage_dir.mkdir()
            else:
                for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
                    if os.path.isdir(base) and _reachable(os.path.join(base, "x"), user):
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
                    await asyncio.to_thread(_rmtree, path)
                except OSError as e:
                    errors.append(e)
        if errors:
            raise SandboxError(f"sandbox {self.name} left traces behind: {errors}")

    # -- files -----------------------------------------------------------------------------------

    async def _put_file(self, path: str, data: bytes, mode: int) -> None:
        root, rel = self._resolve(path)
        await asyncio.to_thread(_write_beneath, root, rel, data, mode, self._owner)

    async def _put_dir(self, src: Path, dest: str) -> None:
        root, rel = self._resolve(dest)
        await asyncio.to_thread(_copy_tree_beneath, src, root, rel, self._owner)

    async def _get_file(self, path: str) -> bytes:
        root, rel = self._resolve(path)
        return await asyncio.to_thread(_read_beneath, root, rel)

    # -- exec ------------------------------------------------------------------------------------

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        # Never the runner's own environment: it holds the runner's secrets.
        env = {"PATH": DEFAULT_PATH, "HOME": self._home, "USER": "sandbox", "LOGNAME": "sandbox"}
        env |= {"LANG": "C.UTF-8", "TMPDIR": self.tmpdir, **self.spec.env, **extra}
        return rewrite_gateway(env, self.spec.gateway_url, self.gateway_url)

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
