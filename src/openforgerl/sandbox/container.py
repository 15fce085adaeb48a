"""What the container backends (Docker, Kubernetes) share: the layout inside, and commands run through an
exec API by one small POSIX shell wrapper.

An exec API runs a process in the container and streams its output, but kills nothing when the caller
gives up, and (over Kubernetes' v4 WebSocket protocol) cannot even close the command's stdin. The wrapper
(`wrap`) fills both gaps inside the container, with only `sh`, `head`, `setsid` and `sleep`:

- the command runs in a session of its own, so that its whole process group can be killed;
- a watchdog kills that group at the exec's wall time (exit 137, reported as "wall-time");
- what the command left running in its group is killed when it ends, like the local sandbox does;
- stdin is a counted number of bytes (`head -c N`), so the command sees its end without a close.

Files travel as tar streams through the same wrapper (`tar` in the image), as `kubectl cp` does.

`ContainerSandbox` is what both backends' sandboxes inherit: the layout, the probe and the spec's files
at start, exec, the file moves and how a command ended; a backend adds its exec API (`_stream`), what
builds and removes its container (`_provision`, `_teardown`) and whom it blames for a kill (`_blame`).
"""

from __future__ import annotations

import abc
import asyncio
import io
import math
import os
import posixpath
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from openforgerl.sandbox import base

# The labels (Kubernetes: labels and annotations) on what a container backend makes.
MANAGED_BY = "app.kubernetes.io/managed-by"
RUN = "openforgerl.dev/run"
SANDBOX = "openforgerl.dev/sandbox"

WORKDIR = "/workspace"
HOME = "/home/sandbox"
TMP = "/tmp"
ROOTS = (WORKDIR, HOME, TMP)
UID = 1000
FILE_LIMIT = 256 << 20  # get_file: the largest file read back
# Wall time past the exec's own limit after which the caller stops waiting for the wrapper's answer.
GRACE_S = 30.0
# The tools every image needs (a Debian, Ubuntu or Alpine/busybox base has them all).
TOOLS = ("sh", "head", "setsid", "sleep", "tar", "cat", "mkdir")
# Prints the tools that are missing; run without the wrapper, which needs them.
PROBE = ["sh", "-c", 'for t do command -v "$t" >/dev/null || echo "$t"; done', "sh", *TOOLS]
# The main process of a sandbox: nothing but a placeholder that the execs join.
IDLE = ["sh", "-c", "while sleep 3600; do :; done"]

# $1: seconds until the command's group is killed (0: never); $2: bytes of stdin; $3: the directory;
# then the argv. fd 3 carries stdin past the shell's rule that a background job reads /dev/null; fd 4 is
# the command's stderr, kept apart from the shell's own notes ("Killed").
_WRAPPER = r"""t=$1 n=$2 d=$3
shift 3
cd "$d" || exit 125
exec 4>&2 2>/dev/null
if [ "$n" -gt 0 ]; then
  exec 3<&0
  head -c "$n" <&3 | setsid "$@" 3<&- 2>&4 4>&- &
else
  setsid "$@" </dev/null 2>&4 4>&- &
fi
pid=$!
dog=
if [ "$t" -gt 0 ]; then
  (trap 'kill $s 2>/dev/null; exit 0' TERM; sleep "$t" & s=$!; wait $s; kill -KILL -"$pid") \
    </dev/null >/dev/null 2>&1 &
  dog=$!
fi
wait "$pid"
rc=$?
[ -z "$dog" ] || kill "$dog" 2>/dev/null
kill -KILL -"$pid" 2>/dev/null
exit $rc
"""


def wrap(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str] | None = None,
    limit_s: float | None = None,
    stdin_len: int = 0,
) -> list[str]:
    """The argv that runs `argv` under the wrapper (env through `env`, as exec APIs differ on it)."""
    seconds = math.ceil(limit_s) if limit_s else 0
    command = [*(["env", *(f"{k}={v}" for k, v in env.items())] if env else []), *argv]
    return ["sh", "-c", _WRAPPER, "sh", str(seconds), str(stdin_len), cwd, *command]


