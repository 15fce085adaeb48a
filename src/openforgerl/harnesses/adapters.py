"""The agent CLI adapters by name: one module per agent CLI, behind the `Harness` protocol (base.py).

harness = get("codex")                   # bound to the default cache folder
harness.install()                        # the pinned version, once
env = harness.prepare(home, workdir, rollout["base_url"], rollout["api_key"], "policy")
result = run(harness.command("Fix the test"), cwd=workdir, env=env, timeout=600)
harness.succeeded(result, home)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from openforgerl.harnesses.base import Check, Harness, HarnessError, RunResult, default_cache_dir, run
from openforgerl.harnesses.claude_code import ClaudeCode
from openforgerl.harnesses.codex import Codex
from openforgerl.harnesses.gemini_cli import GeminiCli
from openforgerl.harnesses.mini_swe_agent import MiniSweAgent
from openforgerl.harnesses.openclaw import OpenClaw
from openforgerl.harnesses.opencode import OpenCode
from openforgerl.harnesses.pi import Pi
from openforgerl.harnesses.qwen_code import QwenCode

__all__ = ["HARNESSES", "Check", "Harness", "HarnessError", "RunResult", "default_cache_dir", "get", "run"]

HARNESSES: dict[str, Callable[[Path | None], Harness]] = {
    "claude-code": ClaudeCode,
    "codex": Codex,
    "qwen-code": QwenCode,
    "opencode": OpenCode,
    "openclaw": OpenClaw,
    "gemini-cli": GeminiCli,
    "pi": Pi,
    "mini-swe-agent": MiniSweAgent,
}


def get(name: str, cache_dir: Path | None = None) -> Harness:
    """The adapter for `name` (a key of HARNESSES), bound to `cache_dir` (default: default_cache_dir())."""
    try:
        factory = HARNESSES[name]
    except KeyError:
        raise KeyError(f"unknown harness {name!r}; one of {', '.join(HARNESSES)}") from None
    return factory(cache_dir)
