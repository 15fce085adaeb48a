"""The one protocol every sandbox backend implements (local bwrap, Docker, Kubernetes, ...)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit

Network = Literal["none", "gateway", "host"]
NETWORKS: tuple[Network, ...] = ("none", "gateway", "host")

GiB = 1 << 30


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


@runtime_checkable
class Sandbox(Protocol):
    """One rollout's sandbox: start, exec, put/get files, stop.

    Paths inside are absolute, or relative to `workdir`. Processes started by one exec must not be
    relied on to outlive it.
    """

    name: str
    spec: SandboxSpec

    @property
    def workdir(self) -> str:
        """The work dir as commands inside see it."""
        ...

    @property
    def tmpdir(self) -> str:
        """The sandbox's own temp dir as commands inside see it (their TMPDIR): where the runner puts
        what the agent must not see in the work dir. Not always /tmp: a local sandbox without
        isolation has no /tmp of its own."""
        ...

    @property
    def gateway_url(self) -> str | None:
        """The gateway as commands inside reach it (build the rollout's base URLs from this)."""
        ...

    @property
    def info(self) -> SandboxInfo: ...

    async def start(self) -> None:
        """Build the sandbox; raises SandboxStartError when the infrastructure fails."""
        ...

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
        ...

    async def put_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    async def put_dir(self, src: str | Path, dest: str) -> None:
        """Copy a host directory's contents into the sandbox at `dest`."""
        ...

    async def get_file(self, path: str) -> bytes: ...

    async def stop(self) -> None:
        """Kill everything and remove every trace (processes, mounts, cgroups, temp dirs); idempotent."""
        ...


@runtime_checkable
class SandboxBackend(Protocol):
    name: str

    def create(self, spec: SandboxSpec, name: str) -> Sandbox:
        """A sandbox not yet started; `name` is unique among live sandboxes ([A-Za-z0-9_.-])."""
        ...

    def check(self) -> BackendCheck: ...
