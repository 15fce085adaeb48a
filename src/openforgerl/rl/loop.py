"""`openforge train`: the RL loop on one machine.

For each step: draw a batch of train tasks, run G rollouts of each through the harness (`react`,
tool calls; or `gui`, a browser agent on screenshots for a vision-language policy, whose samples
name their images by digest) in local sandboxes against an embedded gateway, build merged samples
from what the gateway recorded, train one step, write a checkpoint and load it into the engine in
place. The gateway serves the same engine object all run long, so rollouts of step k+1 come from the
weights of step k.

Run folder:
    run.json                 the options (read back by --resume)
    status.json              running, finished, failed or interrupted (openforgerl.run_status)
    gateway.db               every recorded call of every step (the trace viewer reads it)
    steps/NNNNNN/runner.db   the runner's state of step N: finished rollouts are never redone
    steps/NNNNNN/gen-B/      the same for generation batch B of step N (dynamic sampling)
    evals/NNNNNN/runner.db   held-out evaluation after step N (when --eval-every is set)
    checkpoints/step-NNNNNN  HF model + tokenizer + optimizer.pt + trainer_state.json
    metrics.jsonl            one JSON object per step (`step` key); tensorboard/ when installed
    headroom.json            the starting policy's headroom (--headroom-tasks; rl/headroom.py),
                             logged as step 0's headroom/* metrics; headroom/runner.db its runs

Resume after a crash (even kill -9): the last checkpoint gives the weights, optimizer and step;
the next step's runner state keeps its finished rollouts, so none is lost or repeated; a step
whose checkpoint exists but whose metrics line was not written yet gets it from the checkpoint.

Dynamic sampling (`max_gen_batches` > 1, DAPO's, as veRL's `algorithm.filter_groups`): a group
whose G rewards are all equal has no advantage to learn from, and from a good SFT model about half
of them are. A step then draws another batch of tasks (never one it drew already) while fewer than
`batch_tasks` groups have mixed rewards, up to `max_gen_batches` batches, and trains on the first
`batch_tasks` mixed groups: each update has as many groups with a signal as tasks asked for. The
`dynamic/*` metrics count the batches, groups drawn, mixed and kept, and give the pass rate of all
drawn rollouts (the trainer's own `pass_rate` is of the kept ones).

Overlap (`overlap=True`): a background thread runs the rollouts of the coming steps, in step order,
while the trainer trains; the rollouts of step s start only once the weights of step
s - max_lag - 1 are in the engine. With the default max_lag 1 the rollouts of step t + 1 run while
step t trains (max_lag 0 is the synchronous schedule, on a thread). Weights are pushed after each
step: the engine lets calls in flight finish on the old weights and gives later calls the new
ones, so a rollout can mix two versions (each token records its own). The policy lag of a sample
is the trainer's policy version when it trains on it minus the oldest version among its tokens;
the schedule bounds it by max_lag, and the trainer corrects it by truncated importance sampling:
pi_old is the trainer's policy at the start of the step (the PPO ratio is taken against it) and
each token's weight is pi_old / pi_behaviour, pi_behaviour being the logprob the engine recorded.

The bound is also enforced: a rollout with any sample older than the bound is left out of
training and counted (`lag/dropped_rollouts`); the rest of its group trains without it. Dropped,
not re-run: its runner state says done, and re-running it would score the same (task, sample)
twice. The schedule never produces such a rollout, resumed or not (a prefetched step's finished
rollouts came from weights at most max_lag versions before the ones it trains on, and a resumed
run starts from the last checkpoint, which is the newest weights the engine ever had); it happens
when a run is resumed with a lower --max-lag than its rollouts were made under.

Engines (`engine`, as `openforge gateway --engine` takes it): `builtin` runs transformers in this
process; `vllm` starts a vLLM server on loopback with the settings below and stops it at the end
(engines/vllm_server.py); `vllm:URL` (or `sglang:URL`) uses a running inference server. A vLLM
server must be started with VLLM_SERVER_DEV_MODE=1 (weights are reloaded through its /collective_rpc
`reload_weights`) and, for a temperature other than 1, `--logprobs-mode processed_logprobs` (the
behaviour logprobs must be of logits / temperature, as the trainer's are). Weights go to a server as
paths: checkpoints (and, before the first rollout, the starting model) must be on a filesystem the
server reads at the same path (the same machine, or a shared mount of the run folder); paths are
sent absolute. A server's weights are whatever it holds when the loop starts (the model it was
started with, or weights an earlier run left there), so the loop first loads the starting model, or
on --resume the last checkpoint, into it: the engine starts one version back and that load brings it
to the trainer's policy version, so recorded versions are right from the first call. vLLM 0.32's CPU
backend keeps a stale LM head on reload for models with tied embeddings: for Llama, Mistral and
Qwen2/3 checkpoints on a server that reads this machine's files the engine reloads through a view
that names the head (engines/vllm.py `tied_head_view`); train other tied models with the builtin
engine, or untie them.

Timeouts: a rollout stopped by the task's wall clock says how loaded the machine was as much as how
the policy did, so by default (`on_timeout="exclude"`) it is left out of the policy update, and
each step counts `timed_out` and `timed_out_excluded`; `on_timeout="zero"`, or a task with
`timeout_is_failure`, trains on it with reward 0. A harness that crashes is the policy's failure
(`on_failure`), and held-out evaluations score a timeout 0 as `openforge eval` does.

Each step's metrics time it: time/rollout (its rollouts, wherever they ran), time/wait (how long
the trainer waited for them: all of time/rollout when synchronous), time/train (the trainer's
step; time/update its optimizer loop alone), time/save, time/push, time/step (this step's wall
time in the loop) and time/wall (since the loop started); `timeline` holds wall-clock stamps
(rollout_start/end, train_start/end, pushed) to compare steps.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from openforgerl import behaviour
from openforgerl.engines.base import Engine
from openforgerl.rl import headroom
from openforgerl.rl.config import TrainOptions as TrainOptions
from openforgerl.rl.config import run_settings
from openforgerl.rl.runs import harness_choice, run_tasks, serving_run, step_tasks, training_tasks
from openforgerl.rl.trainer import MetricsLog, Rollout, Trainer, iter_checkpoints, passed
from openforgerl.rollouts.results import RolloutResult, Status
from openforgerl.rollouts.runner import check_images
from openforgerl.rollouts.service import Cancel, RolloutService
from openforgerl.rollouts.trajectory import NO_VERSION, Sample
from openforgerl.run.folder import SETTINGS, RunFolder
from openforgerl.tasks import Task, load_tasks

RUN_FILE = SETTINGS  # run.json (run/folder.py names every file of a run)


def load_settings(run_dir: Path) -> dict[str, Any]:
    """run.json's settings, each once (`run_settings`)."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run to resume ({RUN_FILE} is missing)")
    return run_settings(json.loads(path.read_text()))


