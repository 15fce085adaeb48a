"""What the RL loop, its headroom measurement (headroom.py) and the baselines share: the tasks a run
draws, the harness it runs them with, and one batch of rollouts (the engine and gateway that serve
them: run/stack.py). Below loop.py and headroom.py, so that the loop can measure headroom and the
measurement can run rollouts as the loop does, without either importing the other."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from openforgerl.engines.base import Engine
from openforgerl.harnesses.launch import HarnessChoice, LaunchOptions
from openforgerl.rl.config import TrainOptions
from openforgerl.rollouts.results import RolloutResult
from openforgerl.rollouts.service import Cancel, RolloutJob, RolloutService
from openforgerl.run.folder import RunFolder
from openforgerl.run.stack import RunStack, serving
from openforgerl.run.stack import start_engine as start_engine  # the run layer's (run/stack.py)
from openforgerl.tasks import Task, load_tasks


def training_tasks(opts: TrainOptions) -> list[Task]:
    """The tasks RL draws from: the split, less its first `skip_tasks`."""
    tasks = load_tasks(opts.tasks, split=opts.split)[opts.skip_tasks :]  # type: ignore[arg-type]
    if not tasks:
        skipped = f" after the first {opts.skip_tasks}" if opts.skip_tasks else ""
        raise ValueError(f"no {opts.split} tasks in {opts.tasks}{skipped}")
    return tasks


def step_tasks(
    tasks: Sequence[Task], step: int, n: int, seed: int, batch: int = 0, drawn: Sequence[Task] = ()
) -> list[Task]:
    """The tasks of `step`'s generation batch `batch`, none of `drawn`: drawn from (seed, step,
    batch) alone, so a resumed run draws the same ones."""
    taken = {t.id for t in drawn}
    rest = [t for t in tasks if t.id not in taken]
    rng = random.Random(f"{seed}:{step}" if batch == 0 else f"{seed}:{step}:{batch}")
    return rng.sample(rest, min(n, len(rest)))


def run_tasks(
    service: RolloutService,
    tasks: Sequence[Task],
    n: int,
    state_dir: Path,
    run_id: str,
    opts: TrainOptions,
    *,
    sampling: dict[str, Any] | None = None,
    desc: str = "rollouts",
    cancel: Cancel | None = None,
    training: bool = False,
) -> list[RolloutResult]:
    """Run every task n times through the service; `state_dir` keeps the runner's state.
    `cancel` lets another thread stop the run (its runner cleans up as on Ctrl-C). `training`:
    rollouts for the policy update, where a wall-clock timeout follows `opts.on_timeout`;
    measurements (held-out evaluation, headroom) score it as a failure, as `openforge eval` does."""
    job = RolloutJob(
        harness_choice(opts),
        run_id=run_id,
        state_path=RunFolder(state_dir).runner_state,
        concurrency=opts.concurrency,
        on_failure=opts.on_failure,
        exclude_timeouts=training and opts.on_timeout == "exclude",
        timeout_multiplier=opts.timeout_multiplier,
        sampling=sampling or {},
    )
    return service.run(tasks, n, job, progress=opts.progress, desc=desc, leave=False, cancel=cancel)


def harness_choice(opts: TrainOptions) -> HarnessChoice:
    """The run's harnesses (harnesses/launch.py), as `openforge eval` chooses them."""
    launch = LaunchOptions(max_turns=opts.max_turns, max_tokens=opts.max_tokens, max_steps=opts.max_steps)
    return HarnessChoice(opts.harness, launch)


@contextmanager
def serving_run(
    opts: TrainOptions, model_dir: str | Path, *, policy_version: int = 0, engine: Engine | None = None
) -> Iterator[RunStack]:
    """The run's engine (`engine`, or the one opts.engine names, at `policy_version`), its gateway
    recording into the run folder at the run's sampling settings, and the rollout service on it."""
    run = RunFolder(opts.out)
    with serving(
        model_dir,
        run.gateway_store,
        engine=engine or opts.engine,
        policy_version=policy_version,
        backend=opts.backend,
        run_id=run.name,
        max_tokens=opts.max_tokens,
        max_context=opts.max_context,
        temperature=opts.temperature,
    ) as stack:
        yield stack
