"""A real pretrained model through the whole loop: SmolLM2-135M-Instruct learns tools-tiny.

    .venv/bin/python benchmarks/real_model.py [--out runs/real-model] [--quick]
    .venv/bin/python benchmarks/real_model.py --harness pi --skip-speed --out runs/real-model-pi

Phases (each leaves its output in --out and is skipped when that output exists, so a rerun continues):
1. speed    the built-in engine's decode tokens/s at batch 1 and 8, with OMP_WAIT_POLICY PASSIVE
            (the package's default) and ACTIVE, each alone and beside a busy process on the other
            core; the trainer's tokens/s and peak memory for a full fine-tune, LoRA r=16, and each
            with gradient checkpointing (8 rows x 512 tokens). Each measurement runs in a fresh
            process: the OpenMP policy is read when torch loads, and peak memory is per process.
2. teacher  the ORACLE teacher's trajectories on train tasks, recorded in SmolLM2's template
3. eval     held-out pass@1 of the untouched model (sampled at the RL temperature, n per task)
4. sft      a full fine-tune on the teacher's trajectories
5. eval     held-out pass@1 after SFT
6. rl       GRPO (`openforge train`) from the SFT model, the model generating every turn
7. eval     held-out pass@1 after RL

`--harness NAME` runs phases 2-7 inside that agent CLI (installed with `openforge harness install`):
the teacher acts through its tools, the student generates every turn inside it.

Results: benchmarks/results/real_model.json, or real_model_NAME.json for another harness (and the
run folder's timings). Model time dominates:
this is a CPU run of a 135M model, sized to finish in about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import in_fresh_process

RESULTS = Path(__file__).resolve().parent / "results" / "real_model.json"
MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass
class Config:
    out: Path = Path("runs/real-model")
    harness: str = "react"
    teacher_tasks: int = 96
    sft_epochs: int = 1
    sft_batch: int = 8
    sft_lr: float = 5e-5
    rl_steps: int = 3
    rl_group: int = 4
    rl_batch_tasks: int = 4
    rl_lr: float = 1e-5
    eval_tasks: int = 16
    eval_n: int = 2
    temperature: float = 0.7
    max_tokens: int = 96
    max_turns: int = 4
    concurrency: int = 8
    seed: int = 0


QUICK = {
    "teacher_tasks": 8,
    "rl_steps": 1,
    "rl_group": 2,
    "rl_batch_tasks": 1,
    "eval_tasks": 2,
    "eval_n": 1,
    "max_tokens": 32,
    "max_turns": 2,
}


# -- 1. speed: each measurement in a fresh process ----------------------------------------------


def _engine_speed(model: str, batch: int, tokens: int) -> dict[str, Any]:
    """Decode tokens/s of the built-in engine: `batch` concurrent requests of `tokens` tokens."""
    import asyncio

    from openforgerl.engines.base import SamplingParams
    from openforgerl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(model, threads=2, prefix_cache_mb=0)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=1)

    async def go() -> tuple[float, float, int]:
        await engine.start()
        try:
            await engine.generate(prompt, SamplingParams(max_tokens=4))  # warm-up
            t0 = time.perf_counter()
            first = await engine.generate(prompt, SamplingParams(max_tokens=1))
            prefill = time.perf_counter() - t0
            assert first.completion_ids
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(engine.generate(prompt, dataclasses.replace(params, seed=i)) for i in range(batch))
            )
            return prefill, time.perf_counter() - t0, sum(len(r.completion_ids) for r in results)
        finally:
            await engine.close()

    import torch

    torch.manual_seed(0)
    prefill, seconds, generated = asyncio.run(go())
    return {
        "batch": batch,
        "tokens": generated,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(generated / seconds, 2),
        "step_ms": round(1000 * seconds / (generated / batch), 1),
        "prompt_tokens": len(prompt),
        "prefill_s": round(prefill, 3),
    }


def _trainer_speed(model: str, lora_rank: int, checkpointing: bool, rows: int, length: int) -> dict[str, Any]:
    """Tokens/s of one SFT update (forward, backward, AdamW) on rows x length tokens."""
    import torch

    from openforgerl.rl.trainer import Policy, Tuning
    from openforgerl.rollouts.trajectory import NO_VERSION, Sample

    torch.set_num_threads(2)
    policy = Policy(model, lr=1e-5, tuning=Tuning(lora_rank=lora_rank, gradient_checkpointing=checkpointing))
    g = torch.Generator().manual_seed(0)
    vocab = (
        policy.model.config.vocab_size if lora_rank == 0 else policy.model.base_model.model.config.vocab_size
    )
    samples = []
    for i in range(rows):  # distinct rows: no shared prefix
        ids = torch.randint(100, vocab, (length,), generator=g).tolist()
        samples.append(
            Sample(
                rollout_id=str(i),
                reward=0.0,
                branch_id=0,
                branch_reason="",
                input_ids=ids,
                loss_mask=[0] * (length // 2) + [1] * (length - length // 2),
                logprobs=[0.0] * length,
                policy_versions=[NO_VERSION] * length,
            )
        )
    policy.sft_loss(samples[:1], budget=length, backward_scale=1.0)  # warm-up: one row
    policy.clip_and_step(1.0)
    t0 = time.perf_counter()
    policy.sft_loss(samples, budget=rows * length, backward_scale=1.0)
    policy.clip_and_step(1.0)
    seconds = time.perf_counter() - t0
    return {
        "lora_rank": lora_rank,
        "gradient_checkpointing": checkpointing,
        "rows": rows,
        "length": length,
        "trainable_params": sum(p.numel() for p in policy.model.parameters() if p.requires_grad),
        "seconds_per_update": round(seconds, 2),
        "tokens_per_s": round(rows * length / seconds, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def _in_subprocess(kind: str, env: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    result: dict[str, Any] = in_fresh_process("real_model", f"_{kind}", env=env, **kw)
    return result


def _busy_core() -> subprocess.Popen[bytes]:
    """A process that keeps one core busy: the harnesses and sandboxes beside the engine."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def speed(model: Path, quick: bool) -> dict[str, Any]:
    tokens = 16 if quick else 64
    engine = []
    for loaded in (False, True):
        for policy in ("PASSIVE", "ACTIVE"):
            for batch in (1, 8):
                busy = _busy_core() if loaded else None
                try:
                    r = _in_subprocess(
                        "engine_speed",
                        {"OMP_WAIT_POLICY": policy},
                        model=str(model),
                        batch=batch,
                        tokens=tokens,
                    )
                finally:
                    if busy:
                        busy.kill()
                        busy.wait()
                r.update(omp_wait_policy=policy, other_core_busy=loaded)
                print(json.dumps(r), flush=True)
                engine.append(r)
    trainer = []
    rows, length = (2, 128) if quick else (8, 512)
    for lora, ckpt in ((0, False), (16, False), (0, True), (16, True)):
        r = _in_subprocess(
            "trainer_speed", model=str(model), lora_rank=lora, checkpointing=ckpt, rows=rows, length=length
        )
        print(json.dumps(r), flush=True)
        trainer.append(r)
    return {"engine": engine, "trainer": trainer}


