"""RL throughput on this machine, against its own limits (issue #34): one run, side by side.

    .venv/bin/python benchmarks/rl_throughput.py [--quick] [--model SFT_DIR] [--out runs/rl-throughput]

What it measures, each in a fresh process (OpenMP settings are read when torch loads; the runs
must not share warm caches):
- peak       a large torch matmul, fp32 and bf16 GFLOPS on the engine's thread count: the
             denominator of every MFU below. bf16 only where the CPU multiplies it in hardware
             (AVX512_BF16, AMX, Arm BF16; `native_bf16` in the JSON): elsewhere torch emulates it,
             hundreds of times slower, and every bf16 figure below is left out
- engine     decode tokens/s at batch 1, 8, 16, 32 of the built-in engine and of vLLM's CPU build
             (`.venv-vllm`, from `make test-vllm`, when it is there), each in fp32 and bf16; decode
             alone: the time of a max_tokens=1 batch (the prefill) is taken off
- trainer    tokens/s of one update (forward, backward, AdamW) in fp32 and under bf16 autocast, and
             its MFU against the peak of the precision it computes in (6 x params FLOPs a token);
             with --trainer-detail also each precision's profile (operators by self CPU time) and
             its speed under torch.compile
- rl         GRPO steps of SmolLM2-135M-Instruct (after SFT) on tools-tiny through `openforge
             train`: today's default path (`baseline`) beside the fastest settings measured
             (`fast`) and the same generating on vLLM's CPU build in fp32 and bf16 (`vllm`,
             `vllm-bf16`, when `.venv-vllm` is there), each also with `--overlap`, same tasks, seed and
             model (`--paths` picks); `rl` is the fastest of them; rollouts/hour, the
             step split into rollout, update and weight push, and the engine/trainer logprob
             agreement of each path

Without --model the SFT student is made first (96 oracle demonstrations, one epoch, as
benchmarks/real_model.py does) and kept in --out. Prints one JSON object and writes it to
benchmarks/results/rl_throughput.json (--quick: rl_throughput_quick.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import in_fresh_process

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
THREADS = 2
SMOLLM2_PARAMS = 134_515_008  # its matmul weights, the tied LM head included (gpu_students.json)


def _in_fresh_process(fn: str, *args: Any) -> Any:
    return in_fresh_process("rl_throughput", fn, *args, env={"OMP_WAIT_POLICY": "PASSIVE"})


# -- peak --------------------------------------------------------------------------------------


def native_bf16() -> bool:
    """Whether this CPU has a bf16 matmul in hardware; without one torch emulates bf16 (a 2048^2
    matmul took 67 s against 0.14 s in fp32 on an AVX2 EPYC), so nothing here measures bf16."""
    from openforgerl.rl.policy import cpu_has_native_bf16

    return cpu_has_native_bf16()


def peak(n: int, precisions: list[str]) -> dict[str, float]:
    """GFLOPS of an n x n matmul, the median of 5, in each of `precisions` (fp32, bf16)."""
    import torch

    torch.set_num_threads(THREADS)
    out = {}
    for name in precisions:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(2):
            a @ b
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        out[name] = round(2 * n**3 / statistics.median(times) / 1e9, 1)
    return out


# -- engine ------------------------------------------------------------------------------------


def _prompt(tokenizer: Any) -> list[int]:
    # About the length of a ReAct harness's first call on tools-tiny (~400 tokens).
    text = "Write a long story about a lighthouse keeper. " * 40
    ids: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return ids


async def _decode_rates(
    engine: Any, prompt: list[int], batches: list[int], tokens: int
) -> list[dict[str, Any]]:
    import asyncio

    from openforgerl.engines.base import SamplingParams

    async def batch_of(b: int, max_tokens: int) -> tuple[float, int]:
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(b)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        return time.perf_counter() - t0, sum(len(r.completion_ids) for r in results)

    await batch_of(1, 4)  # warm-up
    rows = []
    for b in batches:
        prefill_s, _ = await batch_of(b, 1)
        total_s, generated = await batch_of(b, tokens)
        decoded = generated - b  # the first token of each row came with the prefill
        rate = decoded / max(total_s - prefill_s, 1e-9)
        rows.append(
            {
                "batch": b,
                "decode_tokens_per_s": round(rate, 1),
                "prefill_s": round(prefill_s, 2),
                "seconds": round(total_s, 2),
                "tokens": generated,
                "mfu": None,  # filled in against the peak
            }
        )
    return rows


def builtin_engine(model: str, dtype: str, batches: list[int], tokens: int) -> list[dict[str, Any]]:
    import asyncio

    from openforgerl.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(
        model, threads=THREADS, dtype=dtype, max_batch_size=max(batches), prefix_cache_mb=0
    )

    async def go() -> list[dict[str, Any]]:
        await engine.start()
        try:
            return await _decode_rates(engine, _prompt(engine.tokenizer), batches, tokens)
        finally:
            await engine.close()

    return asyncio.run(go())


def vllm_env(dtype: str, max_seqs: int) -> dict[str, str]:
    """What `--engine vllm` (engines/vllm_server.py) needs to start vLLM's CPU build from
    `.venv-vllm`, computing in `dtype` (float32, bfloat16), for up to `max_seqs` sequences at once."""
    return {
        "OPENFORGE_VLLM_PYTHON": str(VLLM_PYTHON),
        "OPENFORGE_VLLM_ARGS": f"--dtype {dtype} --max-model-len 2048 --max-num-seqs {max_seqs}",
        "HF_HUB_OFFLINE": "1",
    }


def vllm_engine(model: str, batches: list[int], tokens: int, log: str, dtype: str) -> dict[str, Any]:
    """The same measurement against vLLM's CPU build, on the server `--engine vllm` starts."""
    import asyncio

    from transformers import AutoTokenizer

    from openforgerl.engines.vllm_server import LocalVLLMEngine

    os.environ.update(vllm_env(dtype, max(batches)))
    prompt = _prompt(AutoTokenizer.from_pretrained(model))

    async def go() -> dict[str, Any]:
        engine = LocalVLLMEngine(model, log=log)
        t0 = time.monotonic()
        await engine.start()
        ready_s = round(time.monotonic() - t0, 1)
        try:
            return {"ready_s": ready_s, "rows": await _decode_rates(engine, prompt, batches, tokens)}
        finally:
            await engine.close()

    return asyncio.run(go())


