"""The one protocol every sandbox backend implements (local bwrap, Docker, Kubernetes, ...): what a
sandbox is asked for (`SandboxSpec`), what its commands return (`ExecResult`, captured by `Output`), and
`Sandbox`, the lifecycle that every backend's sandbox inherits and fills in with its own steps."""

from __future__ import annotations

import abc
import asyncio
import enum
import os
import posixpath
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, Self, runtime_checkable
from urllib.parse import urlsplit

Network = Literal["none", "gateway", "host"]
NETWORKS: tuple[Network, ...] = ("none", "gateway", "host")

GiB = 1 << 30
# How much of each of a command's stdout and stderr is kept (its head and tail).
OUTPUT_LIMIT = 1 << 20


@dataclass(slots=True, frozen=True)
class Limits:
    """What one sandbox may use; None leaves that resource unlimited."""

    memory_bytes: int | None = 4 * GiB
    cpus: float | None = 1.0
    pids: int | None = 1024
    # The longest any one exec may run; exec(timeout=...) can only shorten it.
    wall_time_s: float | None = 3600.0


@dataclass(slots=True, frozen=True)
class SandboxSpec:
    """What a rollout's sandbox looks like; the backend decides how to build it."""

    # Written at start: path (relative to the work dir, or absolute inside it, HOME or /tmp) -> content.
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    # A host folder copied into the work dir at start, before `files`: byte for byte, with its files'
    # modes and its symlinks (which must point inside it; see `check_tree`). Streamed, never read
    # into memory as text.
    workspace: Path | None = None
    # Where the work dir is inside (absolute; e.g. Harbor's /app); None: the backend's own
    # (/workspace). The local backend needs bubblewrap for it.
    workdir: str | None = None
    # More empty writable dirs inside (absolute), that files can be put into and read from like the
    # work dir: e.g. Harbor's /tests and /logs/verifier.
    extra_dirs: Sequence[str] = ()
    # A Docker build context (a folder with a Dockerfile) that makes `image`: the Docker backend
    # builds it where the engine lacks the image; the other backends refuse it (see their docs).
    build: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    # "gateway": the gateway (and nothing else) is reachable, at `Sandbox.gateway_url`.
    # "host": the network as the host has it, for tasks on live web sites: the internet, and the
    # gateway at `Sandbox.gateway_url` too; how far that reaches into the host depends on the backend.
    network: Network = "none"
    # The gateway as the host reaches it, e.g. http://127.0.0.1:8000. Env values that contain it are
    # rewritten to the sandbox's own address for it.
    gateway_url: str | None = None
    # Host paths made visible read-only (a harness install, the project's venv): a path is bound at
    # the same path inside, a (host, inside) pair where given.
    ro_binds: Sequence[str | tuple[str, str]] = ()
    # Host paths under ro_binds that commands inside must not see (parts of a bound package that no
    # harness needs, such as task code): each is replaced by an empty dir, or an empty file. The
    # local backend only; a container sees what its image holds.
    hidden: Sequence[str] = ()
    # The task's container image (container backends; None: the backend's configured image) and
    # labels naming what the sandbox is for (e.g. {"task": id}); the local backend ignores both.
    image: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {', '.join(NETWORKS)}, not {self.network!r}")
        if self.network == "gateway" and not self.gateway_url:
            raise ValueError("network='gateway' needs gateway_url")
        if self.gateway_url is not None:
            url = urlsplit(self.gateway_url)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    f"gateway_url must be http(s)://host[:port][/path], not {self.gateway_url!r}"
                )
        for bind in self.ro_binds:
            for path in (bind,) if isinstance(bind, str) else bind:
                if not Path(path).is_absolute():
                    raise ValueError(f"ro_binds need absolute paths, not {path!r}")
        for path in self.hidden:
            if not Path(path).is_absolute():
                raise ValueError(f"hidden needs absolute paths, not {path!r}")
        for inside in [*([self.workdir] if self.workdir else []), *self.extra_dirs]:
            if not posixpath.isabs(inside) or posixpath.normpath(inside) in ("/", "//"):
                raise ValueError(f"workdir and extra_dirs need absolute paths below /, not {inside!r}")
        if self.build is not None and not self.image:
            raise ValueError("build needs image: the tag the build makes")
        if self.workspace is not None and not Path(self.workspace).is_dir():
            raise ValueError(f"workspace {self.workspace} is not a directory")


