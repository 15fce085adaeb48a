"""`openforge train --backend verl CONFIG [overrides...]`: veRL's own main with our Hydra config.

CONFIG is a YAML file or the name of a shipped config (`config/NAME.yaml`, e.g. `qwen3_grpo`); the
rest are Hydra overrides (`data.train_files=...`, `trainer.n_gpus_per_node=1`, `+key=value`) or
Hydra flags (`--cfg job` prints the composed config). The command is
`python -m verl.trainer.main_ppo --config-path DIR --config-name NAME overrides...`: veRL composes,
validates and runs it (Ray, FSDP, vLLM); nothing of veRL's is reimplemented here.

A config whose `openforge.device` is `cpu` (the shipped `cpu_grpo`, or `openforge.device=cpu` on the
command line) runs on the project's CPU platform for veRL (`cpu.py`, `VERL_PLATFORM=cpu`) inside a
network namespace of its own with only loopback up (`netns.py`); any other runs as veRL runs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from openforgerl.integrations.verl.netns import CPU_ENV, inside, wrap

CONFIG_DIR = Path(__file__).parent / "config"
ENTRY_POINT_GROUP = "verl.plugins"
ENTRY_POINT = "openforgerl.integrations.verl.plugin"


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config(config: str) -> Path:
    """A YAML file, or a shipped config by name."""
    path = Path(config)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"{config}: no such config file")
        return path.resolve()
    shipped = CONFIG_DIR / f"{config}.yaml"
    if shipped.is_file():
        return shipped
    raise ValueError(f"{config}: neither a YAML file nor a shipped config ({', '.join(shipped_configs())})")


def main_ppo_command(config: str, overrides: Sequence[str], python: str = sys.executable) -> list[str]:
    path = resolve_config(config)
    return [
        python,
        "-m",
        "verl.trainer.main_ppo",
        f"--config-path={path.parent}",
        f"--config-name={path.stem}",
        *overrides,
    ]


def config_device(config: str, overrides: Sequence[str]) -> str | None:
    """`openforge.device` of the config file (or of its last command-line override)."""
    device = None
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key == "openforge.device":
            device = value.strip() or None
    if device is None:
        raw = yaml.safe_load(resolve_config(config).read_text()) or {}
        section = raw.get("openforge") if isinstance(raw, dict) else None
        device = section.get("device") if isinstance(section, dict) else None
    return None if device in (None, "null", "auto") else str(device)


def launch_command(
    config: str, overrides: Sequence[str], python: str = sys.executable
) -> tuple[list[str], dict[str, str]]:
    """veRL's main and the environment it runs with (see the module doc)."""
    command = main_ppo_command(config, overrides, python)
    device = config_device(config, overrides)
    if device is None:
        return command, {}
    if device != "cpu":
        raise ValueError(f"openforge.device={device}: the launcher knows 'cpu' (null: veRL's own detection)")
    # Already inside one (a test's two-node cluster, started there first): run it as it is.
    return (command if inside() else wrap(command, python)), dict(CPU_ENV)


def check_installed() -> None:
    """veRL importable and our agent loop registered with it, or a message saying what to install."""
    if importlib.util.find_spec("verl") is None:
        raise ValueError(
            "veRL is not installed in this environment: pip install 'verl[vllm]==0.9.1' "
            "(GPU machines; scripts/gpu_smoke.sh shows a complete install)"
        )
    names = {ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if ENTRY_POINT not in names:
        raise ValueError(
            f"the openforge agent loop is not registered with veRL (no '{ENTRY_POINT_GROUP}' entry point): "
            "reinstall openforgerl (pip install -e .) so its entry points are written"
        )


def train_on_verl(args: Sequence[str], python: str = sys.executable) -> int:
    """Run veRL's trainer; returns its exit status."""
    if not args:
        raise ValueError(f"give CONFIG: a YAML file or a shipped config ({', '.join(shipped_configs())})")
    command, env = launch_command(args[0], args[1:], python)
    check_installed()
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    print("+ " + (shown + " " if shown else "") + " ".join(command), file=sys.stderr, flush=True)
    return subprocess.call(command, env=child_env(env))


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}
