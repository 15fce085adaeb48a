"""The settings of `openforge eval` and `openforge rollout` (EvalOptions): a light module, so the CLI
reads its defaults without evaluate.py's imports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from openforgerl.engines.base import engine_setting
from openforgerl.rollouts.settings import (
    OnFailure,
    RolloutSettings,
    RunNetwork,
    harness_setting,
    temperature_setting,
    timeout_multiplier_setting,
)
from openforgerl.sandbox.choice import BackendChoice
from openforgerl.settings import setting

if TYPE_CHECKING:
    from openforgerl.gateway.config import UpstreamSpec


@dataclass
class EvalOptions:
    """The settings of an evaluation (and of `openforge rollout`), each its own option of the command
    (cli/options.py derives them), but for those made from other options (NOT_OPTIONS)."""

    tasks: str = setting(
        help="A suite (tools-tiny, tools-tiny-faults, tools-tiny-reworded, claw-basic, web-basic), a task "
        "file/dir, or harbor:DIR (Harbor task folders; found by themselves in a dir without task files)."
    )
    harness: str = harness_setting(
        ". eval takes several, comma-separated: the harness study (one side-by-side report). A task's "
        "own harness wins"
    )
    k: int = setting(1, "pass@k and pass^k for k = 1..K.", low=1)
    n: int | None = setting(None, "Runs per task (at least k; none: k).", low=1)
    split: str | None = setting(None, "Only tasks of this split (train, heldout, test).")
    limit: int | None = setting(None, "Only the first N tasks.", low=1)
    model: str | None = setting(None, "Model dir served by an embedded gateway (none: the tiny local model).")
    gateway: str | None = setting(None, "A running gateway's URL instead (with --admin-token).")
    admin_token: str = setting("", "With --gateway (or OPENFORGE_ADMIN_TOKEN).")
    concurrency: int = setting(RolloutSettings.concurrency, "Rollouts in flight.", low=1)
    max_tokens: int = setting(256, "Tokens per model call.", low=1)
    max_turns: int = setting(12, "ReAct harness turns.", low=1)
    max_steps: int | None = setting(None, "GUI harness steps, e.g. 15, 50, 100 (none: the task's).", low=1)
    temperature: float = temperature_setting(1.0, "every run (embedded gateway; 0: greedy)", greedy=True)
    seed: int | None = setting(
        None,
        "Seeded sampling: every run of a task samples from its own seed, so the same weights give the "
        "same rollouts, and two models evaluated with one seed meet the same random numbers (a paired "
        "comparison with less noise). The engine must honour seeds (the built-in one and vLLM do).",
    )
    on_failure: OnFailure = setting(
        RolloutSettings.on_failure,
        "Score of a rollout whose harness crashed or timed out.",
        choices=("zero", "drop", "verify"),
    )
    timeout_multiplier: float = timeout_multiplier_setting()
    out: Path = setting(Path("runs/eval"), "Run folder.", shown_default="runs/eval-TASKS-HARNESS")
    run_id: str = ""
    progress: bool = setting(True, "A progress bar.")
    network: RunNetwork = setting(
        RolloutSettings.network,
        "What sandboxes reach: only the gateway, or the host's network (the internet and the host's own "
        "services), which live-site tasks (webvoyager:FILE, online-mind2web:FILE) need.",
        choices=("gateway", "host"),
    )
    engine: str = engine_setting(" behind the embedded gateway")
    engine_threads: int | None = setting(
        None,
        "CPU threads of the embedded engine (none: half the cores, the rest for the sandboxes: a "
        "harness, a browser and the engine oversubscribing 2 cores slow calls 4-30x).",
        low=1,
    )
    # External models the embedded gateway serves to rollouts created with "upstream": NAME (the LLM
    # judge of web tasks asks "judge"); a running gateway (`gateway`) has its own.
    upstreams: list[UpstreamSpec] = dataclasses.field(default_factory=list)
    backend: BackendChoice = dataclasses.field(default_factory=BackendChoice)  # where sandboxes run


# Settings with no option of their own: made from --upstream... and --backend..., or the run's own.
NOT_OPTIONS = ("run_id", "upstreams", "backend")
