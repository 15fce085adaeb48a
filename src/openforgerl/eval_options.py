"""The settings of `openforge eval` and `openforge rollout` (EvalOptions): a light module, so the CLI
reads its defaults without evaluate.py's imports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from openforgerl.rollouts.settings import OnFailure, RolloutSettings, RunNetwork
from openforgerl.sandbox.choice import BackendChoice

if TYPE_CHECKING:
    from openforgerl.gateway.config import UpstreamSpec


@dataclass
class EvalOptions:
    tasks: str
    harness: str = "react"
    k: int = 1
    n: int | None = None
    split: str | None = None
    limit: int | None = None
    model: str | None = None  # model directory for the embedded gateway
    gateway: str | None = None  # or a running gateway's URL (with admin_token)
    admin_token: str = ""
    concurrency: int = RolloutSettings.concurrency  # the runner's, declared there
    max_tokens: int = 256
    max_turns: int = 12
    max_steps: int | None = None  # the gui harness's step limit (None: the task's, 15 in web-basic)
    temperature: float = 1.0
    seed: int | None = None  # seeded sampling (RunnerConfig.seed): reproducible, paired evaluations
    on_failure: OnFailure = RolloutSettings.on_failure
    out: Path = Path("runs/eval")
    run_id: str = ""
    progress: bool = True
    # "host": the sandboxes may use the host's network (live sites)
    network: RunNetwork = RolloutSettings.network
    engine_threads: int | None = None  # the embedded engine's CPU threads (None: half the cores)
    # External models the embedded gateway serves to rollouts created with "upstream": NAME (the LLM
    # judge of web tasks asks "judge"); a running gateway (`gateway`) has its own.
    upstreams: list[UpstreamSpec] = dataclasses.field(default_factory=list)
    backend: BackendChoice = dataclasses.field(default_factory=BackendChoice)  # where sandboxes run
