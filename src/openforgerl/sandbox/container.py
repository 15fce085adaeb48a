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
"""

from __future__ import annotations

import io
import math
import os
import posixpath
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from openforgerl.sandbox.base import ExecResult
from openforgerl.sandbox.local import _Capture

WORKDIR = "/workspace"
HOME = "/home/sandbox"
TMP = "/tmp"
ROOTS = (WORKDIR, HOME, TMP)
UID = 1000
OUTPUT_LIMIT = 1 << 20
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


def resolve(path: str) -> str:
    """The absolute path inside for `path`, which must lie in the work dir, HOME or /tmp."""
    full = posixpath.normpath(posixpath.join(WORKDIR, path))
    if not any(full == root or full.startswith(root + "/") for root in ROOTS):
        raise ValueError(f"{path!r} is outside the sandbox's work dir, HOME and /tmp")
    return full


def extract_argv(dest: str) -> list[str]:
    """Unpacks a tar stream on stdin into `dest` (made first, and left out of the stream: a directory
    entry for it would make tar chmod a mount point it does not own)."""
    return ["sh", "-c", 'mkdir -p -- "$1" && exec tar -xf - -C "$1"', "sh", dest]


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


def tar_files(files: Mapping[str, bytes | str]) -> dict[str, bytes]:
    """The spec's files as one tar stream per root (work dir, HOME, /tmp), each relative to its root."""
    by_root: dict[str, tarfile.TarFile] = {}
    buffers: dict[str, io.BytesIO] = {}
    for path, content in files.items():
        full = resolve(path)
        root = next(r for r in ROOTS if full == r or full.startswith(r + "/"))
        if root not in by_root:
            buffers[root] = io.BytesIO()
            by_root[root] = tarfile.open(fileobj=buffers[root], mode="w", format=tarfile.GNU_FORMAT)
        data = content.encode() if isinstance(content, str) else content
        by_root[root].addfile(_tarinfo(full[len(root) + 1 :], len(data), 0o644), io.BytesIO(data))
    for tar in by_root.values():
        tar.close()
    return {root: buf.getvalue() for root, buf in buffers.items()}


def tar_dir(src: str | Path) -> bytes:
    """A host directory's contents (symlinks kept as links), relative to it."""
    src = Path(src)
    if not src.is_dir():
        raise NotADirectoryError(f"{src} is not a directory")
    buf = io.BytesIO()
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
    return buf.getvalue()


def rewrite_gateway(env: Mapping[str, str], outside: str | None, inside: str | None) -> dict[str, str]:
    """Env values that name the gateway as the host reaches it, rewritten to how the sandbox does."""
    if not outside or not inside:
        return dict(env)
    out, ins = urlsplit(outside), urlsplit(inside)
    old, new = f"{out.scheme}://{out.netloc}", f"{ins.scheme}://{ins.netloc}"
    return {k: v.replace(old, new) for k, v in env.items()}


def base_env(spec_env: Mapping[str, str], gateway_url: str | None) -> dict[str, str]:
    """The environment every command in a container sandbox starts from (never the runner's own)."""
    env = {"HOME": HOME, "USER": "sandbox", "LOGNAME": "sandbox", "TMPDIR": TMP, "LANG": "C.UTF-8"}
    if gateway_url:
        env["OPENFORGE_GATEWAY_URL"] = gateway_url
    return env | dict(spec_env)


class Output:
    """A command's stdout and stderr as they stream in, each capped like the local sandbox's."""

    def __init__(self, limit: int = OUTPUT_LIMIT) -> None:
        self.stdout = _Capture(limit)
        self.stderr = _Capture(limit)

    def stdout_bytes(self) -> bytes:
        """All of stdout, for file reads (their limit is set high enough that nothing is cut)."""
        if self.stdout.total > len(self.stdout.head) + len(self.stdout.tail):
            raise OSError(f"file larger than {FILE_LIMIT} bytes")
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
