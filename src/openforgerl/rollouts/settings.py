"""What a run of rollouts is asked to do, declared once (RolloutSettings): the runner's config
(runner.py RunnerConfig) and the service's job (service.py RolloutJob) are both made of it, and
the recipes' configs (EvalOptions, TrainOptions, DemoConfig) read its defaults and its one shared
setting (`timeout_multiplier_setting`). A light module: it imports nothing of the package but the
leaf `settings`, and that only when a config is declared."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

OnFailure = Literal["zero", "drop", "verify"]
OnTimeout = Literal["exclude", "zero"]  # RL: a wall-clock timeout left out of the update, or scored 0
RunNetwork = Literal["gateway", "host"]  # what a run's sandboxes reach (runner.py's doc)


@dataclass(kw_only=True)
class RolloutSettings:
    """One run of rollouts: its durable state, how many at once, how a harness's failure counts
    (runner.py), how each rollout samples, and what its sandboxes reach."""

    run_id: str
    state_path: Path  # the runner's state (runner.db): finished rollouts are never redone
    concurrency: int = 4  # rollouts in flight
    infra_retries: int = 2
    on_failure: OnFailure = "zero"
    # A harness stopped by the task's wall clock is left out (dropped) instead of scored by
    # on_failure, unless its task says the limit is part of it (`Task.timeout_is_failure`): RL's
    # choice, so that a loaded machine teaches no penalty.
    exclude_timeouts: bool = False
    # The harness's wall clock is the task's timeout times this (Harbor's --timeout-multiplier): on
    # a slow or loaded machine a rollout's time says more about the machine than about the policy.
    timeout_multiplier: float = 1.0
    sampling: dict[str, Any] = field(default_factory=dict)  # per-rollout sampling overrides
    # Seeded sampling: rollout (task, sample) samples with seeds drawn from (seed, task id, sample),
    # whatever the weights, so an evaluation repeats exactly and two models meet the same random
    # numbers (their per-task difference is less noisy). None: unseeded, as RL rollouts must be.
    seed: int | None = None
    # Every sandbox's network: "gateway" (only the gateway) or "host" (also the live web; needed by
    # tasks with harness_options.start_url).
    network: RunNetwork = "gateway"


def timeout_multiplier_setting() -> Any:
    """The `timeout_multiplier` setting of the recipes' configs (eval, train, the demo), declared once."""
    from openforgerl.settings import setting

    return setting(
        RolloutSettings.timeout_multiplier,
        "The harness's wall clock is each task's timeout times this (a slow or loaded machine).",
        low=0,
        low_open=True,
    )


def settings_in(config: RolloutSettings) -> dict[str, Any]:
    """The RolloutSettings part of `config` (a job's, for its runner), the sampling copied."""
    return {
        "run_id": config.run_id,
        "state_path": config.state_path,
        "concurrency": config.concurrency,
        "infra_retries": config.infra_retries,
        "on_failure": config.on_failure,
        "exclude_timeouts": config.exclude_timeouts,
        "timeout_multiplier": config.timeout_multiplier,
        "sampling": dict(config.sampling),
        "seed": config.seed,
        "network": config.network,
    }
