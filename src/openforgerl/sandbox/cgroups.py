"""The local backend's limits: a cgroup v1 per sandbox (memory, cpu, pids) that every exec joins
before it starts (`JOIN_CGROUPS`), read back for its counters, which also tell OOM kills and
pids-limit hits apart."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from openforgerl.sandbox.base import (
    Counters,
    Limits,
    read_counter,
)

CONTROLLERS = ("memory", "cpu", "pids")
CGROUP_PARENT = "openforgerl"
_CPU_PERIOD_US = 100_000
_POLL_S = 0.05
# Joins the cgroups named before "--", then execs the rest: Python's subprocess has no cgroup option,
# and preexec_fn is unsafe in a threaded runner.
JOIN_CGROUPS = 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'


class Cgroup:
    """One sandbox's cgroups (memory, cpu, pids) under <root>/<controller>/openforgerl/<name>."""

    def __init__(self) -> None:
        self.dirs: dict[str, Path] = {}

    @classmethod
    def create(cls, root: Path, name: str, limits: Limits) -> Cgroup:
        cg = cls()
        try:
            for c in CONTROLLERS:
                d = root / c / CGROUP_PARENT / name
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
