#!/usr/bin/env bash
# Two GRPO steps of OpenForgeRL on veRL: Qwen3-0.6B, vLLM async rollouts, the V1 trainer, one GPU.
#
# Every rollout runs through the openforge agent loop: the built-in ReAct harness in a local sandbox,
# the gateway recording tokens from veRL's own vLLM server, the tools-tiny verifier for the reward.
#
#   bash scripts/gpu_smoke.sh                  # installs into .venv-verl-gpu on first run
#   MODEL=/models/Qwen3-0.6B bash scripts/gpu_smoke.sh
#
# Needs: an NVIDIA GPU (about 40 GB is plenty), Python 3.10-3.12, and network access to PyPI and the
# Hugging Face hub on the first run (or MODEL as a local directory and a local package index).
# The install (veRL with vLLM, about 6 GB) is not timed; the training run must finish in
# SMOKE_TIMEOUT seconds (default 600).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$REPO/.venv-verl-gpu}"
MODEL="${MODEL:-Qwen/Qwen3-0.6B}"
WORK="${WORK:-$REPO/runs/verl-gpu-smoke}"
SMOKE_TIMEOUT="${SMOKE_TIMEOUT:-600}"
VERL_VERSION=0.9.1

command -v nvidia-smi >/dev/null || { echo "gpu_smoke: no nvidia-smi: this needs an NVIDIA GPU" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# -- install (once) --------------------------------------------------------------------------------
if [ ! -f "$VENV/.installed-$VERL_VERSION" ]; then
    "$PYTHON" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12), "veRL 0.9.1 needs Python 3.10-3.12"'
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q -U pip
    # veRL's vLLM extra pins its own torch, vLLM and transformers, plus TransferQueue for the V1 trainer.
    "$VENV/bin/pip" install "verl[vllm]==$VERL_VERSION"
    # OpenForgeRL without its CPU pins (torch, transformers come from veRL's extra); then what it needs
    # beyond veRL's dependencies, at the versions pip finds compatible with them. `openai` is the
    # ReAct harness's client.
    "$VENV/bin/pip" install --no-deps -e "$REPO"
    "$VENV/bin/pip" install starlette uvicorn httpx orjson click PyYAML tqdm jinja2 aiohttp openai
    touch "$VENV/.installed-$VERL_VERSION"
fi
export PATH="$VENV/bin:$PATH"
python -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("torch", torch.__version__, torch.version.cuda)'
python -c 'import vllm, verl; print("vllm", vllm.__version__, "verl", verl.__version__)'
python -c 'from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r; assert "openforge" in r, "the openforge agent loop is not registered (entry point)"'

# -- data and model ----------------------------------------------------------------------------------
rm -rf "$WORK"
mkdir -p "$WORK"
openforge verl-data --tasks tools-tiny --split train --limit 8 --out "$WORK/train.parquet"
openforge verl-data --tasks tools-tiny --split heldout --limit 4 --out "$WORK/val.parquet"
if [ ! -d "$MODEL" ]; then
    # Download once, so the rollout server and the FSDP workers do not race for it.
    MODEL="$(python -c 'import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))' "$MODEL")"
fi

# -- two GRPO steps ------------------------------------------------------------------------------------
# 4 tasks x 4 rollouts per step. No flash-attn build: SDPA attention, so no padding removal (varlen).
export VERL_FILE_LOGGER_PATH="$WORK/metrics.jsonl"
export HYDRA_FULL_ERROR=1
cd "$WORK"
timeout --signal=INT "$SMOKE_TIMEOUT" openforge train --backend verl qwen3_grpo \
    data.train_files="$WORK/train.parquet" \
    data.val_files="$WORK/val.parquet" \
    data.train_batch_size=4 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=false \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.rollout.enforce_eager=true \
    actor_rollout_ref.rollout.agent.num_workers=2 \
    openforge.max_tokens=256 \
    openforge.max_turns=6 \
    openforge.store_dir="$WORK/gateway" \
    trainer.n_gpus_per_node=1 \
    trainer.total_training_steps=2 \
    trainer.logger='[console,file]' \
    trainer.experiment_name=gpu-smoke \
    trainer.default_local_dir="$WORK/checkpoints" \
    2>&1 | tee "$WORK/train.log"

# -- what must have happened -------------------------------------------------------------------------
python - "$WORK" <<'EOF'
import glob, json, sqlite3, sys
work = sys.argv[1]
steps = sorted({json.loads(line)["step"] for line in open(f"{work}/metrics.jsonl")})
assert steps[-2:] == [1, 2], f"expected metrics of steps 1 and 2, got {steps}"
calls = 0
for db in glob.glob(f"{work}/gateway/*.db"):
    with sqlite3.connect(db) as c:
        calls += c.execute("SELECT count(*) FROM calls WHERE status = 'ok'").fetchone()[0]
assert calls > 0, "the openforge gateways recorded no model call"
print(f"gpu_smoke: OK: {len(steps)} steps logged, {calls} model calls recorded by the openforge gateways")
EOF
