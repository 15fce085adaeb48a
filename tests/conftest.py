"""Fixtures shared across test files. Fixtures only one file needs belong in that file."""

from __future__ import annotations

from pathlib import Path

import pytest

from openforgerl.modelkit import cached_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The kit's tiny Qwen2 model; built once per machine and kit version, then reused from the cache."""
    return cached_model("tiny", 0)


@pytest.fixture(scope="session")
def tiny_vlm_dir() -> Path:
    """The kit's tiny Qwen2-VL (read-only: tests that write use tests.vlm_helpers.tiny_vlm)."""
    return cached_model("tiny", 0, vision=True)
