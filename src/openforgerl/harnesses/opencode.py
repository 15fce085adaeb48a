"""opencode (sst), a Bun binary shipped through npm, using the AI SDK's OpenAI-compatible provider.

Quirks:
- The gateway is a provider in `$XDG_CONFIG_HOME/opencode/opencode.json`
  (`npm: @ai-sdk/openai-compatible`, `options.baseURL` with /v1); `model` and `small_model` both
  point at it, so the title request goes to the gateway too.
- A title-generation side request (no tools, "You are a title generator...") runs about a second
  before the first turn: it is a branch of its own.
- `--auto` approves tool calls; the shell tool is `bash {command, description, ...}`.
- It fetches the models.dev catalog at start (disabled here) and re-serialises tool-call arguments
  compactly; the `run` prompt may arrive wrapped in double quotes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openforgerl.harnesses.base import Dialect, NpmHarness

NAME = "opencode"
PACKAGE = "opencode-ai"
VERSION = "1.18.33"
PROVIDER = "openforge"


class OpenCode(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "opencode"
    dialect: Dialect = "openai"

    settings_file = ".config/opencode/opencode.json"

    def settings(self, workdir: Path, base_url: str, api_key: str, model: str) -> dict[str, Any]:
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                PROVIDER: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "OpenForgeRL gateway",
                    "options": {"baseURL": base_url + "/v1", "apiKey": api_key},
                    "models": {model: {"name": model, "tool_call": True}},
                }
            },
            "model": f"{PROVIDER}/{model}",
            "small_model": f"{PROVIDER}/{model}",
            "autoupdate": False,
            "share": "disabled",
        }

    def environment(self, base_url: str, api_key: str, model: str) -> dict[str, str]:
        return {
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        }

    def command(self, task: str, resume: bool = False) -> list[str]:
        return [str(self.binary), "run", "--auto", *(["-c"] if resume else []), task]
