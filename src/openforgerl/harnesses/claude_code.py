"""Claude Code, Anthropic's agent CLI (a native binary shipped through npm).

Quirks:
- As root, `--dangerously-skip-permissions` is refused unless `IS_SANDBOX=1` is set. Tools are
  allowed by name with `--allowedTools` instead, which works for any user; others are denied.
- `~/.claude.json` skips onboarding, approves the API key (by its last 20 characters) and trusts the
  work directory, so neither `-p` nor the TUI stops at a dialog.
- It always streams (SSE) `POST /v1/messages?beta=true`; `cache_control` moves to the newest block
  every turn and mid-conversation `role: system` messages appear, which the gateway canonicalises.
- Side requests (title generation in the TUI) use the "small fast" model: pointed at the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openforgerl.harnesses.base import Dialect, NpmHarness

NAME = "claude-code"
PACKAGE = "@anthropic-ai/claude-code"
VERSION = "2.1.332"
ALLOWED_TOOLS = ("Bash", "Read", "Edit", "Write", "Glob", "Grep")


class ClaudeCode(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "claude"
    dialect: Dialect = "anthropic"

    settings_file = ".claude.json"

    def settings(self, workdir: Path, base_url: str, api_key: str, model: str) -> dict[str, Any]:
        return {
            "hasCompletedOnboarding": True,
            "customApiKeyResponses": {"approved": [api_key[-20:]], "rejected": []},
            "projects": {str(workdir): {"hasTrustDialogAccepted": True, "allowedTools": list(ALLOWED_TOOLS)}},
            "bypassPermissionsModeAccepted": True,
            "autoUpdates": False,
        }

    def environment(self, base_url: str, api_key: str, model: str) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": api_key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }

    def command(self, task: str, resume: bool = False) -> list[str]:
        return [
            str(self.binary),
            *(["-c"] if resume else []),
            "-p",
            task,
            "--allowedTools",
            ",".join(ALLOWED_TOOLS),
            "--output-format",
            "json",
        ]
