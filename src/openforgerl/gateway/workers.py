"""The gateway's CPU work off the event loop.

Parsing and validating a body, decoding its images, rendering the chat template and tokenising
are the costly steps of a call before the engine: done on the event loop, one 10 MB prompt kept
every other client (and `/health`) waiting for seconds. They run here instead, on a few threads:
the heavy C parts (tokenizers, image decoding, JSON) release or share the GIL, and the loop gets its
turn at every switch interval, so it keeps answering while one request is heavy.

Shared fairly between rollouts: each job names its rollout (its `share`). Two heavy count_tokens
calls from one rollout held both threads and kept another rollout's 2-token call waiting 40 s, so
no share holds more than `threads - 1` threads at once (one is always left for the others), and a
freed thread goes to the waiting share with the fewest jobs running, the longest unserved among
equals. Jobs wait on the loop (cheaply, without holding a thread) for their turn. `threads=0` does
the work on the event loop itself: the old behaviour, kept for side-by-side measurement
(benchmarks/hostile.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")

# After a body this large, or work this long, freed memory is handed back to the OS (`trim_memory_later`).
TRIM_AFTER_BYTES = 1 << 20
HEAVY_S = 0.25


class Workers:
    def __init__(self, threads: int = 2) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-work") if threads else None
        self.threads = threads
        self.per_share = max(1, threads - 1)
        self.busy = 0
        self.running: dict[str, int] = {}  # jobs on a thread, by share
        self.waiting: dict[str, deque[asyncio.Future[None]]] = {}  # jobs waiting for one, by share
        self.served: dict[str, int] = {}  # the turn a share's latest job started on (its place in line)
        self.turns = 0

    async def run(self, fn: Callable[..., _T], /, *args: Any, share: str = "") -> _T:
        """`fn(*args)` on a worker thread, with the caller's context variables, in `share`'s turn
        (a rollout's id)."""
        if self.pool is None:
            return contextvars.copy_context().run(fn, *args)
        loop = asyncio.get_running_loop()
        await self._turn(share, loop)
        try:
            job = self.pool.submit(_timed, contextvars.copy_context().run, fn, *args)
        except BaseException:
            self._leave(share)
            raise
        # The thread is the share's until the job ends, even if its caller stops waiting for it.
        job.add_done_callback(lambda _: _on_loop(loop, self._leave, share))
        return await asyncio.wrap_future(job, loop=loop)

    async def _turn(self, share: str, loop: asyncio.AbstractEventLoop) -> None:
        turn: asyncio.Future[None] = loop.create_future()
        self.waiting.setdefault(share, deque()).append(turn)
        self._dispatch()
        try:
            await turn
        except asyncio.CancelledError:
            if not turn.cancelled():  # its thread was given as it was cancelled: pass it on
                self._leave(share)
            elif turn in (line := self.waiting.get(share, deque())):
                line.remove(turn)
                if not line:
                    del self.waiting[share]
                    self._forget(share)
            raise

    def _leave(self, share: str) -> None:
        self.busy -= 1
        self.running[share] -= 1
        if not self.running[share]:
            del self.running[share]
            self._forget(share)
        self._dispatch()

    def _forget(self, share: str) -> None:
        """An idle share's place in line (a rollout that has ended leaves nothing behind)."""
        if share not in self.running and share not in self.waiting:
            self.served.pop(share, None)

    def _dispatch(self) -> None:
        """Give free threads to waiting jobs, fairly between shares."""
        while self.busy < self.threads:
            ready = [s for s in self.waiting if self.running.get(s, 0) < self.per_share]
            if not ready:
                return
            share = min(ready, key=lambda s: (self.running.get(s, 0), self.served.get(s, 0)))
            line = self.waiting[share]
            turn = line.popleft()
            if not line:
                del self.waiting[share]
            if turn.done():  # cancelled while it waited
                self._forget(share)
                continue
            self.busy += 1
            self.running[share] = self.running.get(share, 0) + 1
            self.turns += 1
            self.served[share] = self.turns
            turn.set_result(None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _timed(fn: Callable[..., _T], *args: Any) -> _T:
    started = time.monotonic()
    try:
        return fn(*args)
    finally:
        if time.monotonic() - started > HEAVY_S:
            trim_memory_later()


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[str], None], arg: str) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
        loop.call_soon_threadsafe(fn, arg)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    # The process's own symbols: glibc's malloc_trim where it is (find_library would run ldconfig).
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


class _Trimmer:
    """Calls malloc_trim once no heavy work has happened for `delay` seconds (a trailing debounce:
    a burst of large requests trims once, after its last)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.due = 0.0
        self.thread: threading.Thread | None = None

    def later(self, delay: float) -> None:
        trim = _malloc_trim()
        if trim is None:
            return
        with self.lock:
            self.due = time.monotonic() + delay
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, args=(trim,), name="malloc-trim", daemon=True
                )
                self.thread.start()

    def _run(self, trim: Callable[[int], int]) -> None:
        while True:
            with self.lock:
                wait = self.due - time.monotonic()
                if wait <= 0:
                    self.thread = None
                    break
            time.sleep(wait)
        trim(0)


_trimmer = _Trimmer()


def trim_memory_later(delay_s: float = 1.0) -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim) once heavy work has stopped.

    Tokenising a long prompt allocates hundreds of megabytes (token strings, offsets, id lists) that
    glibc keeps after they are freed: measured, three 8 MB prompts left the gateway at 1.3 GB (from
    0.36 GB) for good. A trim after the work returns it.
    """
    _trimmer.later(delay_s)
