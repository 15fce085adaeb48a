"""The gateway's CPU work off the event loop.

Parsing and validating a body, decoding its images, rendering the chat template and tokenising
are the costly steps of a call before the engine: done on the event loop, one 10 MB prompt kept
every other client (and `/health`) waiting for seconds. They run here instead, on a few threads:
the heavy C parts (tokenizers, image decoding, JSON) release or share the GIL, and the loop gets its
turn at every switch interval, so it keeps answering while one request is heavy.

Bounded twice: `threads` work at once and at most `queue` more wait; a call beyond that waits on
the loop (cheaply, without holding a thread) for its turn. `threads=0` does the work on the event
loop itself: the old behaviour, kept for side-by-side measurement (benchmarks/hostile.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

_T = TypeVar("_T")

# After a body this large, or work this long, freed memory is handed back to the OS (`trim_memory_later`).
TRIM_AFTER_BYTES = 1 << 20
HEAVY_S = 0.25


class Workers:
    def __init__(self, threads: int = 2, queue: int = 64) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gateway-work") if threads else None
        self.slots = asyncio.Semaphore(threads + queue)

    async def run(self, fn: Callable[..., _T], /, *args: Any) -> _T:
        """`fn(*args)` on a worker thread, with the caller's context variables."""
        if self.pool is None:
            return contextvars.copy_context().run(fn, *args)
        async with self.slots:
            call = functools.partial(contextvars.copy_context().run, fn, *args)
            started = time.monotonic()
            try:
                return await asyncio.get_running_loop().run_in_executor(self.pool, call)
            finally:
                if time.monotonic() - started > HEAVY_S:
                    trim_memory_later()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


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