def load_options(run_dir: Path) -> TrainOptions:
    return TrainOptions.from_json(load_settings(run_dir))


def ptx_demonstrations(opts: TrainOptions) -> list[Sample]:
    """The SFT samples of the ptx term, tokenised for the starting model ([] when ptx is off)."""
    if opts.trainer.ptx_coef <= 0:
        return []
    if not opts.ptx_data:
        raise ValueError("trainer.ptx_coef > 0 needs ptx_data: a file of SFT samples (--ptx-data)")
    from openforgerl.rl.sft import load_sft_data

    samples = list(load_sft_data(opts.ptx_data, opts.model))
    if any(s.image_digests for s in samples):  # the trainer reads images from the gateway's store
        raise ValueError(f"{opts.ptx_data}: demonstrations with images are not supported for ptx")
    return samples


def mixed_groups(results: Sequence[RolloutResult]) -> list[str]:
    """The tasks whose scored rollouts got at least two different rewards, in order of appearance:
    the groups with a GRPO signal (the trainer drops the others)."""
    rewards: dict[str, set[float]] = {}
    for r in results:
        if r.status == Status.DONE and r.reward is not None:
            rewards.setdefault(r.task_id, set()).add(r.reward)
    return [task for task, seen in rewards.items() if len(seen) > 1]


def curriculum_tasks(tasks: Sequence[Task], opts: TrainOptions) -> list[Task]:
    """The tasks of `opts.curriculum`: those the run's headroom measurement (headroom.json) found
    with mixed outcomes, a pass rate strictly between 0 and 1, in the order of `tasks`."""
    measured = headroom.read(opts.out)
    if measured is None:
        raise ValueError(f"curriculum: {opts.out} holds no headroom measurement (headroom_tasks)")
    rates = measured.task_pass_rates
    chosen = [t for t in tasks if 0.0 < rates.get(t.id, 0.0) < 1.0]
    if not chosen:
        raise ValueError(
            f"curriculum: none of the {len(rates)} measured tasks had mixed outcomes in "
            f"{measured.k} runs: nothing to train on (more --headroom-tasks, or another temperature)"
        )
    return chosen