# -- trainer -----------------------------------------------------------------------------------


def _update(model: str, precision: str, rows: int, length: int, compiled: bool = False) -> Any:
    """One update (forward, backward, AdamW) on rows x length random tokens, half of each row in
    the loss, through the trainer's own Policy; returns a function that runs it."""
    import torch

    from openforgerl.rl import algos
    from openforgerl.rl.policy import Policy
    from openforgerl.testing.samples import one_turn_sample

    torch.set_num_threads(THREADS)
    policy = Policy(model, lr=1e-6, precision=precision)
    if compiled:  # inductor, shapes left dynamic: micro-batches differ in length
        policy.model.forward = torch.compile(policy.model.forward, dynamic=True)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(rows):
        ids = torch.randint(0, 40_000, (length,), generator=g).tolist()
        half = length // 2
        samples.append(one_turn_sample(ids[:half], ids[half:], [0.0] * (length - half), f"s{i}"))

    def update() -> None:
        batch = policy.collate(samples)
        loss = algos.sft_loss(policy.logprobs(batch, temperature=1.0), batch.mask, int(batch.mask.sum()))
        loss.backward()
        policy.clip_and_step(1.0)

    return update


def trainer_speed(
    model: str, precision: str, rows: int, length: int, repeats: int, compiled: bool = False
) -> dict[str, Any]:
    """Tokens/s of one update on rows x length tokens, the median of `repeats` after a warm-up
    (with `compiled`, the warm-up is torch.compile's compilation: its seconds are reported)."""
    update = _update(model, precision, rows, length, compiled)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
    return {
        "precision": precision,
        "tokens": rows * length,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(rows * length / seconds, 1),
        **({"compiled": True, "first_update_s": round(times[0], 1)} if compiled else {}),
    }


