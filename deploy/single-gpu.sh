#!/usr/bin/env bash
# rlproxy on ONE NVIDIA GPU: vLLM serves Qwen2.5 with the trained LoRA, Unsloth trains it,
# and the two share the card (--gpu-mode colocated: vLLM sleeps while a step trains).
#
#   bash deploy/single-gpu.sh                 # picks settings for the card's memory
#   GPU_GB=48 bash deploy/single-gpu.sh       # or say which preset (24, 48, 80)
#   MODEL=Qwen/Qwen2.5-7B-Instruct bash deploy/single-gpu.sh --groups-per-step 8
#
# Extra arguments go to `rlproxy serve`. Environment: MODEL, GPU_GB, HOST (127.0.0.1),
# PORT (8000), STATE_DIR (.rlproxy), INSTALL=0 to skip pip, RLPROXY_API_KEY (required
# when HOST is not loopback). Memory settings are explained in deploy/README.md.
set -euo pipefail

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
STATE_DIR=${STATE_DIR:-.rlproxy}

if [[ -z "${GPU_GB:-}" ]]; then
    if ! command -v nvidia-smi >/dev/null; then
        echo "no nvidia-smi: this recipe needs an NVIDIA GPU (set GPU_GB to pick a preset anyway)" >&2
        exit 1
    fi
    GPU_GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | awk '{print int($1 / 1000)}')
fi

# preset: base model | vLLM share of the card | context | LoRA rank | adapters vLLM keeps
# (thresholds below the nominal sizes: an L40S reports 46 GB, an A10G or L4 23 GB)
if (( GPU_GB >= 70 )); then
    PRESET_MODEL=Qwen/Qwen2.5-7B-Instruct UTIL=0.70 MAX_LEN=32768 RANK=64 LORAS=4
elif (( GPU_GB >= 40 )); then
    PRESET_MODEL=Qwen/Qwen2.5-7B-Instruct UTIL=0.60 MAX_LEN=16384 RANK=32 LORAS=4
elif (( GPU_GB >= 20 )); then
    PRESET_MODEL=Qwen/Qwen2.5-3B-Instruct UTIL=0.55 MAX_LEN=8192 RANK=16 LORAS=2
else
    echo "a ${GPU_GB} GB card is below the smallest preset (24 GB); see deploy/README.md" >&2
    exit 1
fi
MODEL=${MODEL:-$PRESET_MODEL}

if [[ "$HOST" != "127.0.0.1" && "$HOST" != "localhost" && -z "${RLPROXY_API_KEY:-}" ]]; then
    echo "HOST=$HOST exposes the gateway: set RLPROXY_API_KEY to a secret first" >&2
    exit 1
fi

if [[ "${INSTALL:-1}" == "1" ]]; then
    # [gpu]'s vllm pins the torch [train] pins (2.13.0: PyPI's CUDA build on Linux), so one torch serves both;
    # [train] adds what vllm and unsloth do not bring (matplotlib for export-model's card, gguf for smollm2).
    python -m pip install --upgrade pip
    if [[ -f pyproject.toml && -d gateway ]]; then
        python -m pip install -e ".[gateway,train,gpu]"
    else
        python -m pip install "rlproxy[gateway,train,gpu]"
    fi
fi

echo "rlproxy: ${MODEL} on a ${GPU_GB} GB card (vLLM ${UTIL} of it, context ${MAX_LEN}, LoRA rank ${RANK})" >&2
exec rlproxy serve \
    --engine vllm \
    --base-model "$MODEL" \
    --host "$HOST" --port "$PORT" \
    --state-dir "$STATE_DIR" \
    --gpu-mode colocated \
    --trainer auto \
    --backend unsloth \
    --device cuda \
    --lora-rank "$RANK" --lora-alpha "$((2 * RANK))" \
    --max-loras "$LORAS" \
    --max-tokens-per-row "$MAX_LEN" \
    --vllm-arg="--gpu-memory-utilization=${UTIL}" \
    --vllm-arg="--max-model-len=${MAX_LEN}" \
    "$@"
