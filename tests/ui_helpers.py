"""The browser tests' kit: Debian's Chromium, the viewer in a thread, screenshots kept as artifacts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

from openforgerl.testing.gateway import free_port
from openforgerl.ui import ViewerConfig, build_app

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "ui"

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def serve_viewer(config: ViewerConfig) -> Iterator[str]:
    """The viewer on a free loopback port in a thread, for the browser tests."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(config), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the viewer did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def shot(page: Any, name: str, **kw: Any) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), **kw)