def trainer_profile(model: str, precision: str, rows: int, length: int, top: int = 12) -> dict[str, Any]:
    """Where one update's time goes: torch.profiler's operators by self CPU time, after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    update = _update(model, precision, rows, length)
    update()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    return {
        "precision": precision,
        "tokens": rows * length,
        "profiled_s": round(total, 2),
        "ops": [
            {"op": e.key, "self_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count}
            for e in ops[:top]
        ],
    }


# -- rl ----------------------------------------------------------------------------------------


def make_student(out: Path) -> Path:
    """SmolLM2-135M-Instruct after SFT on 96 oracle demonstrations (kept in `out`)."""
    sft = out / "student"
    if (sft / "model.safetensors").exists():
        return sft
    from openforgerl.modelkit.pretrained import cached_pretrained
    from openforgerl.rl.sft import SFTConfig, SFTTrainer, load_sft_data, oracle_samples, write_samples

    base = cached_pretrained("smollm2-135m-instruct")
    samples = oracle_samples(base, out / "teacher", limit=96, max_turns=6, concurrency=8, progress=False)
    write_samples(samples, out / "teacher" / "samples.jsonl")
    trainer = SFTTrainer(base, SFTConfig(lr=5e-5, epochs=1, batch_size=8, seed=0))
    trainer.fit(
        load_sft_data(out / "teacher" / "samples.jsonl", trainer.policy.tokenizer), sft, progress=False
    )
    return sft


# The shared setting of every path: tasks the teacher did not see, groups of 8, T = 0.7.
RL_COMMON = [
    "--group", "8", "--batch-tasks", "2", "--temperature", "0.7", "--skip-tasks", "96",
    "--max-tokens", "96", "--lr", "2e-6", "--seed", "0",
]  # fmt: skip
# Every rollout of a step at once (bigger decode batches), the trainer under bf16 autocast where the
# CPU has a bf16 matmul (rl_path drops it where it has not).
FAST = ["--concurrency", "16", "--precision", "bf16"]
PATHS = {
    "baseline": [],  # today's defaults: 8 rollouts at a time, the trainer in fp32
    "fast": FAST,
    # The same generating on vLLM's CPU build (the server `--engine vllm` starts; weights reloaded
    # each step), in fp32 or bf16 (half the weight bytes a decode step reads); each also with the
    # next step's rollouts generated while this step trains (`--overlap`: one step off-policy, the
    # lag corrected by TIS; step 1 has nothing to overlap with, so these want 3 steps or more).
    **{
        f"vllm{dtype}{overlap}": [*FAST, *(["--overlap"] if overlap else [])]
        for dtype in ("", "-bf16")
        for overlap in ("", "-overlap")
    },
}


def vllm_dtype(name: str) -> str | None:
    """The dtype vLLM computes in on the path `name`; None where vLLM does not generate."""
    return None if not name.startswith("vllm") else "bfloat16" if "-bf16" in name else "float32"


def rl_path(model: str, name: str, steps: int, out: str, bf16: bool = True) -> dict[str, Any]:
    run = Path(out) / f"rl-{name}"
    subprocess.run(["rm", "-rf", str(run)], check=True)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    settings = [a if bf16 or a != "bf16" else "fp32" for a in PATHS[name]]
    cmd = [str(Path(sys.executable).parent / "openforge"), "train", "--model", model, "--out", str(run),
           "--steps", str(steps), *RL_COMMON, *settings]  # fmt: skip
    if dtype := vllm_dtype(name):  # the run starts vLLM's server and stops it (--engine vllm)
        cmd += ["--engine", "vllm"]
        env.update(vllm_env(dtype, 16))
    t0 = time.monotonic()
    with open(Path(out) / f"rl-{name}.log", "wb") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    return path_figures(run, settings, wall)


def path_figures(run: Path, settings: list[str], wall: float) -> dict[str, Any]:
    """A GRPO path's figures, from its run folder's metrics.jsonl."""
    steps_m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_m = [m for m in steps_m if m.get("step", 0) >= 1]
    step_s = sum(m["time/step"] for m in steps_m)
    rollouts = sum(m["rollouts"] for m in steps_m)

    def total(key: str) -> float:
        return round(sum(m.get(key, 0.0) for m in steps_m), 1)

    agreement = [m for m in steps_m if "rollout_corr/log_ppl_abs_diff" in m]
    trained = sum(m.get("tokens", 0) for m in steps_m)
    return {
        "settings": settings,
        "steps": len(steps_m),
        "rollouts": rollouts,
        "rollouts_per_hour": round(rollouts * 3600 / step_s, 1),
        "seconds": {
            "steps": round(step_s, 1),
            "rollout": total("time/rollout"),
            "train": total("time/train"),
            "push": total("time/push"),
            "save": total("time/save"),
            "process": round(wall, 1),
        },
        "pass_rate": [m["pass_rate"] for m in steps_m],
        "groups_kept": [m.get("groups_kept") for m in steps_m],
        "rollout_tokens": [m.get("rollout_tokens") for m in steps_m],
        "trained_tokens": trained,
        # The two rates a path's own code sets, free of what its sampled rollouts happened to be:
        "seconds_per_rollout": round(total("time/rollout") / rollouts, 3),
        "trained_tokens_per_s": round(trained / total("time/train"), 1) if trained else None,
        "trainer_tokens_per_s": [m["tokens_per_s"] for m in steps_m if "tokens_per_s" in m],
        "logprob_agreement": {
            "log_ppl_abs_diff_max": max(
                (m["rollout_corr/log_ppl_abs_diff"] for m in agreement), default=None
            ),
            "is_weight_min": min((m["is_weight_min"] for m in agreement), default=None),
            "is_weight_max": max((m["is_weight_max"] for m in agreement), default=None),
        },
    }


def equal_work(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each path's rollouts/hour at the same work a step: the same rollouts and the same trained
    tokens (the mean over every path's steps). Sampling makes the paths' steps differ: a step whose
    groups all pass or all fail trains nothing, so measured rollouts/hour rewards a path for luck.
    Here a step costs its rollouts at the path's measured seconds a rollout plus the trained tokens
    at its measured trainer rate; an --overlap path costs the longer of the two (both rates were
    measured while the two phases shared the cores)."""
    steps = sum(r["steps"] for r in runs.values())
    rollouts = sum(r["rollouts"] for r in runs.values()) / steps
    tokens = sum(r["trained_tokens"] for r in runs.values()) / steps
    out: dict[str, Any] = {"rollouts_per_step": round(rollouts, 1), "trained_tokens_per_step": round(tokens)}
    for name, r in runs.items():
        if not r["trained_tokens_per_s"]:
            continue
        phases = (rollouts * r["seconds_per_rollout"], tokens / r["trained_tokens_per_s"])
        step_s = max(phases) if "--overlap" in r["settings"] else sum(phases)
        out[name] = {"step_s": round(step_s, 1), "rollouts_per_hour": round(rollouts * 3600 / step_s, 1)}
    if "baseline" in out:
        for name in runs:
            if name in out:
                out[name]["speedup_vs_baseline"] = round(
                    out[name]["rollouts_per_hour"] / out["baseline"]["rollouts_per_hour"], 2
                )
    return out


