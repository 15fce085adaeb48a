"""The Docker backend: a container per rollout, through the Docker Engine API (the `docker` SDK).

A container: the task's image running an idle placeholder as uid 1000, a read-only root, tmpfs for the
work dir, HOME and /tmp, no capabilities, no new privileges, docker's init to reap orphans, the spec's
memory (no swap), CPU and pids limits, and labels for the run and the sandbox. Network "none" is
docker's own; network "gateway" is the same empty network namespace plus the local backend's relay
(bridge.py): a Unix socket on the host, bound into the container, forwards to the gateway, and a
listener on the container's loopback (the container's main process, which needs python3 in the image)
forwards to the socket. Nothing else is reachable. Network "host" (tasks on live web sites) is
docker's default bridge network, not the host's namespace: the internet and what the host exposes on
the bridge, with the gateway through the same relay (so a gateway on the host's loopback works too).

A spec with its own work dir (`SandboxSpec.workdir`, Harbor's /app) gets there a fresh volume that
Docker fills from the image (what its Dockerfile put there), runs as the image's user (Harbor's tasks
are written for it; still without capabilities), and gets its HOME, /tmp and extra dirs (/tests,
/logs/verifier) as tmpfs that any user may write. A sandbox's image is made once per backend
(`ensure_image`): found on the engine, else built from the spec's `build` Dockerfile, else pulled; one
that cannot be had raises ImageUnavailable naming the task and the image (and its missing FROM
images), at once again for every later sandbox of it: the runner marks that task, the others run on.

`ro_binds` are bind-mounted read-only (the built-in harnesses' modules, which the image's python3 runs:
harnesses/launch.py), so the engine must see this host's files (a local engine); `hidden` is the local
backend's alone.

Commands and files go through `docker exec` with container.py's wrapper, as in the Kubernetes backend
(tar into tmpfs cannot use docker's archive API: it writes beneath the mounts). The SDK blocks, so
every call runs in a thread pool of the backend's own, sized for commands that run for an hour.
An OOM kill or a pids-limit hit is read from the container's cgroup where this host has it (a local
engine), as the local backend does: the rollout's doing, a result. A container that the engine was
told to kill under a command (docker kill, stop, rm -f: its events say) is not: SandboxStartError,
which the runner retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import docker.types
from docker.utils.socket import frames_iter

from openforgerl.sandbox import bridge, container
from openforgerl.sandbox.base import (
    BackendCheck,
    Counters,
    ImageUnavailable,
    Output,
    SandboxError,
    SandboxSpec,
    SandboxStartError,
    SandboxUnavailable,
    read_counter,
    rewrite_gateway,
)
from openforgerl.sandbox.container import MANAGED_BY, RUN, SANDBOX

log = logging.getLogger(__name__)

T = TypeVar("T")

RUNNER = "openforgerl.dev/runner"  # host:pid of the runner that made it, for `openforge gc`
INSIDE_RUN = "/run/openforgerl"


@dataclass(frozen=True)
class DockerConfig:
    run_id: str
    image: str
    base_url: str | None = None  # None: $DOCKER_HOST or the local socket
    max_containers: int = 32  # sandboxes whose commands can run at once (one thread each, and one spare)
    tmpfs_size: str = "1g"  # each of the work dir, HOME and /tmp (tmpfs counts against memory)
    runtime: str | None = None  # e.g. runsc (gVisor)
    labels: Mapping[str, str] = field(default_factory=dict)


def _host_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class DockerBackend:
    """Sandboxes as containers of one Docker engine: see the module's doc."""

    name = "docker"

    def __init__(self, cfg: DockerConfig) -> None:
        self.cfg = cfg
        self._client: docker.DockerClient | None = None
        # Each running command holds a thread until it ends.
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.max_containers * 2 + 4, "openforge-docker")
        self._images: dict[str, asyncio.Lock] = {}  # one build or pull per image
        self._ready: set[str] = set()
        self._failed: dict[str, str] = {}  # image -> why it cannot be had (ImageUnavailable)

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            try:
                url = self.cfg.base_url
                self._client = docker.DockerClient(base_url=url) if url else docker.from_env()
            except docker.errors.DockerException as e:
                raise SandboxUnavailable(f"no Docker engine: {e}") from e
        return self._client

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    @property
    def isolation(self) -> str:
        return f"docker ({self.cfg.runtime})" if self.cfg.runtime else "docker"

    def create(self, spec: SandboxSpec, name: str) -> DockerSandbox:
        return DockerSandbox(self, spec, name)

    async def ensure_image(self, image: str, build: Path | None, task: str) -> None:
        """Makes `image` present on the engine, once per image however many sandboxes ask at once:
        built from the Dockerfile in `build` (its tag names the context's digest, so a changed
        context is a new image), or pulled. Where it can be neither, ImageUnavailable names `task`
        and the image, and every later ask fails at once with the same words."""
        async with self._images.setdefault(image, asyncio.Lock()):
            if image in self._ready:
                return
            if image in self._failed:
                raise ImageUnavailable(self._failed[image])
            try:
                await self.call(lambda: self.client.images.get(image))
                self._ready.add(image)
                return
            except docker.errors.ImageNotFound:
                pass
            try:
                if build is not None:
                    log.info("building image %s from %s", image, build)
                    # forcerm: a failed step's container goes too, not only a built one's.
                    context = str(build)
                    await self.call(lambda: self.client.images.build(path=context, tag=image, forcerm=True))
                else:
                    log.info("pulling image %s", image)
                    await self.call(lambda: self.client.images.pull(image))
            except docker.errors.BuildError as e:
                tail = "".join(str(line.get("stream", line.get("error", ""))) for line in e.build_log)
                absent = [f for f in from_images(build) if not await self._present(f)] if build else []
                why = f" (its FROM image {', '.join(absent)} is neither on the engine nor pullable)"
                self._failed[image] = (
                    f"task {task!r}: building its image {image} from {build}/Dockerfile failed"
                    f"{why if absent else ''}: {tail[-800:].strip()}"
                )
            except docker.errors.DockerException as e:
                how = f"building it from {build}/Dockerfile" if build else "pulling it"
                self._failed[image] = (
                    f"task {task!r}: its image {image} is not on the engine, and {how} failed "
                    f"(a FROM image must be present, or pullable): {e}"
                )
            if image in self._failed:
                raise ImageUnavailable(self._failed[image])
            self._ready.add(image)

    async def _present(self, image: str) -> bool:
        try:
            await self.call(lambda: self.client.images.get(image))
            return True
        except docker.errors.DockerException:
            return False

    def check(self) -> BackendCheck:
        available: dict[str, str] = {}
        missing: dict[str, str] = {}
        try:
            version = self.client.version()
            available["engine"] = f"Docker {version.get('Version')} (API {version.get('ApiVersion')})"
            info = self.client.info()
            runtimes = info.get("Runtimes") or {}
            if self.cfg.runtime and self.cfg.runtime not in runtimes:
                missing["runtime"] = (
                    f"{self.cfg.runtime} is not among the engine's runtimes ({', '.join(runtimes)})"
                )
            if info.get("CgroupVersion"):
                available["cgroups"] = f"cgroup v{info['CgroupVersion']} ({info.get('CgroupDriver')})"
            for key in ("MemoryLimit", "PidsLimit", "CpuCfsQuota"):
                if info.get(key) is False:
                    missing[key] = f"the engine cannot enforce {key} on this kernel"
            if self.cfg.image != "none":
                try:
                    self.client.images.get(self.cfg.image)
                    available["image"] = self.cfg.image
                except docker.errors.ImageNotFound:
                    missing["image"] = (
                        f"{self.cfg.image} is not on the engine (docker pull or docker import it)"
                    )
        except (SandboxUnavailable, docker.errors.DockerException) as e:
            missing["engine"] = (
                f"cannot reach the Docker engine ({e}): is dockerd running, and its socket yours?"
            )
        return BackendCheck(self.name, self.isolation, "cgroup", available, missing)


