"""pi (Mario Zechner's coding agent), the leanest harness: four tools (read, bash, edit, write).

Quirks:
- Providers live in `~/.pi/agent/models.json`; each names its wire `api`, so pi can speak any of the
  four gateway dialects. `settings.json` makes the gateway's model the default, so no `--model`.
- Chat Completions: the system prompt goes as `role: system` only with
  `compat.supportsDeveloperRole = false`; tool-call arguments are re-serialised compactly.
- `PI_OFFLINE=1` skips its version check and package-manager network calls.
"""

from __future__ import annotations

from pathlib import Path

from openforgerl.harnesses.base import Dialect, NpmHarness, base_env, write_json

NAME = "pi"
PACKAGE = "@mariozechner/pi-coding-agent"
VERSION = "0.73.1"
PROVIDER = "openforge"

# pi's wire api -> (gateway dialect, path appended to the rollout URL)
APIS: dict[str, tuple[Dialect, str]] = {
    "openai-completions": ("openai", "/v1"),
    "openai-responses": ("openai-responses", "/v1"),
    "anthropic-messages": ("anthropic", ""),
    "google-generative-ai": ("gemini", "/v1beta"),
}


class Pi(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "pi"

    def __init__(self, cache_dir: Path | None = None, *, api: str = "openai-completions") -> None:
        super().__init__(cache_dir)
        if api not in APIS:
            raise ValueError(f"unknown pi api {api!r}; one of {', '.join(APIS)}")
        self.api = api
        self.dialect: Dialect = APIS[api][0]

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        provider: dict[str, object] = {
            "baseUrl": base_url + APIS[self.api][1],
            "api": self.api,
            "apiKey": api_key,
            "models": [{"id": model}],
        }
        if self.api == "openai-completions":
            provider["compat"] = {"supportsDeveloperRole": False, "supportsReasoningEffort": False}
        agent_dir = home / ".pi" / "agent"
        write_json(agent_dir / "models.json", {"providers": {PROVIDER: provider}})
        write_json(agent_dir / "settings.json", {"defaultProvider": PROVIDER, "defaultModel": model})
        env = base_env(home)
        env["PI_OFFLINE"] = "1"
        return env

    def command(self, task: str, resume: bool = False) -> list[str]:
        return [str(self.binary), *(["-c"] if resume else []), "-p", task]