# -- 2-7. the learning run ----------------------------------------------------------------------


def _phase(name: str, path: Path, seconds: dict[str, float], fn: Callable[[], Any]) -> Any:
    if path.exists():
        print(f"[{name}] done already: skipped", flush=True)
        return json.loads(path.read_text())
    print(f"[{name}] ...", flush=True)
    t0 = time.monotonic()
    result = fn()
    seconds[name] = round(time.monotonic() - t0, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"[{name}] {seconds[name]:.0f} s", flush=True)
    return result


def _evaluate(cfg: Config, model: Path, name: str) -> dict[str, Any]:
    from openforgerl.evaluate import EvalOptions, run_eval

    report = run_eval(
        EvalOptions(
            tasks="tools-tiny",
            harness=cfg.harness,
            split="heldout",
            limit=cfg.eval_tasks,
            model=str(model),
            out=cfg.out / "eval" / name,
            k=cfg.eval_n,
            n=cfg.eval_n,
            temperature=cfg.temperature,
            seed=cfg.seed,  # the same random numbers for every model: paired comparisons
            max_tokens=cfg.max_tokens,
            max_turns=cfg.max_turns,
            concurrency=cfg.concurrency,
            progress=False,
        )
    )
    s = report["summary"]
    return {
        "pass@1": s["pass@k"]["1"],
        "mean_reward": s["mean_reward"],
        "rollouts": report["rollouts"],
        "outcomes": report["outcomes"],
        "tokens": report["tokens"],
        "seconds": report["seconds"],
        "acting": report.get("acting", {}).get("all", {}),
        "per_task": {t["task_id"]: t["pass@k"]["1"] for t in s["per_task"]},
    }