def resolve(path: str, workdir: str = WORKDIR, roots: Sequence[str] = ROOTS) -> str:
    """The absolute path inside for `path` (relative to `workdir`), which must lie in one of `roots`
    (the work dir, HOME, /tmp and a spec's extra dirs)."""
    full = posixpath.normpath(posixpath.join(workdir, path))
    if not any(full == root or full.startswith(root + "/") for root in roots):
        raise ValueError(f"{path!r} is outside the sandbox's work dir, HOME, /tmp and its extra dirs")
    return full


def sandbox_roots(spec: base.SandboxSpec) -> tuple[str, ...]:
    """The dirs of a container sandbox that files can be put into: its work dir (the spec's, or
    /workspace), HOME, /tmp and the spec's extra dirs."""
    workdir = posixpath.normpath(spec.workdir) if spec.workdir else WORKDIR
    return (workdir, HOME, TMP, *(posixpath.normpath(d) for d in spec.extra_dirs))


def extract_argv(dest: str) -> list[str]:
    """Unpacks a tar stream on stdin into `dest` (made first, and left out of the stream: a directory
    entry for it would make tar chmod a mount point it does not own). -o: the files become the
    extracting user's (an image's root has no capability to give them away), modes as in the stream."""
    return ["sh", "-c", 'mkdir -p -- "$1" && exec tar -xof - -C "$1"', "sh", dest]


# Reads a regular file, or says why not: 2 no such file, 3 not a regular file.
READ_ARGV = ["sh", "-c", 'if [ -f "$1" ]; then exec cat -- "$1"; elif [ -e "$1" ]; then exit 3; fi; exit 2']