def recorded_rollouts(results: Sequence[RolloutResult]) -> list[Rollout]:
    """The trainer's view of finished rollouts: each one's samples, and its reward (None: not
    scored). A dropped rollout is left out; one whose calls the gateway cannot give is an error."""
    out = []
    for r in results:
        if r.status == Status.DROPPED or not r.gateway_rollout_id:
            continue
        if r.calls is None:
            raise RuntimeError(f"the gateway gave no calls of rollout {r.gateway_rollout_id} ({r.key})")
        out.append(Rollout(r.task_id, r.reward if r.status == Status.DONE else None, r.samples))
    return out


def evaluate(
    service: RolloutService, opts: TrainOptions, tasks: Sequence[Task], step: int
) -> dict[str, float]:
    """pass@1 with greedy decoding on the held-out tasks, with the engine's current weights."""
    results = run_tasks(
        service,
        tasks,
        1,
        RunFolder(opts.out).eval_state(step),
        f"{opts.out.name}-eval{step}",
        opts,
        sampling={"temperature": 0.0},
        desc=f"eval after step {step}",
    )
    scored = [r.reward for r in results if r.status == Status.DONE and r.reward is not None]
    return {
        "eval/pass@1": sum(passed(x) for x in scored) / len(scored) if scored else 0.0,
        "eval/reward_mean": sum(scored) / len(scored) if scored else 0.0,
        "eval/tasks": len(scored),
        "eval/infra_failed": sum(r.status == Status.INFRA_FAILED for r in results),
        "eval/timed_out": sum(r.outcome == "timeout" for r in results),
    }


def _push(
    trainer: Trainer, engine: Engine, checkpoint: Path, loop: asyncio.AbstractEventLoop | None = None
) -> int:
    """Load `checkpoint` into the engine (an absolute path: a server resolves paths on its side),
    on `loop` when given: the gateway's, where a server engine's HTTP client lives."""
    push = trainer.push_weights(engine, checkpoint.resolve())
    if loop is None:
        return asyncio.run(push)
    if not loop.is_running():  # the gateway's thread has ended: nothing would ever run the push
        push.close()
        raise RuntimeError("the gateway's event loop is not running")
    return asyncio.run_coroutine_threadsafe(push, loop).result()


def _check_version(engine_version: int, trainer: Trainer) -> None:
    if engine_version != trainer.policy_version:
        raise RuntimeError(
            f"the engine is at policy version {engine_version}, the trainer at {trainer.policy_version}"
        )


@dataclass
class StepRollouts:
    """One step's finished rollouts as the trainer gets them, and when they ran."""

    step: int
    results: list[RolloutResult]
    rollouts: list[Rollout]
    started: float  # wall clock (time.time()): comparable across threads and resumed processes
    ended: float
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)


def collect_step(
    service: RolloutService,
    opts: TrainOptions,
    train_tasks: Sequence[Task],
    step: int,
    cancel: Cancel | None = None,
) -> StepRollouts:
    """Run (or, after a crash, finish) the rollouts of `step`: their results and the trainer's view.

    With dynamic sampling (`max_gen_batches` > 1) more batches of tasks are drawn, each with its
    own runner state (steps/N/gen-B), until `batch_tasks` groups have mixed rewards; the first
    `batch_tasks` of those are kept, and only they go to the trainer."""
    started, t0 = time.time(), time.monotonic()
    state_dir = RunFolder(opts.out).step_state(step)
    drawn: list[Task] = []
    results: list[RolloutResult] = []
    for batch in range(max(opts.max_gen_batches, 1)):
        tasks = step_tasks(train_tasks, step, opts.batch_tasks, opts.seed, batch, drawn)
        if not tasks:
            break  # every train task is drawn already
        drawn += tasks
        results += run_tasks(
            service,
            tasks,
            opts.group,
            state_dir / f"gen-{batch}" if batch else state_dir,
            f"{opts.out.name}-step{step}" + (f"-gen{batch}" if batch else ""),
            opts,
            desc=f"rollouts of step {step}" + (f" (batch {batch + 1})" if batch else ""),
            cancel=cancel,
            training=True,
        )
        if opts.max_gen_batches <= 1 or len(mixed_groups(results)) >= opts.batch_tasks:
            break
    # Stopped by the wall clock, and of those left out of the update (on_timeout "exclude").
    timed_out = [r for r in results if r.outcome == "timeout"]
    metrics: dict[str, Any] = {
        "timed_out": len(timed_out),
        "timed_out_excluded": sum(r.status == Status.DROPPED for r in timed_out),
    }
    kept = results
    if opts.max_gen_batches > 1:
        mixed = mixed_groups(results)
        chosen = set(mixed[: opts.batch_tasks])
        kept = [r for r in results if r.task_id in chosen]
        scored = [r.reward for r in results if r.status == Status.DONE and r.reward is not None]
        metrics |= {
            "dynamic/gen_batches": batch + 1,
            "dynamic/pass_rate_drawn": sum(map(passed, scored)) / len(scored) if scored else 0.0,
            "dynamic/groups_drawn": len(drawn),
            "dynamic/groups_mixed": len(mixed),
            "dynamic/groups_kept": len(chosen),
        }
    rollouts = recorded_rollouts(kept)
    return StepRollouts(step, results, rollouts, started, time.time(), time.monotonic() - t0, metrics)


