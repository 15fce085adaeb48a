"""Codex, OpenAI's agent CLI (a native Rust binary shipped through npm).

Quirks:
- `OPENAI_BASE_URL` is ignored by 0.171 and `wire_api = "chat"` is gone, so the gateway is a custom
  model provider in `$CODEX_HOME/config.toml` with `wire_api = "responses"` and the key in `env_key`.
- Over HTTP it streams `POST /v1/responses` (SSE) and re-sends the whole input each turn, byte-exact.
- With `websocket=True` the provider sets `supports_websockets`: Codex then opens
  `GET /v1/responses` as a WebSocket (header `openai-beta: responses_websockets=...`), sends a
  `generate: false` prewarm frame, and later frames carry `previous_response_id` plus only the new
  items, so the server must keep each connection's context. If the handshake fails it retries a few
  times (about 6 s) and falls back to HTTP SSE.
- No system prompt field: base instructions arrive as `developer` messages inside `input`.
"""

from __future__ import annotations

from pathlib import Path

from openforgerl.harnesses.base import Dialect, NpmHarness, base_env, toml_string, write_text

NAME = "codex"
PACKAGE = "@openai/codex"
VERSION = "0.171.0"
PROVIDER = "openforge"
KEY_ENV = "OPENFORGE_API_KEY"


class Codex(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "codex"
    dialect: Dialect = "openai-responses"

    def __init__(self, cache_dir: Path | None = None, *, websocket: bool = False) -> None:
        super().__init__(cache_dir)
        self.websocket = websocket

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        codex_home = home / ".codex"
        lines = [
            f"model = {toml_string(model)}",
            f"model_provider = {toml_string(PROVIDER)}",
            "check_for_update_on_startup = false",
            "",
            f"[model_providers.{PROVIDER}]",
            'name = "OpenForgeRL gateway"',
            f"base_url = {toml_string(base_url + '/v1')}",
            f"env_key = {toml_string(KEY_ENV)}",
            'wire_api = "responses"',
        ]
        if self.websocket:
            lines.append("supports_websockets = true")
        write_text(codex_home / "config.toml", "\n".join(lines) + "\n")
        env = base_env(home)
        env.update({"CODEX_HOME": str(codex_home), KEY_ENV: api_key})
        return env

    def command(self, task: str, resume: bool = False) -> list[str]:
        return [
            str(self.binary),
            "exec",
            "--skip-git-repo-check",
            # No sandbox of its own (it would need bwrap/landlock): isolation is the runner's job.
            "--dangerously-bypass-approvals-and-sandbox",
            *(["resume", "--last"] if resume else []),
            task,
        ]