def _tarinfo(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid = size, mode, UID, UID
    info.mtime = int(time.time())
    return info


def tar_file(name: str, data: bytes, mode: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(_tarinfo(name, len(data), mode), io.BytesIO(data))
    return buf.getvalue()


def tar_files(files: Mapping[str, bytes | str], roots: Sequence[str] = ROOTS) -> dict[str, bytes]:
    """The spec's files as one tar stream per root (`roots[0]` the work dir), each relative to its root."""
    by_root: dict[str, tarfile.TarFile] = {}
    buffers: dict[str, io.BytesIO] = {}
    for path, content in files.items():
        full = resolve(path, roots[0], roots)
        # The innermost root that holds it (an extra dir may lie below another root).
        root = max((r for r in roots if full == r or full.startswith(r + "/")), key=len)
        if root not in by_root:
            buffers[root] = io.BytesIO()
            by_root[root] = tarfile.open(fileobj=buffers[root], mode="w", format=tarfile.GNU_FORMAT)
        data = content.encode() if isinstance(content, str) else content
        by_root[root].addfile(_tarinfo(full[len(root) + 1 :], len(data), 0o644), io.BytesIO(data))
    for tar in by_root.values():
        tar.close()
    return {root: buf.getvalue() for root, buf in buffers.items()}


# A command's stdin: bytes, or a file (a tar spooled to disk) read from its start to its end in chunks,
# so that a large workspace never sits in memory whole.
Stdin = bytes | BinaryIO
CHUNK = 1 << 20


def stdin_size(stdin: Stdin | None) -> int:
    if stdin is None:
        return 0
    if isinstance(stdin, bytes):
        return len(stdin)
    return os.fstat(stdin.fileno()).st_size


def stdin_chunks(stdin: Stdin, size: int = CHUNK) -> Iterator[bytes]:
    """`stdin` in chunks of at most `size` bytes."""
    if isinstance(stdin, bytes):
        yield from (stdin[i : i + size] for i in range(0, len(stdin), size))
        return
    stdin.seek(0)
    yield from iter(lambda: stdin.read(size), b"")


def tar_dir(src: str | Path, out: BinaryIO | None = None) -> BinaryIO:
    """A host directory's contents (bytes, modes, symlinks kept as links), relative to it, as a tar
    written to `out` (default: a new temp file, on disk beyond a few MiB), which is returned."""
    src = Path(src)
    if not src.is_dir():
        raise NotADirectoryError(f"{src} is not a directory")
    buf: BinaryIO = out if out is not None else tempfile.TemporaryFile()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(src):
            for name in sorted([*dirnames, *filenames]):
                host = Path(dirpath, name)
                info = tar.gettarinfo(str(host), arcname=host.relative_to(src).as_posix())
                info.uid = info.gid = UID
                info.uname = info.gname = ""
                if info.isfile():
                    with host.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    buf.flush()
    return buf


def base_env(spec_env: Mapping[str, str], gateway_url: str | None) -> dict[str, str]:
    """The environment every command in a container sandbox starts from (never the runner's own)."""
    env = {"HOME": HOME, "USER": "sandbox", "LOGNAME": "sandbox", "TMPDIR": TMP, "LANG": "C.UTF-8"}
    if gateway_url:
        env["OPENFORGE_GATEWAY_URL"] = gateway_url
    return env | dict(spec_env)


@dataclass(frozen=True, slots=True)
class Garbage:
    """Something `openforge gc` removed (or would): a pod, a configmap, a container."""

    kind: str
    name: str
    run: str


def ended_by(code: int, elapsed: float, limit_s: float | None, stopping: bool) -> str | None:
    """What ended a command by SIGKILL that the sandbox itself killed, as far as the exit code tells:
    the wrapper's watchdog ("wall-time") or a stop. None leaves the question to the backend."""
    if code != 128 + 9:
        return None
    if limit_s and elapsed >= math.ceil(limit_s) - 0.5:
        return "wall-time"
    return "stopped" if stopping else None


def signal_of(code: int) -> str | None:
    """The wrapper's shell reports death by signal N as 128 + N."""
    return f"signal {code - 128}" if 128 < code <= 128 + 64 else None


class StreamLost(Exception):
    """An exec's stream ended without the command's exit status."""


class ContainerSandbox(base.Sandbox):
    """A sandbox whose commands and files go through an exec API under `wrap`: the work dir, HOME and
    /tmp of the layout above; the spec's files (and a probe for the tools) once it runs; commands,
    file moves and their outcomes. A backend supplies `_stream` (one argv through its exec API) and may
    blame what killed a command (`_counters` before it, `_blame` after)."""

    def __init__(
        self, spec: base.SandboxSpec, name: str, *, image: str, isolation: str, backend_name: str
    ) -> None:
        super().__init__(spec, name)
        self._image = image
        self._isolation = isolation
        self._backend_name = backend_name

    @property
    def workdir(self) -> str:
        return self._roots[0]

    @property
    def _roots(self) -> tuple[str, ...]:
        return sandbox_roots(self.spec)

    def _resolve(self, path: str) -> str:
        return resolve(path, self.workdir, self._roots)

    @property
    def tmpdir(self) -> str:
        return TMP

    @property
    def info(self) -> base.SandboxInfo:
        return base.SandboxInfo(self.name, self._backend_name, self._isolation, "cgroup", self.spec.network)

    @abc.abstractmethod
    async def _stream(
        self, argv: Sequence[str], stdin: Stdin | None, output: base.Output, wait_s: float | None
    ) -> int:
        """Runs argv (not wrapped) through the exec API, its output into `output`, and returns its exit
        code; raises StreamLost when no exit status came back, or gives up after `wait_s`."""

    def _counters(self) -> base.Counters | None:
        """The container's cgroup counters before a command, where this host can read them."""
        return None

    async def _blame(self, code: int, lost: StreamLost | None, before: base.Counters | None) -> str | None:
        """What killed a failed command that the wrapper did not (`lost`: its stream broke instead)."""
        return None

    async def _raw(
        self, argv: Sequence[str], stdin: Stdin | None, output: base.Output, wait_s: float | None
    ) -> int:
        """`_stream`, with a lost stream an infrastructure failure."""
        try:
            return await self._stream(argv, stdin, output, wait_s)
        except StreamLost as e:
            raise base.SandboxStartError(f"sandbox {self.name}: {e}") from e

    async def _run(
        self, argv: Sequence[str], stdin: Stdin | None, output: base.Output, limit_s: float | None
    ) -> int:
        """argv under the wrapper in the work dir, for at most `limit_s`."""
        wrapped = wrap(argv, cwd=self.workdir, limit_s=limit_s, stdin_len=stdin_size(stdin))
        return await self._raw(wrapped, stdin, output, limit_s + GRACE_S if limit_s else None)

    async def _transfer(self, argv: Sequence[str], data: Stdin) -> None:
        output = base.Output()
        code = await self._run(argv, data, output, None)
        if code != 0:
            err = output.stderr.text()[0].strip()
            raise base.SandboxError(f"sandbox {self.name}: copying in failed ({code}): {err[-500:]}")

    async def _ready(self) -> None:
        output = base.Output()
        code = await self._raw(PROBE, None, output, None)
        if code != 0 or output.stdout.total:
            missing = output.stdout_bytes().decode(errors="replace").split()
            task = self.spec.labels.get("task", self.name)
            raise base.ImageUnavailable(
                f"task {task!r}: its image {self._image} lacks {', '.join(missing) or 'a POSIX shell'}: "
                f"a container sandbox needs {', '.join(TOOLS)}"
            )
        await self._put_workspace()
        for root, data in tar_files(self.spec.files, self._roots).items():
            await self._transfer(extract_argv(root), data)

    async def _exec(
        self, argv: list[str], *, env: Mapping[str, str], cwd: str, limit_s: float | None, stdin: bytes | None
    ) -> base.ExecResult:
        extra = base.rewrite_gateway(env, self.spec.gateway_url, self.gateway_url)
        wrapped = wrap(argv, cwd=cwd, env=extra, limit_s=limit_s, stdin_len=len(stdin or b""))
        output = base.Output()
        before = self._counters()
        started = time.monotonic()
        lost: StreamLost | None = None
        try:
            code = await self._stream(
                wrapped, stdin, output, limit_s + GRACE_S if limit_s is not None else None
            )
        except StreamLost as e:
            code, lost = 128 + 9, e  # as good as killed: the backend says by whom, below
        elapsed = time.monotonic() - started
        killed_by = ended_by(code, elapsed, limit_s, self._state is not base.State.RUNNING)
        if killed_by is None and code != 0:
            killed_by = await self._blame(code, lost, before)
        killed_by = killed_by or signal_of(code)
        return output.result(code, killed_by=killed_by, started=started, ended=time.monotonic())

    async def _put_file(self, path: str, data: bytes, mode: int) -> None:
        parent, _, leaf = self._resolve(path).rpartition("/")
        await self._transfer(extract_argv(parent or "/"), tar_file(leaf, data, mode))

    async def _put_dir(self, src: Path, dest: str) -> None:
        with await asyncio.to_thread(tar_dir, src) as archive:
            await self._transfer(extract_argv(self._resolve(dest)), archive)

    async def _get_file(self, path: str) -> bytes:
        full = self._resolve(path)
        output = base.Output(FILE_LIMIT)
        code = await self._run([*READ_ARGV, "sh", full], None, output, 600)
        if code == 2:
            raise FileNotFoundError(f"no file {full} in sandbox {self.name}")
        if code != 0:
            raise OSError(f"{full} in sandbox {self.name} is not a regular file ({code})")
        return output.stdout_bytes()
