"""Gemini CLI, Google's agent CLI, speaking the Gemini API (`/v1beta/models/{model}:...`).

Quirks:
- `GEMINI_API_KEY` + `GOOGLE_GEMINI_BASE_URL` (no /v1beta: it adds that) and settings with
  `security.auth.selectedType = gemini-api-key` (else "Invalid auth method selected") and folder
  trust off (else `--yolo` is downgraded because the folder is untrusted).
- It picks its own model names: a router side request per user turn (non-streaming
  `:generateContent` with `responseJsonSchema`, answered with a complexity score or a
  flash/pro choice) selects the main model. The gateway serves every name with the one policy, so
  the `model` given to `prepare` is not imposed on it.
- It backs off on its own (about 6-8 s), ignoring `retry-after`.
- The shell tool is `run_shell_command {command, ...}`; function calls come back with a client-made
  `id` and a placeholder `thoughtSignature`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openforgerl.harnesses.base import Dialect, NpmHarness

NAME = "gemini-cli"
PACKAGE = "@google/gemini-cli"
VERSION = "0.61.0"


class GeminiCli(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "gemini"
    dialect: Dialect = "gemini"

    settings_file = ".gemini/settings.json"

    def settings(self, workdir: Path, base_url: str, api_key: str, model: str) -> dict[str, Any]:
        return {
            "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
            "privacy": {"usageStatisticsEnabled": False},
            "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
        }

    def environment(self, base_url: str, api_key: str, model: str) -> dict[str, str]:
        return {"GEMINI_API_KEY": api_key, "GOOGLE_GEMINI_BASE_URL": base_url}

    def command(self, task: str, resume: bool = False) -> list[str]:
        return [str(self.binary), *(["--resume", "latest"] if resume else []), "-p", task, "--yolo"]
