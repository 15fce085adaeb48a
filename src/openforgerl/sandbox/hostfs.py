"""What the runner writes into and reads out of a local sandbox's dirs on the host: every path
opened beneath the sandbox's root one component at a time, never following a link (the agent owns
what is in there), and owned by the sandbox's uid."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY

# Who owns what the runner writes into a sandbox: (uid, gid) on the host, or None to leave it the
# runner's (which is then the sandbox's own uid).
Owner = tuple[int, int] | None


def dir_beneath(root: Path, parts: Sequence[str], create: bool, owner: Owner = None) -> int:
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


def open_beneath(root: Path, rel: PurePosixPath, flags: int, mode: int = 0o644, owner: Owner = None) -> int:
    if not rel.parts:
        raise IsADirectoryError(f"{root} is a directory")
    parent = dir_beneath(root, rel.parts[:-1], create=bool(flags & os.O_CREAT), owner=owner)
    try:
        # O_NONBLOCK: a FIFO planted in place of a file must not hang the runner.
        fd = os.open(rel.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent)
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{rel} is not a regular file")
    return fd


def write_beneath(root: Path, rel: PurePosixPath, data: bytes, mode: int, owner: Owner = None) -> None:
    fd = open_beneath(root, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode, owner)
    with open(fd, "wb") as f:
        f.write(data)
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)


def read_beneath(root: Path, rel: PurePosixPath) -> bytes:
    with open(open_beneath(root, rel, os.O_RDONLY), "rb") as f:
        return f.read()


def copy_tree_beneath(src: Path, root: Path, rel: PurePosixPath, owner: Owner = None) -> None:
    if not src.is_dir():
        raise NotADirectoryError(f"{src} is not a directory")
    os.close(dir_beneath(root, rel.parts, create=True, owner=owner))
    for dirpath, dirnames, filenames in os.walk(src):
        sub = rel / Path(dirpath).relative_to(src).as_posix()
        parent = dir_beneath(root, sub.parts, create=True, owner=owner)
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
                    fd = open_beneath(root, sub / name, flags, owner=owner)
                    with open(fd, "wb") as out, host.open("rb") as inp:
                        shutil.copyfileobj(inp, out)
                        if owner is not None:
                            os.fchown(fd, *owner)
                        os.fchmod(fd, stat.S_IMODE(host.stat().st_mode))
        finally:
            os.close(parent)


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        # The sandbox may have left dirs that its uid (the runner's own, when not root) cannot enter.
        for dirpath, dirnames, _ in os.walk(path):
            for d in dirnames:
                p = os.path.join(dirpath, d)
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
        shutil.rmtree(path)
