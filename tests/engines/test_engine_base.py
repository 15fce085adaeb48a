"""EngineBase: what every engine refuses alike is said once, before the engine's own work."""

from __future__ import annotations

import asyncio

import pytest

from openforgerl.engines.base import EngineError, SamplingParams
from openforgerl.engines.vllm import VLLMEngine
from openforgerl.testing.scripted_engine import ScriptedEngine
from tests.vlm_helpers import screenshot

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


def test_an_empty_prompt_is_refused_before_the_engine_sees_it() -> None:
    engine = ScriptedEngine(completion=[5, 6])
    with pytest.raises(EngineError, match="empty prompt"):
        asyncio.run(engine.generate([], PARAMS))
    assert engine.calls == 0  # the script was not consumed
    assert asyncio.run(engine.generate([1, 2], PARAMS)).completion_ids == [5, 6]


def test_an_engine_that_takes_no_images_says_why_before_any_request() -> None:
    """vLLM's /v1/completions takes no images: refused with the reason, not sent (nothing listens
    on this port: a request would have failed as unavailable instead)."""
    engine = VLLMEngine("http://127.0.0.1:9", model="m")
    with pytest.raises(EngineError, match="takes no images") as info:
        asyncio.run(engine.generate([1, 2], PARAMS, images=[screenshot(32, 32)]))
    assert "sglang" in str(info.value) and type(info.value) is EngineError
    shown = ScriptedEngine(script=lambda req: [len(req.images)])
    assert asyncio.run(shown.generate([1], PARAMS, images=[screenshot(32, 32)])).completion_ids == [1]
