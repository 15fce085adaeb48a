"""`openforge train --backend verl CONFIG [overrides...]`: veRL's own main with our Hydra config.

CONFIG is a YAML file or the name of a shipped config (`config/NAME.yaml`, e.g. `qwen3_grpo`); the
rest are Hydra overrides (`data.train_files=...`, `trainer.n_gpus_per_node=1`, `+key=value`) or
Hydra flags (`--cfg job` prints the composed config). The command is
`python -m verl.trainer.main_ppo --config-path DIR --config-name NAME overrides...`: veRL composes,
validates and runs it (Ray, FSDP, vLLM); nothing of veRL's is reimplemented here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "config"
ENTRY_POINT_GROUP = "verl.plugins"
ENTRY_POINT = "openforgerl.integrations.verl.agent_loop"


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
    command = main_ppo_command(args[0], args[1:], python)
    check_installed()
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    return subprocess.call(command)
