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

from openforgerl.harnesses.base import Dialect, NpmHarness, base_env, write_json

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

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        write_json(
            home / ".claude.json",
            {
                "hasCompletedOnboarding": True,
                "customApiKeyResponses": {"approved": [api_key[-20:]], "rejected": []},
                "projects": {
                    str(workdir): {"hasTrustDialogAccepted": True, "allowedTools": list(ALLOWED_TOOLS)}
                },
                "bypassPermissionsModeAccepted": True,
                "autoUpdates": False,
            },
        )
        env = base_env(home)
        env.update(
            ANTHROPIC_BASE_URL=base_url,
            ANTHROPIC_API_KEY=api_key,
            ANTHROPIC_MODEL=model,
            ANTHROPIC_SMALL_FAST_MODEL=model,
            ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
            DISABLE_AUTOUPDATER="1",
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        )
        return env

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
