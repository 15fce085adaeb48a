"""The `openforge` command: the click group `main`, one module per command (or command group).

Every module keeps its heavy imports (torch, transformers, the gateway's server) inside the command,
so `openforge --help` stays fast; option defaults are read from the config dataclasses
(gateway/config.py, eval_options.py, rl/config.py), which import nothing heavy.
"""

from __future__ import annotations

import click

from openforgerl.cli.doctor import doctor
from openforgerl.cli.eval import eval_cmd
from openforgerl.cli.export_atif import export_atif_cmd
from openforgerl.cli.export_sft import export_sft_cmd
from openforgerl.cli.gateway import gateway
from openforgerl.cli.gc import gc
from openforgerl.cli.harness import harness
from openforgerl.cli.model import model
from openforgerl.cli.rollout import rollout_cmd
from openforgerl.cli.sft import sft_cmd
from openforgerl.cli.tasks import tasks
from openforgerl.cli.train import train_cmd
from openforgerl.cli.verl_data import verl_data_cmd
from openforgerl.cli.view import view


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="openforgerl")
def main() -> None:
    """OpenForgeRL: train agents inside the harnesses they really run in."""


for command in (
    model,
    gateway,
    export_sft_cmd,
    export_atif_cmd,
    harness,
    doctor,
    gc,
    eval_cmd,
    rollout_cmd,
    view,
    train_cmd,
    verl_data_cmd,
    sft_cmd,
    tasks,
):
    main.add_command(command)

__all__ = ["main"]