class Prefetcher:
    """The rollouts of steps `first`..`last`, run in step order on a background thread.

    Step s starts only once `pushed(s - max_lag - 1)` was called (the weights of that step are in
    the engine), so its rollouts come from those weights or newer ones: trained at step s, with
    the weights of step s - 1, none lags by more than max_lag versions.
    """

    def __init__(
        self, collect: Callable[[int, Cancel], StepRollouts], first: int, last: int, max_lag: int
    ) -> None:
        self._collect = collect
        self._first, self._last, self._max_lag = first, last, max_lag
        self._cond = threading.Condition()
        self._pushed = first - 1  # a (resumed) run starts with the weights of step first - 1
        self._ready: dict[int, StepRollouts | BaseException] = {}
        self._stopping = False
        self._cancel = Cancel()
        self._thread = threading.Thread(target=self._run, name="openforge-rollouts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in range(self._first, self._last + 1):
            with self._cond:
                while not self._stopping and step > self._pushed + self._max_lag + 1:
                    self._cond.wait()
                if self._stopping:
                    return
            out: StepRollouts | BaseException
            try:
                out = self._collect(step, self._cancel)
            except BaseException as exc:  # handed to the trainer's thread, which raises it
                out = exc
            with self._cond:
                self._ready[step] = out
                self._cond.notify_all()
            if isinstance(out, BaseException):
                return

    def pushed(self, step: int) -> None:
        """The weights of `step` are in the engine."""
        with self._cond:
            self._pushed = step
            self._cond.notify_all()

    def get(self, step: int) -> StepRollouts:
        """The rollouts of `step`, once they are all finished."""
        with self._cond:
            while step not in self._ready:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout thread ended before step {step}")
                self._cond.wait(1.0)
            out = self._ready.pop(step)
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        """Stop: rollouts in flight are cancelled (their runner state says so; a resume redoes them)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._cancel.cancel()
        self._thread.join()


def lag_bound(
    rollouts: Sequence[Rollout], version: int, max_lag: int
) -> tuple[list[Rollout], dict[str, Any]]:
    """The rollouts none of whose samples lags the trainer's `version` by more than `max_lag`, and
    lag metrics on them: `lag/histogram` (samples by lag: version minus the sample's oldest token
    version), `lag/max`, `lag/mean` and `lag/stale_token_fraction` over loss tokens (each token's
    own version), and `lag/dropped_rollouts`. Tokens without a version count as current."""
    kept: list[Rollout] = []
    dropped = worst = 0
    histogram: dict[int, int] = {}
    tokens = lag_sum = stale = 0
    for r in rollouts:
        oldest = [v for s in r.samples if s.num_loss_tokens and (v := s.min_policy_version) is not None]
        if oldest and version - min(oldest) > max_lag:
            dropped += 1
            continue
        kept.append(r)
        for s in r.samples:
            if not s.num_loss_tokens:
                continue
            oldest_v = s.min_policy_version
            lag = 0 if oldest_v is None else version - oldest_v
            histogram[lag] = histogram.get(lag, 0) + 1
            worst = max(worst, lag)
            for m, v in zip(s.loss_mask, s.policy_versions, strict=True):
                if m:
                    tokens += 1
                    if v != NO_VERSION:
                        lag_sum += version - v
                        stale += v < version
    return kept, {
        "lag/histogram": {str(k): histogram[k] for k in sorted(histogram)},
        "lag/max": worst,
        "lag/mean": lag_sum / tokens if tokens else 0.0,
        "lag/stale_token_fraction": stale / tokens if tokens else 0.0,
        "lag/dropped_rollouts": dropped,
    }


def train(opts: TrainOptions, *, resume: bool = False) -> dict[str, Any]:
    """Run (or, with `resume`, continue) the loop up to `opts.steps`; returns a summary. The run
    folder's status.json says running, then finished, failed or interrupted (openforgerl.run_status)."""
    if opts.max_lag < 0:
        raise ValueError(f"max_lag must be at least 0, not {opts.max_lag}")
    if opts.max_gen_batches < 1:
        raise ValueError(f"max_gen_batches must be at least 1, not {opts.max_gen_batches}")
    if opts.max_gen_batches > 1 and not opts.trainer.drop_zero_variance:
        raise ValueError(
            "dynamic sampling (max_gen_batches > 1) keeps mixed groups only: it cannot "
            "also train on equal-reward groups (drop_zero_variance=False)"
        )
    if not resume and (opts.out / RUN_FILE).exists():  # another run's folder: its status is left alone
        raise FileExistsError(
            f"{opts.out} already holds a run: resume it with --resume, or pick another --out"
        )
    with RunFolder(opts.out).recording("train", tasks=opts.tasks, harness=opts.harness, steps=opts.steps):
        return _train(opts, resume=resume)


def _train(opts: TrainOptions, *, resume: bool) -> dict[str, Any]:
    harness = harness_choice(opts)  # an unknown harness fails here, before a model is loaded
    run = RunFolder(opts.out)
    run_dir = run.path  # train() refused another run's folder already
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps(opts.to_json(), indent=2))
    train_tasks = training_tasks(opts)
    eval_tasks: list[Task] = []
    if opts.eval_every:
        eval_tasks = load_tasks(opts.tasks, split=opts.eval_split)[: opts.eval_limit]  # type: ignore[arg-type]
    harness.check([*train_tasks, *eval_tasks])  # a missing CLI too
    check_images([*train_tasks, *eval_tasks], opts.backend.name)  # tasks bound to an image: not local

    demonstrations = ptx_demonstrations(opts)
    log = MetricsLog(run_dir)
    trainer, model_dir = _start_trainer(opts, run, log, demonstrations)
    t_start = time.monotonic()
    try:
        # The engine at the trainer's policy version (a server is loaded with model_dir first,
        # before any rollout and before the prefetcher starts), its gateway, the rollouts on it.
        with serving_run(opts, model_dir, policy_version=trainer.policy_version) as stack:
            engine, gw, service = stack.engine, stack.gateway, stack.service
            # A vision-language policy's samples name their images by digest; the gateway's store
            # keeps the bytes the engine saw, so the trainer recomputes logprobs on the same pixels.
            trainer.policy.image_source = gw.gateway.core.store.images_sync
            if trainer.step == 0 and 0 not in log.steps():  # the starting policy, as step 0
                start: dict[str, Any] = {}
                if opts.headroom_tasks > 0:
                    start.update(headroom.before_training(service, opts, train_tasks))
                if opts.eval_every:
                    start.update(evaluate(service, opts, eval_tasks, 0))
                if start:
                    log.write(0, {"policy_version": 0, **start})

            pool = curriculum_tasks(train_tasks, opts) if opts.curriculum else train_tasks

            def collect(step: int, cancel: Cancel | None = None) -> StepRollouts:
                return collect_step(service, opts, pool, step, cancel)

            first = trainer.step + 1
            prefetch = None
            if opts.overlap and first <= opts.steps:
                prefetch = Prefetcher(collect, first, opts.steps, opts.max_lag)
            t_loop = time.monotonic()
            try:
                bar = tqdm(range(first, opts.steps + 1), desc="train", unit="step", disable=not opts.progress)
                for step in bar:
                    t0 = time.monotonic()
                    batch = prefetch.get(step) if prefetch else collect(step)
                    waited = time.monotonic() - t0
                    metrics = _train_on(batch, engine, trainer, opts, waited, loop=gw.loop)
                    if prefetch:
                        prefetch.pushed(step)
                    metrics["time/step"] = time.monotonic() - t0
                    metrics["time/wall"] = time.monotonic() - t_loop
                    if opts.eval_every and step % opts.eval_every == 0:
                        t1 = time.monotonic()
                        metrics.update(evaluate(service, opts, eval_tasks, step))
                        metrics["time/eval"] = time.monotonic() - t1
                    log.write(step, metrics)
                    if opts.progress:
                        bar.write(step_line(step, metrics))
                    _prune(run.checkpoints, opts.keep_checkpoints)
            finally:
                if prefetch is not None:
                    prefetch.close()  # before the gateway goes away under its rollouts
    finally:
        log.close()
    final = list(iter_checkpoints(run.checkpoints))
    return {
        "steps": trainer.step,
        "policy_version": trainer.policy_version,
        "checkpoint": str(final[-1][1]) if final else None,
        "metrics": str(log.path),
        "seconds": round(time.monotonic() - t_start, 1),
    }


