"""What a run folder holds: every file a run writes, named here once, and the run's status.

    run = RunFolder(out)
    run.settings          run.json: `openforge train`'s settings (read back by --resume)
    run.status_file       status.json: running, finished, failed or interrupted (run_status.py)
    run.gateway_store     gateway.db: every call the run's embedded gateway recorded
    run.runner_state      runner.db: the runner's durable state (finished rollouts are not redone)
    run.metrics           metrics.jsonl: one JSON object per training step (`step` key)
    run.report, .report_md  report.json / report.md: an evaluation's figures (`openforge eval`)
    run.study, .study_md  study.json / study.md: the harness study's (each harness in NAME/)
    run.samples           samples.jsonl: training samples (`openforge rollout`, rejection sampling)
    run.teacher           teacher/: SFT's teacher run, a run folder of its own (its samples.jsonl)
    run.headroom          headroom.json: the starting policy measured (rl/headroom.py)
    run.checkpoint(step)  checkpoints/step-NNNNNN: weights, tokenizer, optimizer, trainer state
    run.step_state(step)  steps/NNNNNN: the runner's state of one RL step
    run.eval_state(step)  evals/NNNNNN: a held-out evaluation after one RL step
    run.timings           timings.json: the demo's seconds per phase (folders before status.json)
    run.phase(name)       a phase's folder in a run made of phases (the demo: model, teacher, sft, rl)
    run.evaluation(key)   eval/KEY: one of its evaluations; sft_summary.json, rl_summary.json and
                          reward_curve.png are the demo's (demo/)

The viewer (ui/) finds runs by these names (`RUN_MARKERS`) and leaves a run's own folders
(`OWN_FOLDERS`) alone. The trainer's metrics log and checkpoint files keep their names in
rl/trainer.py and rl/policy.py (METRICS is the same name).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openforgerl.run_status import STATUS_FILE, RunRecord, read_status, recording

SETTINGS = "run.json"
STATUS = STATUS_FILE  # "status.json"
GATEWAY_STORE = "gateway.db"
RUNNER_STATE = "runner.db"
METRICS = "metrics.jsonl"
REPORT = "report.json"
REPORT_MD = "report.md"
STUDY = "study.json"  # the harness study's side-by-side report (`openforge eval --harness a,b`)
STUDY_MD = "study.md"
HEADROOM = "headroom.json"
TIMINGS = "timings.json"
EVALS_INDEX = "evals.jsonl"  # a run's list of its evaluations (the viewer's; ui/__init__.py)
SAMPLES = "samples.jsonl"  # training samples (`openforge rollout`, rejection sampling)
TEACHER = "teacher"  # SFT's teacher run (`openforge sft --teacher`, the demo): its samples.jsonl
HELDOUT_SAMPLES = "heldout.jsonl"  # the teacher's held-out trajectories (SFT's validation loss)
# A run of phases (the demo): each phase's output in a folder of its own, the evaluations under eval/.
PHASE_EVALS = "eval"
SFT_SUMMARY = "sft_summary.json"
RL_SUMMARY = "rl_summary.json"
REWARD_CURVE = "reward_curve.png"
CHECKPOINTS = "checkpoints"
STEPS = "steps"
EVALS = "evals"
HEADROOM_STATE = "headroom"  # the headroom measurement's runner state
TENSORBOARD = "tensorboard"

# A folder holding any of these is a run (config.*: runs of other trainers the viewer also reads).
RUN_MARKERS = (
    METRICS,
    REPORT,
    RUNNER_STATE,
    GATEWAY_STORE,
    "config.json",
    "config.yaml",
    "config.yml",
    STATUS,
    EVALS_INDEX,
)
# Folders a run keeps for itself, never runs of their own.
OWN_FOLDERS = frozenset({CHECKPOINTS, STEPS, EVALS, HEADROOM_STATE, TENSORBOARD})


@dataclass(frozen=True)
class RunFolder:
    """One run's folder, and where each of its files lies."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def settings(self) -> Path:
        return self.path / SETTINGS

    @property
    def status_file(self) -> Path:
        return self.path / STATUS

    @property
    def gateway_store(self) -> Path:
        return self.path / GATEWAY_STORE

    @property
    def runner_state(self) -> Path:
        return self.path / RUNNER_STATE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def report(self) -> Path:
        return self.path / REPORT

    @property
    def report_md(self) -> Path:
        return self.path / REPORT_MD

    @property
    def study(self) -> Path:
        return self.path / STUDY

    @property
    def study_md(self) -> Path:
        return self.path / STUDY_MD

    @property
    def headroom(self) -> Path:
        return self.path / HEADROOM

    @property
    def headroom_state(self) -> Path:
        return self.path / HEADROOM_STATE

    @property
    def timings(self) -> Path:
        return self.path / TIMINGS

    @property
    def samples(self) -> Path:
        return self.path / SAMPLES

    @property
    def teacher(self) -> RunFolder:
        """The teacher's own run, inside this one (its rollouts, gateway store, samples)."""
        return RunFolder(self.path / TEACHER)

    @property
    def heldout_samples(self) -> Path:
        return self.path / HELDOUT_SAMPLES

    def phase(self, name: str) -> RunFolder:
        """The folder of one phase of a run made of phases (the demo's model, sft, rl...)."""
        return RunFolder(self.path / name)

    def evaluation(self, key: str) -> RunFolder:
        """eval/KEY: one evaluation of a run made of phases, an `openforge eval` run folder."""
        return RunFolder(self.path / PHASE_EVALS / key)

    @property
    def sft_summary(self) -> Path:
        return self.path / SFT_SUMMARY

    @property
    def rl_summary(self) -> Path:
        return self.path / RL_SUMMARY

    @property
    def reward_curve(self) -> Path:
        return self.path / REWARD_CURVE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def step_state(self, step: int) -> Path:
        return self.path / STEPS / f"{step:06d}"

    def eval_state(self, step: int) -> Path:
        return self.path / EVALS / f"{step:06d}"

    def status(self) -> dict[str, Any] | None:
        """status.json as written (None: the folder has none); `run_status.effective_state` says
        whether a "running" one's process is still there."""
        return read_status(self.path)

    def recording(self, kind: str, **about: Any) -> AbstractContextManager[RunRecord]:
        """status.json kept for the block: running, then finished, failed or interrupted."""
        return recording(self.path, kind, **about)
