"""mini-swe-agent (Princeton/Stanford SWE-agent team), a Python agent on litellm, in its own venv.

Quirks:
- A run ends when its bash tool runs `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; success is the
  trajectory's `info.exit_status == "Submitted"`, written to `$MSWEA_GLOBAL_CONFIG_DIR`.
- The gateway goes into a config file of its own, merged over the built-in `mini.yaml`
  (`-c mini.yaml -c openforgerl.yaml`, found through `MSWEA_CONFIG_DIR`).
- litellm fetches a cost map from GitHub at import unless `LITELLM_LOCAL_MODEL_COST_MAP=True`, and
  cost tracking must ignore the unknown model (`MSWEA_COST_TRACKING=ignore_errors`).
- Non-streaming Chat Completions with one tool, `bash {command}`; byte-exact prefix extension.
- No sessions: it cannot resume.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from openforgerl.harnesses.base import (
    Check,
    Dialect,
    HarnessError,
    RunResult,
    base_env,
    check_installed,
    default_cache_dir,
    write_json,
)

NAME = "mini-swe-agent"
PACKAGE = "mini-swe-agent"
VERSION = "2.4.6"
CONFIG_NAME = "openforgerl.yaml"
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class MiniSweAgent:
    name = NAME
    package = PACKAGE
    version = VERSION
    dialect: Dialect = "openai"
    can_resume = False

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    @property
    def venv(self) -> Path:
        return self.cache_dir / NAME / "venv"

    @property
    def binary(self) -> Path:
        return self.venv / "bin" / "mini"

    def install(self) -> None:
        if self.check().ok:
            return
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(self.venv)],
            [str(self.venv / "bin" / "pip"), "install", "-q", f"{PACKAGE}=={VERSION}"],
        ]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise HarnessError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")

    def check(self) -> Check:
        # The dist-info folder names the version: no need to start the venv's Python.
        found = sorted(self.venv.glob("lib/python*/site-packages/mini_swe_agent-*.dist-info"))
        installed = None
        if found:
            installed = found[-1].name.removeprefix("mini_swe_agent-").removesuffix(".dist-info")
        return check_installed(NAME, VERSION, installed, self.binary)

    def prepare(
        self, home: Path, workdir: Path, base_url: str, api_key: str, model: str, max_turns: int | None = None
    ) -> dict[str, str]:
        config_dir = home / ".config" / "mini-swe-agent"
        config: dict[str, Any] = {
            "model": {
                "model_name": f"openai/{model}",
                "model_kwargs": {"api_base": base_url + "/v1", "api_key": api_key},
                "cost_tracking": "ignore_errors",
            }
        }
        if max_turns:
            config["agent"] = {"step_limit": max_turns}  # mini stops with exit status LimitsExceeded
        write_json(config_dir / CONFIG_NAME, config)  # JSON is YAML: mini reads it with yaml.safe_load
        env = base_env(home)
        env.update(
            MSWEA_GLOBAL_CONFIG_DIR=str(config_dir),
            MSWEA_CONFIG_DIR=str(config_dir),
            MSWEA_CONFIGURED="true",
            MSWEA_COST_TRACKING="ignore_errors",
            MSWEA_SILENT_STARTUP="1",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        return env

    def command(self, task: str, resume: bool = False) -> list[str]:
        if resume:
            raise ValueError("mini-swe-agent has no sessions and cannot resume")
        config = ["-c", "mini.yaml", "-c", CONFIG_NAME]
        return [str(self.binary), *config, "-t", task, "--yolo", "--exit-immediately"]

    def trajectory(self, home: Path) -> dict[str, object]:
        path = home / ".config" / "mini-swe-agent" / "last_mini_run.traj.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(data, dict)
        return data

    def succeeded(self, result: RunResult, home: Path) -> bool:
        if result.returncode != 0:
            return False
        try:
            info = self.trajectory(home).get("info")
        except (OSError, ValueError):
            return False
        return isinstance(info, dict) and info.get("exit_status") == "Submitted"