@dataclass(slots=True, frozen=True)
class ExecResult:
    """How one command ended. Limits and timeouts are outcomes here, never exceptions.

    `exit_code` follows the shell's convention: 128 + N when the command died of signal N.
    `killed_by` names what ended a command that did not end by itself: "wall-time" (timed out; its whole
    process tree was killed), "pids" (a fork hit the process limit; the tree is killed once that is seen),
    "oom" (the kernel killed a process for memory), "stopped" (the sandbox was stopped meanwhile), or
    "signal N". A limit is blamed only for a command that failed.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    killed_by: str | None = None
    # The output was longer than the capture limit: its head and tail were kept, with a marker between.
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None


@dataclass(slots=True, frozen=True)
class SandboxInfo:
    """What a sandbox actually enforces; "none" anywhere means the host is exposed there."""

    name: str
    backend: str
    isolation: str  # "bwrap", "docker", "pod", ... or "none"
    limits: str  # "cgroup", "rlimit" or "none"
    network: str  # "none", "gateway" (only the gateway is reachable) or "host" (unrestricted)
    host_dir: str | None = None


@dataclass(slots=True, frozen=True)
class BackendCheck:
    """What a backend can provide on this machine, and what it lacks (with how to get it)."""

    backend: str
    isolation: str
    limits: str
    available: Mapping[str, str]
    missing: Mapping[str, str]


class SandboxError(Exception):
    """A sandbox operation failed."""


class SandboxStartError(SandboxError):
    """The infrastructure failed to start a sandbox or a command in it; never the policy's fault.

    The runner retries these and does not count them as a rollout's failure.
    """


class SandboxUnavailable(SandboxError):
    """The backend cannot provide what was asked on this machine (a missing tool); retrying won't help."""


class ImageUnavailable(SandboxUnavailable):
    """A task's image can be neither found nor built (its FROM image absent, its Dockerfile failing):
    that task's rollouts fail as infrastructure, at once, naming task and image; the run goes on."""


def link_out(top: Path, link: Path) -> str | None:
    """The target of `link`, a symlink under `top`, where it leads out of `top`; else None. Out by its
    text (absolute, or up past the top: so it is wherever the tree is copied) or by where it resolves on
    this machine (through another link, e.g. `d/up -> ..` then `x -> d/up/../secret`)."""
    target = os.readlink(link)
    rel = link.relative_to(top).as_posix()
    inside = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    if posixpath.isabs(target) or inside == ".." or inside.startswith("../"):
        return target
    real, real_top = os.path.realpath(link), os.path.realpath(top)
    return None if real == real_top or real.startswith(real_top.rstrip("/") + "/") else target


def check_tree(src: Path) -> None:
    """Raises SandboxError where a workspace folder holds what cannot travel into a sandbox as it is:
    a symlink that leads out of the folder (`link_out`), or something that is not a file, a dir or a
    symlink (a FIFO, a socket, a device)."""
    top = Path(src)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                if (target := link_out(top, path)) is not None:
                    raise SandboxError(
                        f"{path}: a symlink to {target!r}, outside the workspace {top}: "
                        "only links that stay inside it are copied into a sandbox"
                    )
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise SandboxError(f"{path}: neither a file, a dir nor a symlink: it cannot be copied")


class Capture:
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