# -- the run -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer batches, steps and repeats (minutes)")
    ap.add_argument("--model", help="the SFT student (default: made in --out)")
    ap.add_argument("--out", type=Path, default=Path("runs/rl-throughput"))
    ap.add_argument("--rl-steps", type=int, default=3, help="GRPO steps of each path (not --quick)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: engine,vllm,trainer,rl")
    ap.add_argument(
        "--trainer-detail",
        action="store_true",
        help="also profile one update per precision and time it under torch.compile (minutes more)",
    )
    ap.add_argument(
        "--result", type=Path, help="where the JSON goes (default: benchmarks/results/rl_throughput.json)"
    )
    ap.add_argument(
        "--paths",
        default="",
        help=f"comma-separated GRPO paths to run, of {','.join(PATHS)} (default: all "
        "this machine can run); baseline always runs, for the ratio",
    )
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if unknown := set(filter(None, args.paths.split(","))) - set(PATHS):
        ap.error(f"unknown --paths {sorted(unknown)}: the paths are {', '.join(PATHS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    model = args.model or str(make_student(args.out.resolve()))
    batches = [1, 8, 16] if args.quick else [1, 8, 16, 32]
    tokens = 32 if args.quick else 64
    result: dict[str, Any] = {"model": model, "quick": args.quick, "threads": THREADS, "cpus": os.cpu_count()}
    bf16 = _in_fresh_process("native_bf16")
    precisions = ["fp32", "bf16"] if bf16 else ["fp32"]
    result["native_bf16"] = bf16  # without it bf16 is emulated and left out below
    result["peak_gflops"] = _in_fresh_process("peak", 2048, precisions)
    gflop_per_token = 2 * SMOLLM2_PARAMS / 1e9

    def with_mfu(rows: list[dict[str, Any]], precision: str) -> list[dict[str, Any]]:
        for r in rows:
            r["mfu"] = round(r["decode_tokens_per_s"] * gflop_per_token / result["peak_gflops"][precision], 3)
        return rows

    if "engine" not in skip:
        engines = {
            "builtin_fp32": with_mfu(
                _in_fresh_process("builtin_engine", model, "float32", batches, tokens), "fp32"
            ),
        }
        if bf16:
            engines["builtin_bf16"] = with_mfu(
                _in_fresh_process("builtin_engine", model, "bfloat16", batches, tokens), "bf16"
            )
        notes = {}
        for precision in precisions:
            key, dtype = f"vllm_cpu_{precision}", {"fp32": "float32", "bf16": "bfloat16"}[precision]
            if "vllm" in skip:
                notes[key] = "left out (--skip vllm)"
            elif not VLLM_PYTHON.exists():
                notes[key] = "not measured: no .venv-vllm (make test-vllm builds it)"
            else:
                try:
                    log = str(args.out.resolve() / f"vllm-{precision}.log")
                    v = _in_fresh_process("vllm_engine", model, batches, tokens, log, dtype)
                    engines[key] = with_mfu(v["rows"], precision)
                    notes[key] = f"server ready in {v['ready_s']} s (torch.compile on)"
                except RuntimeError as e:
                    notes[key] = f"failed: {str(e)[-500:]}"
        at16 = {k: next(r for r in rows if r["batch"] == 16) for k, rows in engines.items()}
        result["engine"] = {
            **engines,
            "decode_tokens_per_s": {k: r["decode_tokens_per_s"] for k, r in at16.items()},
            "decode_mfu_batch16": {k: r["mfu"] for k, r in at16.items()},
            "notes": notes,
        }
    if "trainer" not in skip:
        rows, length, repeats = (4, 512, 2) if args.quick else (8, 512, 3)
        trainer = {p: _in_fresh_process("trainer_speed", model, p, rows, length, repeats) for p in precisions}
        for p, t in trainer.items():
            t["mfu"] = round(t["tokens_per_s"] * 3 * gflop_per_token / result["peak_gflops"][p], 3)
        result["trainer"] = {**trainer, "mfu": trainer[precisions[-1]]["mfu"]}
        if bf16:
            result["trainer"]["bf16_speedup"] = round(
                trainer["bf16"]["tokens_per_s"] / trainer["fp32"]["tokens_per_s"], 2
            )
        if args.trainer_detail:
            result["trainer"]["profile"] = {
                p: _in_fresh_process("trainer_profile", model, p, rows, length) for p in precisions
            }
            result["trainer"]["compiled"] = {
                p: _in_fresh_process("trainer_speed", model, p, rows, length, repeats, True)
                for p in precisions
            }
    if "rl" not in skip:
        steps = 1 if args.quick else args.rl_steps
        runnable = [
            n
            for n in PATHS
            if (vllm_dtype(n) is None or ("vllm" not in skip and VLLM_PYTHON.exists()))
            and (vllm_dtype(n) != "bfloat16" or bf16)
        ]
        asked = set(filter(None, args.paths.split(","))) or set(runnable)
        names = [n for n in runnable if n == "baseline" or n in asked]
        runs = {name: rl_path(model, name, steps, str(args.out.resolve()), bf16) for name in names}
        base = runs["baseline"]
        for r in runs.values():
            r["speedup_vs_baseline"] = round(r["rollouts_per_hour"] / base["rollouts_per_hour"], 2)
        fastest = max((n for n in runs if n != "baseline"), key=lambda n: runs[n]["rollouts_per_hour"])
        result["baseline"] = {"rl": base}
        result["rl"] = {"path": fastest, **runs[fastest], "paths": runs}
        result["equal_work"] = equal_work(runs)
    result["load_average"] = os.getloadavg()
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    text = json.dumps(result, indent=2)
    print(text)
    default = RESULTS / ("rl_throughput_quick.json" if args.quick else "rl_throughput.json")
    (args.result or default).write_text(text + "\n")


if __name__ == "__main__":
    main()
