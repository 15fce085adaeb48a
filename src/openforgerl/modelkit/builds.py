"""Models built once per machine under a cache directory, safely from parallel processes."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """`$OPENFORGE_CACHE`, or ~/.cache/openforgerl."""
    env = os.environ.get("OPENFORGE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "openforgerl"


def build_once(final: Path, build: Callable[[Path], Any]) -> Path:
    """`final`, made by `build(scratch)` on first use.

    A lock file serialises builders across processes; the build goes to a scratch directory that is
    renamed into place, so readers never see a half-written model.
    """
    if final.is_dir():  # only ever created by an atomic rename of a finished build
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if final.is_dir():  # another process built it while we waited
                return final
            scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
            try:
                build(scratch)
                # mkdtemp makes 0700; sandboxed workers under other uids must be able to read the model.
                scratch.chmod(0o755)
                for file in scratch.iterdir():
                    file.chmod(0o644)
                scratch.rename(final)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final