class Output:
    """A command's stdout and stderr as they stream in, each a `Capture` of `limit` bytes."""

    def __init__(self, limit: int = OUTPUT_LIMIT) -> None:
        self.limit = limit
        self.stdout = Capture(limit)
        self.stderr = Capture(limit)

    def stdout_bytes(self) -> bytes:
        """All of stdout, for file reads (their limit is set high enough that nothing is cut)."""
        if self.stdout.total > len(self.stdout.head) + len(self.stdout.tail):
            raise OSError(f"file larger than {self.limit} bytes")
        return bytes(self.stdout.head + self.stdout.tail)

    def result(self, code: int, *, killed_by: str | None, started: float, ended: float) -> ExecResult:
        stdout, stdout_cut = self.stdout.text()
        stderr, stderr_cut = self.stderr.text()
        return ExecResult(
            exit_code=code,
            stdout=stdout,
            stderr=stderr,
            timed_out=killed_by == "wall-time",
            killed_by=killed_by,
            stdout_truncated=stdout_cut,
            stderr_truncated=stderr_cut,
            duration_s=ended - started,
        )


@dataclass(slots=True, frozen=True)
class Counters:
    """A cgroup's OOM kills and pids-limit hits: read before and after a command, they tell whether a
    limit ended it."""

    oom_kills: int
    pids_hits: int

    def limit_hit(self, after: Counters | None) -> str | None:
        """ "oom" or "pids" where `after` (read once the command ended) counts more than this."""
        if after is None:
            return None
        if after.oom_kills > self.oom_kills:
            return "oom"
        if after.pids_hits > self.pids_hits:
            return "pids"
        return None


def read_counter(file: Path, key: str) -> int:
    """The value of `key` in a cgroup file of "key value" lines (0 where it is absent)."""
    for line in file.read_text().splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def rewrite_gateway(env: Mapping[str, str], outside: str | None, inside: str | None) -> dict[str, str]:
    """Env values that name the gateway as the host reaches it, rewritten to how the sandbox does."""
    if not outside or not inside:
        return dict(env)
    out, ins = urlsplit(outside), urlsplit(inside)
    old, new = f"{out.scheme}://{out.netloc}", f"{ins.scheme}://{ins.netloc}"
    return {k: v.replace(old, new) for k, v in env.items()}


