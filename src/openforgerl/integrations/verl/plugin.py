"""The `verl.plugins` entry point: `import verl` imports this module in every veRL process.

It registers, without touching veRL's files:
- the "openforge" agent loop (`agent_loop`: our rollouts through the gateway, in sandboxes);
- the "openforge" rollout (`rollout.name: openforge`): a replica served by the project's own
  engine (`replica.OpenForgeReplica`) in veRL's replica registry, and its worker-side adapter
  (`rollout.OpenForgeRolloutAdapter`) in veRL's rollout-adapter table;
- with `VERL_PLATFORM=cpu` only, the CPU platform (`cpu.PlatformCPU`) and its one runtime wrap.

veRL swallows a plugin's import error (logged at debug level); `launch.check_installed` imports
this module directly so a missing dependency is reported.
"""

from __future__ import annotations

import os

from verl.workers.rollout import base as _rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    from openforgerl.integrations.verl import cpu

    cpu.install()

ROLLOUT = "openforge"


def _load_replica() -> type:
    from openforgerl.integrations.verl.replica import OpenForgeReplica

    return OpenForgeReplica


RolloutReplicaRegistry.register(ROLLOUT, _load_replica)
# veRL's adapter table maps (rollout name, mode) to a class path, imported in the worker.
ADAPTER = "openforgerl.integrations.verl.rollout.OpenForgeRolloutAdapter"
_rollout_base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = ADAPTER

from openforgerl.integrations.verl import agent_loop  # noqa: E402,F401  (registers the agent loop)
