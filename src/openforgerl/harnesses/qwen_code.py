"""Qwen Code, Alibaba's fork of Gemini CLI speaking OpenAI Chat Completions.

Quirks:
- Configured by `OPENAI_API_KEY`, `OPENAI_BASE_URL` (with /v1) and `OPENAI_MODEL`; settings pin the
  auth type so it never asks, and turn off update checks and usage statistics.
- `--yolo` approves every tool call. The shell tool is `run_shell_command {command, ...}`.
- Tool results come back as lists of text parts; tool-call arguments are re-serialised compactly.
- npm's script policy leaves its vendored ripgrep non-executable: it warns and uses its own grep.
- After a resumed turn it sends a "memory extraction" side request (another system prompt, the same
  history); `--continue` regenerates the first user message, so a resume starts a new branch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openforgerl.harnesses.base import Dialect, NpmHarness

NAME = "qwen-code"
PACKAGE = "@qwen-code/qwen-code"
VERSION = "0.24.4"  # its engines field says node >= 22; it runs on node 20


class QwenCode(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "qwen"
    dialect: Dialect = "openai"

    settings_file = ".qwen/settings.json"

    def settings(self, workdir: Path, base_url: str, api_key: str, model: str) -> dict[str, Any]:
        return {
            "security": {"auth": {"selectedType": "openai"}},
            "privacy": {"usageStatisticsEnabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        }

    def environment(self, base_url: str, api_key: str, model: str) -> dict[str, str]:
        return {"OPENAI_API_KEY": api_key, "OPENAI_BASE_URL": base_url + "/v1", "OPENAI_MODEL": model}

    def command(self, task: str, resume: bool = False) -> list[str]:
        return [str(self.binary), *(["--continue"] if resume else []), "-p", task, "--yolo"]