class State(enum.Enum):
    """Where a sandbox is in its life: created -> starting -> running -> stopping -> stopped."""

    CREATED = "created"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Sandbox(abc.ABC):
    """One rollout's sandbox: start, exec, put/get files, stop.

    Paths inside are absolute, or relative to `workdir`. Processes started by one exec must not be
    relied on to outlive it.

    The lifecycle is written here once; a backend supplies its steps: `_provision` (build it),
    `_ready` (once running: the spec's files, a probe), `_exec` (one command, its argv, env, cwd,
    limit and stdin already checked), the file moves and `_teardown`. A sandbox starts once; exec and
    the file moves need it running; stop is idempotent, and a failed start stops it.
    """

    name: str
    spec: SandboxSpec

    def __init__(self, spec: SandboxSpec, name: str) -> None:
        self.spec = spec
        self.name = name
        self._state = State.CREATED
        self._gateway = urlsplit(spec.gateway_url) if spec.gateway_url else None

    # -- what commands inside see -------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def workdir(self) -> str:
        """The work dir as commands inside see it."""

    @property
    @abc.abstractmethod
    def tmpdir(self) -> str:
        """The sandbox's own temp dir as commands inside see it (their TMPDIR): where the runner puts
        what the agent must not see in the work dir. Not always /tmp: a local sandbox without
        isolation has no /tmp of its own."""

    @property
    @abc.abstractmethod
    def gateway_url(self) -> str | None:
        """The gateway as commands inside reach it (build the rollout's base URLs from this)."""

    @property
    @abc.abstractmethod
    def info(self) -> SandboxInfo: ...

    @property
    def _gateway_port(self) -> int:
        assert self._gateway is not None
        return self._gateway.port or (443 if self._gateway.scheme == "https" else 80)

    @property
    def _relay_url(self) -> str:
        """The gateway as a relay on the sandbox's loopback (bridge.py) serves it: at its own port, or
        8080 for a port below 1024 (which needs a capability the sandbox lacks)."""
        assert self._gateway is not None
        return f"{self._gateway.scheme}://127.0.0.1:{self._relay_port}{self._gateway.path}"

    @property
    def _relay_port(self) -> int:
        return self._gateway_port if self._gateway_port >= 1024 else 8080

    # -- the lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Build the sandbox; raises SandboxStartError when the infrastructure fails."""
        if self._state is not State.CREATED:
            raise SandboxError(f"sandbox {self.name} is {self._state.value}; it starts once")
        self._state = State.STARTING
        try:
            await self._provision()
            self._state = State.RUNNING
            await self._ready()
        except BaseException as e:
            await self.stop()
            failure = self._start_failure(e)
            if failure is None:
                raise
            raise failure from e

    async def stop(self) -> None:
        """Kill everything and remove every trace (processes, mounts, cgroups, temp dirs); idempotent."""
        if self._state in (State.STOPPING, State.STOPPED):
            return
        self._state = State.STOPPING
        try:
            await self._teardown()
        finally:
            self._state = State.STOPPED

    def _check_open(self) -> None:
        if self._state is not State.RUNNING:
            raise SandboxError(f"sandbox {self.name} is {self._state.value}")

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (a limit with a result, not a cancel scope)
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        """Run argv, or a shell command line given as one string (/bin/sh -c).

        `timeout` ends the command with a result (timed_out, killed_by "wall-time"); cancelling the
        call instead kills its process tree and returns nothing.
        """
        self._check_open()
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("empty command")
        limits = [t for t in (timeout, self.spec.limits.wall_time_s) if t is not None]
        return await self._exec(
            argv,
            env=env or {},
            cwd=posixpath.join(self.workdir, cwd) if cwd else self.workdir,
            limit_s=min(limits) if limits else None,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
        )

    async def put_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        await self._put_file(path, data.encode() if isinstance(data, str) else data, mode)

    async def put_dir(self, src: str | Path, dest: str) -> None:
        """Copy a host directory's contents into the sandbox at `dest`."""
        self._check_open()
        await self._put_dir(Path(src), dest)

    async def get_file(self, path: str) -> bytes:
        self._check_open()
        return await self._get_file(path)

    # -- what a backend supplies --------------------------------------------------------------------

    @abc.abstractmethod
    async def _provision(self) -> None:
        """Build what the sandbox runs in (state "starting"); a failure stops the sandbox again."""

    @abc.abstractmethod
    async def _ready(self) -> None:
        """Once running, before start returns: the spec's files, a probe that commands run."""

    def _start_failure(self, error: BaseException) -> BaseException | None:
        """What a failed start raises instead of `error` (None: `error` itself)."""
        return None

    @abc.abstractmethod
    async def _teardown(self) -> None:
        """Remove every trace of what `_provision` built, whatever it got to (state "stopping")."""

    @abc.abstractmethod
    async def _exec(
        self, argv: list[str], *, env: Mapping[str, str], cwd: str, limit_s: float | None, stdin: bytes | None
    ) -> ExecResult:
        """Run argv in `cwd` (absolute inside) for at most `limit_s`, the spec's env updated by `env`."""

    @abc.abstractmethod
    async def _put_file(self, path: str, data: bytes, mode: int) -> None: ...

    @abc.abstractmethod
    async def _put_dir(self, src: Path, dest: str) -> None: ...

    @abc.abstractmethod
    async def _get_file(self, path: str) -> bytes: ...

    async def _put_workspace(self) -> None:
        """The spec's workspace, copied into the work dir: what every backend's `_ready` puts in first
        (before the spec's files)."""
        if self.spec.workspace is not None:
            await asyncio.to_thread(check_tree, self.spec.workspace)
            await self._put_dir(Path(self.spec.workspace), self.workdir)


@runtime_checkable
class SandboxBackend(Protocol):
    name: str

    def create(self, spec: SandboxSpec, name: str) -> Sandbox:
        """A sandbox not yet started; `name` is unique among live sandboxes ([A-Za-z0-9_.-])."""
        ...

    def check(self) -> BackendCheck: ...