def run(cfg: Config, quick: bool, skip_speed: bool = False) -> dict[str, Any]:
    from openforgerl.eval_stats import paired_difference
    from openforgerl.modelkit.pretrained import cached_pretrained
    from openforgerl.rl.loop import TrainOptions, train
    from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data, oracle_samples, write_samples
    from openforgerl.rl.trainer import TrainerConfig

    out = cfg.out.resolve()
    cfg = dataclasses.replace(cfg, out=out)
    out.mkdir(parents=True, exist_ok=True)
    seconds_file = out / "timings.json"
    seconds: dict[str, float] = json.loads(seconds_file.read_text()) if seconds_file.exists() else {}

    def save() -> None:
        seconds_file.write_text(json.dumps(seconds, indent=2))

    t0 = time.monotonic()
    model = cached_pretrained(MODEL)
    seconds.setdefault("convert (cached after the first run)", round(time.monotonic() - t0, 1))
    speeds = None if skip_speed else _phase("speed", out / "speed.json", seconds, lambda: speed(model, quick))
    save()

    teacher_file = out / "teacher" / "samples.jsonl"

    def teacher() -> dict[str, Any]:
        samples = oracle_samples(
            model,
            out / "teacher",
            limit=cfg.teacher_tasks,
            max_turns=6,
            concurrency=cfg.concurrency,
            progress=False,
            harness=cfg.harness,
        )
        write_samples(samples, teacher_file)
        lengths = sorted(len(s.input_ids) for s in samples)
        return {"samples": len(samples), "tokens": sum(lengths), "median_length": lengths[len(lengths) // 2]}

    teacher_info = _phase("teacher", out / "teacher.json", seconds, teacher)
    save()
    evals = {
        "before": _phase(
            "eval-before", out / "eval-before.json", seconds, lambda: _evaluate(cfg, model, "before")
        )
    }
    save()

    sft_dir = out / "sft"

    def sft() -> dict[str, Any]:
        trainer = SFTTrainer(
            model, SFTConfig(lr=cfg.sft_lr, epochs=cfg.sft_epochs, batch_size=cfg.sft_batch, seed=cfg.seed)
        )
        samples = load_sft_data(teacher_file, trainer.policy.tokenizer)
        summary = trainer.fit(samples, sft_dir, progress=False)
        tokens = sum(len(s.input_ids) for s in samples) * cfg.sft_epochs
        return {**summary, "tokens": tokens, "tokens_per_s": round(tokens / summary["seconds"], 1)}

    sft_info = _phase("sft", out / "sft.json", seconds, sft)
    save()
    evals["sft"] = _phase("eval-sft", out / "eval-sft.json", seconds, lambda: _evaluate(cfg, sft_dir, "sft"))
    save()

    rl_dir = out / "rl"

    def rl() -> dict[str, Any]:
        opts = TrainOptions(
            model=str(sft_dir),
            out=rl_dir,
            tasks="tools-tiny",
            harness=cfg.harness,
            skip_tasks=cfg.teacher_tasks,  # RL on tasks the teacher did not solve
            steps=cfg.rl_steps,
            group=cfg.rl_group,
            batch_tasks=cfg.rl_batch_tasks,
            max_tokens=cfg.max_tokens,
            max_turns=cfg.max_turns,
            concurrency=cfg.concurrency,
            temperature=cfg.temperature,
            seed=cfg.seed,
            progress=False,
            trainer=TrainerConfig(lr=cfg.rl_lr),  # the run's temperature and seed
        )
        summary = train(opts, resume=(rl_dir / "run.json").exists())
        steps = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines()]
        return {**summary, "steps_metrics": steps}

    rl_info = _phase("rl", out / "rl.json", seconds, rl)
    save()
    rl_model = Path(rl_info["checkpoint"])
    evals["rl"] = _phase("eval-rl", out / "eval-rl.json", seconds, lambda: _evaluate(cfg, rl_model, "rl"))
    save()

    def gain(a: str, b: str) -> dict[str, float] | None:
        try:
            return paired_difference(evals[a]["per_task"], evals[b]["per_task"]).as_dict()
        except ValueError:
            return None

    result = {
        "model": MODEL,
        "harness": cfg.harness,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "quick": quick,
        "heldout_pass@1": {k: v["pass@1"] for k, v in evals.items()},
        "paired_gain": {"sft_minus_before": gain("before", "sft"), "rl_minus_sft": gain("sft", "rl")},
        "evals": evals,
        "teacher": teacher_info,
        "sft": {k: v for k, v in sft_info.items() if k != "model"},
        "rl": {k: rl_info[k] for k in ("steps", "policy_version", "steps_metrics") if k in rl_info},
        "speed": speeds,
        "seconds": seconds,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Config.out)
    ap.add_argument("--quick", action="store_true", help="toy sizes: proves the pipeline, not learning")
    ap.add_argument("--harness", default="react", help="the harness every phase runs inside")
    ap.add_argument("--skip-speed", action="store_true", help="leave out phase 1 (the speeds)")
    ap.add_argument(
        "--results", type=Path, default=None, help="[default: benchmarks/results/real_model*.json]"
    )
    numeric = [f for f in dataclasses.fields(Config) if f.type in ("int", "float")]
    for f in numeric:
        flag, kind = f"--{f.name.replace('_', '-')}", int if f.type == "int" else float
        ap.add_argument(flag, type=kind, default=None)
    args = ap.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in numeric if getattr(args, f.name) is not None}
    cfg = Config(out=args.out, harness=args.harness, **{**(QUICK if args.quick else {}), **overrides})
    result = run(cfg, args.quick, args.skip_speed)
    text = json.dumps(result, indent=2)
    results = args.results or RESULTS.with_name(
        "real_model.json" if args.harness == "react" else f"real_model_{args.harness.replace('-', '_')}.json"
    )
    if not args.quick:
        results.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