def _start_trainer(
    opts: TrainOptions, run: RunFolder, log: MetricsLog, demonstrations: list[Sample]
) -> tuple[Trainer, Path]:
    """The trainer, from the run's last checkpoint when it has one (resume) or from the starting
    model, and the weights the engine starts on."""
    checkpoints = list(iter_checkpoints(run.checkpoints))
    if not checkpoints:
        trainer = Trainer(
            opts.model,
            opts.trainer,
            group_size=opts.group,
            temperature=opts.temperature,
            seed=opts.seed,
            demonstrations=demonstrations,
        )
        return trainer, Path(opts.model)
    last_step, last = checkpoints[-1]
    trainer = Trainer.resume(
        last,
        opts.trainer,
        group_size=opts.group,
        reference_dir=opts.model,
        temperature=opts.temperature,
        seed=opts.seed,
        demonstrations=demonstrations,
    )
    state = json.loads((last / "trainer_state.json").read_text())
    if last_step not in log.steps() and "metrics" in state:
        log.write(last_step, state["metrics"])  # the crash came between checkpoint and log
    return trainer, last


def _train_on(
    batch: StepRollouts,
    engine: Engine,
    trainer: Trainer,
    opts: TrainOptions,
    waited: float,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
) -> dict[str, Any]:
    """Train one step on `batch`, save the checkpoint and load it into the engine (on `loop`, the
    gateway's, when given)."""
    step = batch.step
    rollouts, lag = lag_bound(batch.rollouts, trainer.policy_version, opts.max_lag)
    train_start, t0 = time.time(), time.monotonic()
    metrics = trainer.train_step(rollouts)
    train_end = time.time()
    metrics["time/update"] = metrics.pop("time/train", 0.0)  # the trainer's optimizer loop alone
    metrics["time/train"] = time.monotonic() - t0
    metrics.update(lag)
    metrics["time/rollout"] = batch.seconds
    metrics["time/wait"] = waited
    metrics["rollout_tokens"] = sum(len(s.input_ids) for r in batch.rollouts for s in r.samples)
    metrics["outcomes"] = _count(r.outcome or r.status.value for r in batch.results)
    # How the rollouts acted (tool errors met, recovered, gave up: openforgerl.behaviour).
    acted = behaviour.aggregate(r.details["behaviour"] for r in batch.results if r.details.get("behaviour"))
    metrics.update({f"behaviour/{k}": v for k, v in acted.items() if isinstance(v, int | float)})
    metrics.update(batch.metrics)
    t1 = time.monotonic()
    checkpoint = RunFolder(opts.out).checkpoint(step)
    trainer.save(checkpoint, metrics=metrics)
    metrics["time/save"] = time.monotonic() - t1
    if metrics["updated"]:
        t2 = time.monotonic()
        _check_version(_push(trainer, engine, checkpoint, loop), trainer)
        metrics["time/push"] = time.monotonic() - t2
    # Wall-clock stamps, nested so TensorBoard leaves them out: they show how steps overlapped.
    metrics["timeline"] = {
        "rollout_start": batch.started,
        "rollout_end": batch.ended,
        "train_start": train_start,
        "train_end": train_end,
        "pushed": time.time(),
    }
    return metrics


def step_line(step: int, metrics: dict[str, Any]) -> str:
    """One step in a line, as `openforge train` prints it: rewards, and the rollouts the clock stopped."""
    m = metrics
    line = (
        f"step {step}: reward {m.get('reward_mean', 0.0):.3f}, pass {m.get('pass_rate', 0.0):.3f}, "
        f"{m.get('rollouts', 0)} rollouts to the trainer; timed out {m.get('timed_out', 0)}"
    )
    if m.get("timed_out_excluded"):
        line += f" ({m['timed_out_excluded']} left out)"
    if "eval/pass@1" in m:
        line += f"; held-out pass@1 {m['eval/pass@1']:.3f}"
    return line


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (at least one always stays: resume needs it)."""
    found = list(iter_checkpoints(root))
    for _, path in found[: max(0, len(found) - max(keep, 1))]:
        shutil.rmtree(path, ignore_errors=True)