def from_images(context: Path) -> list[str]:
    """The images the Dockerfile in `context` builds FROM (not its own stages, not scratch)."""
    images, stages = [], {"scratch"}
    for line in (context / "Dockerfile").read_text(errors="replace").splitlines():
        words = [w for w in line.split() if not w.startswith("--")]
        if len(words) >= 2 and words[0].upper() == "FROM":
            if words[1].lower() not in stages:
                images.append(words[1])
            if len(words) >= 4 and words[2].upper() == "AS":
                stages.add(words[3].lower())
    return images


def _cgroup_counters(pid: int) -> Counters | None:
    """The counters of the cgroup that `pid` is in, read on this host (v1 or v2)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    root = Path("/sys/fs/cgroup")
    try:
        if "memory" in paths:  # v1
            memory = root / "memory" / paths["memory"].lstrip("/")
            pids = root / "pids" / paths.get("pids", "/").lstrip("/")
        else:
            memory = pids = root / paths.get("", "/").lstrip("/")
        oom_file = "memory.oom_control" if "memory" in paths else "memory.events"
        return Counters(
            read_counter(memory / oom_file, "oom_kill"), read_counter(pids / "pids.events", "max")
        )
    except (OSError, ValueError):
        return None


class DockerSandbox(container.ContainerSandbox):
    """A sandbox of `DockerBackend`: see the module's doc."""

    def __init__(self, backend: DockerBackend, spec: SandboxSpec, name: str) -> None:
        super().__init__(
            spec,
            name,
            image=spec.image or backend.cfg.image,
            isolation=backend.isolation,
            backend_name=backend.name,
        )
        self.backend = backend
        self._container: Any = None
        self._pid: int | None = None
        self._started = 0.0  # when its container was asked for: the engine's kills since then count
        self._dir: Path | None = None
        self._bridge: bridge.HostBridge | None = None

    @property
    def _relayed(self) -> bool:
        return self._gateway is not None and self.spec.network != "none"

    @property
    def gateway_url(self) -> str | None:
        return self._relay_url if self._relayed else None

    @property
    def _image_user(self) -> bool:
        """A task with its own work dir (Harbor's /app) runs as its image's user, as it was written for:
        its work dir is a fresh volume that Docker fills from the image (what the Dockerfile put
        there), owned as the image has it. Still no capabilities, no new privileges."""
        return self.spec.workdir is not None

    @property
    def _user(self) -> str:
        return "" if self._image_user else f"{container.UID}:{container.UID}"

    def _run_kwargs(self) -> dict[str, Any]:
        cfg, limits = self.backend.cfg, self.spec.limits
        tmpfs = (
            f"rw,exec,nosuid,nodev,size={cfg.tmpfs_size},uid={container.UID},gid={container.UID},mode=0755"
        )
        # Dirs that any user may write (sticky, as /tmp): for an image's own user.
        shared = f"rw,exec,nosuid,nodev,size={cfg.tmpfs_size},mode=1777"
        workdir, *_ = roots = container.sandbox_roots(self.spec)
        mounts: list[docker.types.Mount] = []
        tmpfs_mounts = {root: shared if self._image_user else tmpfs for root in roots}
        if self._image_user:
            del tmpfs_mounts[workdir]
            mounts.append(docker.types.Mount(target=workdir, source=None, type="volume"))
        command = list(container.IDLE)
        volumes: dict[str, dict[str, str]] = {}
        # Host paths seen read-only (the built-in harnesses' modules, a harness install): this
        # engine must share the runner's files (a local engine).
        for bind in self.spec.ro_binds:
            host, inside = (bind, bind) if isinstance(bind, str) else bind
            volumes[host] = {"bind": inside, "mode": "ro"}
        if self._relayed:
            assert self._dir is not None
            volumes[str(self._dir)] = {"bind": INSIDE_RUN, "mode": "ro"}
            relay = [f"{INSIDE_RUN}/bridge.py", str(self._relay_port), f"{INSIDE_RUN}/gw.sock", "--"]
            command = ["python3", "-I", "-S", *relay, *command]
        env = rewrite_gateway(self.spec.env, self.spec.gateway_url, self.gateway_url)
        kwargs: dict[str, Any] = {
            "image": self.spec.image or cfg.image,
            "command": command,
            "name": f"openforge-{self.name}",
            "detach": True,
            "user": self._user or None,
            "working_dir": workdir,
            "environment": container.base_env(env, self.gateway_url),
            "network_mode": "bridge" if self.spec.network == "host" else "none",
            "init": True,
            "read_only": True,
            "tmpfs": tmpfs_mounts,
            "mounts": mounts,
            "volumes": volumes,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "labels": {
                **cfg.labels,
                MANAGED_BY: "openforgerl",
                RUN: cfg.run_id,
                SANDBOX: self.name,
                RUNNER: _host_id(),
            },
        }
        if limits.memory_bytes is not None:
            kwargs["mem_limit"] = limits.memory_bytes
            kwargs["memswap_limit"] = limits.memory_bytes  # no swap: a hog must not outlive its limit
        if limits.cpus is not None:
            kwargs["nano_cpus"] = int(limits.cpus * 1e9)
        if limits.pids is not None:
            kwargs["pids_limit"] = limits.pids
        if cfg.runtime:
            kwargs["runtime"] = cfg.runtime
        return kwargs

    async def _provision(self) -> None:
        client = self.backend.client
        image = self.spec.image or self.backend.cfg.image
        await self.backend.ensure_image(image, self.spec.build, self.spec.labels.get("task", self.name))
        if self._relayed:
            assert self._gateway is not None and self._gateway.hostname
            self._dir = Path(tempfile.mkdtemp(prefix=f"openforgerl-{self.name}-"))
            shutil.copyfile(bridge.__file__, self._dir / "bridge.py")
            self._bridge = bridge.HostBridge(
                str(self._dir / "gw.sock"), self._gateway.hostname, self._gateway_port
            )
            await self._bridge.start()
            # The container's uid is not ours: it must be let through to the socket.
            self._dir.chmod(0o755)
            (self._dir / "gw.sock").chmod(0o666)
        kwargs = self._run_kwargs()
        self._started = time.time()
        try:
            self._container = await self.backend.call(lambda: client.containers.run(**kwargs))
        except docker.errors.ImageNotFound as e:  # removed since ensure_image saw it
            raise SandboxStartError(f"image {image} is not on the engine: {e}") from e
        except docker.errors.APIError as e:
            if e.is_server_error() or e.status_code == 409:
                raise SandboxStartError(f"sandbox {self.name}: the engine failed: {e}") from e
            raise SandboxUnavailable(f"sandbox {self.name}: the engine refused: {e}") from e
        await self.backend.call(self._container.reload)
        if self._container.status != "running":
            logs = await self.backend.call(lambda: self._container.logs(tail=20))
            raise ImageUnavailable(
                f"task {self.spec.labels.get('task', self.name)!r}: its container of {image} exited at "
                f"once (python3 in the image is needed to reach the gateway): {logs.decode(errors='replace')}"
            )
        self._pid = int(self._container.attrs["State"]["Pid"])

    async def _teardown(self) -> None:
        try:
            if self._container is not None:
                ctr = self._container
                with contextlib.suppress(docker.errors.NotFound):
                    await self.backend.call(lambda: ctr.remove(force=True, v=True))
        except docker.errors.APIError as e:
            raise SandboxError(f"container of sandbox {self.name} left behind: {e}") from e
        finally:
            if self._bridge is not None:
                self._bridge.close()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)

    def _exec_blocking(self, argv: Sequence[str], stdin: container.Stdin | None, output: Output) -> int:
        api = self.backend.client.api
        exec_id = api.exec_create(self._container.id, list(argv), stdin=stdin is not None, user=self._user)[
            "Id"
        ]
        sock = api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        try:
            if stdin is not None:
                for chunk in container.stdin_chunks(stdin):
                    raw.sendall(chunk)
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_WR)
            for stream, data in frames_iter(sock, tty=False):
                (output.stdout if stream == 1 else output.stderr).feed(data)
        finally:
            sock.close()
        code = api.exec_inspect(exec_id)["ExitCode"]
        if code is None:
            raise SandboxStartError(f"sandbox {self.name}: the command's stream ended before it did")
        return int(code)

    async def _stream(
        self, argv: Sequence[str], stdin: container.Stdin | None, output: Output, wait_s: float | None
    ) -> int:
        """Docker's exec; what breaks the stream fails the sandbox (SandboxStartError), never StreamLost."""
        try:
            return await asyncio.wait_for(
                self.backend.call(lambda: self._exec_blocking(argv, stdin, output)), wait_s
            )
        except docker.errors.NotFound as e:
            raise SandboxStartError(f"sandbox {self.name}: its container is gone") from e
        except docker.errors.APIError as e:
            if e.status_code == 409:  # the container is not running
                raise SandboxStartError(f"sandbox {self.name}: {e.explanation}") from e
            raise
        except TimeoutError as e:
            raise SandboxStartError(f"sandbox {self.name}: no answer {wait_s:.0f} s into the command") from e

    def _counters(self) -> Counters | None:
        return _cgroup_counters(self._pid) if self._pid else None

    async def _blame(
        self, code: int, lost: container.StreamLost | None, before: Counters | None
    ) -> str | None:
        """A limit the rollout hit (its memory, its pids): a result. The container killed from outside
        under the command: SandboxStartError, retried (the reward's contract)."""
        hit = before.limit_hit(_cgroup_counters(self._pid)) if before is not None and self._pid else None
        if hit is None and code == 128 + 9:
            why = await self.backend.call(self._killed_outside)
            if why:
                raise SandboxStartError(f"sandbox {self.name}: {why} under the command")
        return hit

    def _killed_outside(self) -> str | None:
        """Why the container died, where the engine was told to kill it (docker kill, stop, rm -f) or
        it is gone. The agent can end its container too (`kill -9 -1` takes the idle process), but
        the engine then records no kill: that is the agent's doing, and scored."""
        try:
            self._container.reload()
        except docker.errors.NotFound:
            return "its container was removed"
        # Not its state: the command's end may be seen before the container's.
        kills = self.backend.client.events(
            since=self._started,
            until=time.time(),
            filters={"container": self._container.id, "event": "kill"},
            decode=True,
        )
        for event in kills:
            signal = event.get("Actor", {}).get("Attributes", {}).get("signal", "?")
            return f"its container was killed from outside (the engine's kill, signal {signal})"
        return None


def _runner_alive(runner: str) -> bool:
    host, _, pid = runner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another host's runner: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_garbage(
    *, run: str | None = None, dry_run: bool = False, base_url: str | None = None
) -> list[container.Garbage]:
    """Removes the containers of `run`, or those whose runner on this host is no longer alive."""
    try:
        client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
    except docker.errors.DockerException as e:
        raise SandboxUnavailable(f"no Docker engine: {e}") from e
    found = []
    for ctr in client.containers.list(all=True, filters={"label": f"{MANAGED_BY}=openforgerl"}):
        labels = ctr.labels
        if (labels.get(RUN) == run) if run else not _runner_alive(labels.get(RUNNER, "")):
            found.append(container.Garbage("container", ctr.name, labels.get(RUN, "")))
            if not dry_run:
                with contextlib.suppress(docker.errors.NotFound):
                    ctr.remove(force=True)
    return found
