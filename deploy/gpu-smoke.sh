#!/usr/bin/env bash
# The whole loop on a GPU machine, with a small instruct model, through the gateway's HTTP API:
# serve (vLLM + Unsloth on one card), two groups of rewarded sessions, one training step,
# the hot-swap, and a request answered by the new step. Exits 0 and prints PASS, or says
# which stage failed (the gateway's and vLLM's logs are in $STATE_DIR).
#
#   bash deploy/gpu-smoke.sh                       # Qwen/Qwen2.5-0.5B-Instruct on GPU 0
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct bash deploy/gpu-smoke.sh
#
# Needs: an NVIDIA GPU with 16 GB or more, `pip install 'rlproxy[gateway,train,gpu]'`, curl, python3,
# and the model reachable (Hugging Face hub or its cache).
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-18000}
VLLM_PORT=${VLLM_PORT:-18001}
STATE_DIR=${STATE_DIR:-$(mktemp -d /tmp/rlproxy-smoke.XXXXXX)}
URL="http://127.0.0.1:${PORT}"
STARTUP_SECONDS=${STARTUP_SECONDS:-1200}
TRAIN_SECONDS=${TRAIN_SECONDS:-1800}

log() { echo "[gpu-smoke] $*" >&2; }
fail() { log "FAIL: $*"; log "gateway log: $STATE_DIR/gateway.log, vLLM log: $STATE_DIR/vllm.log"; exit 1; }
json() { python3 -c "import json, sys; data = json.load(sys.stdin); print($1)"; }

command -v nvidia-smi >/dev/null || fail "no nvidia-smi: run this on a machine with an NVIDIA GPU"
command -v rlproxy >/dev/null || fail "rlproxy is not installed: pip install 'rlproxy[gateway,train,gpu]'"

log "state in $STATE_DIR; starting the gateway with $MODEL"
rlproxy serve \
    --engine vllm \
    --base-model "$MODEL" \
    --port "$PORT" --vllm-port "$VLLM_PORT" \
    --state-dir "$STATE_DIR" \
    --gpu-mode colocated \
    --trainer auto \
    --backend unsloth \
    --device cuda \
    --groups-per-step 2 \
    --lora-rank 8 --lora-alpha 16 \
    --max-tokens-per-row 2048 \
    --poll-interval 0.5 \
    --vllm-arg=--gpu-memory-utilization=0.35 \
    --vllm-arg=--max-model-len=2048 \
    >"$STATE_DIR/gateway.log" 2>&1 &
GATEWAY=$!
trap 'kill "$GATEWAY" 2>/dev/null || true; wait "$GATEWAY" 2>/dev/null || true' EXIT

# 1. serve: the gateway answers once vLLM is healthy
deadline=$((SECONDS + STARTUP_SECONDS))
until curl -sf "$URL/healthz" >/dev/null; do
    kill -0 "$GATEWAY" 2>/dev/null || fail "the gateway exited while starting"
    (( SECONDS < deadline )) || fail "the gateway was not healthy within ${STARTUP_SECONDS}s"
    sleep 2
done
log "serving: $(curl -s "$URL/v1/models" | json '[m["id"] for m in data["data"]]')"

# 2. two groups of four sessions, each rewarded (spread within a group), then closed
chat() {  # chat SESSION GROUP MODEL -> response headers + body on stdout
    curl -sf -D - "$URL/v1/chat/completions" \
        -H "Content-Type: application/json" -H "X-Session-Id: $1" -H "X-Group-Id: $2" \
        -d "{\"model\": \"$3\", \"max_tokens\": 32, \"temperature\": 1.0,
             \"messages\": [{\"role\": \"user\", \"content\": \"Name a prime number below 50. Answer with the number only.\"}]}"
}
for group in g1 g2; do
    for i in 1 2 3 4; do
        session="smoke-${group}-${i}"
        chat "$session" "$group" agent >/dev/null || fail "chat completion for $session"
        curl -sf "$URL/v1/sessions/$session/reward" -H "Content-Type: application/json" \
            -d "{\"reward\": $((i % 2)).$i}" >/dev/null || fail "reward for $session"
    done
    curl -sf --json "{}" "$URL/v1/groups/$group/close" >/dev/null || fail "closing group $group"
    tokens=$(curl -sf "$URL/v1/sessions/smoke-${group}-1" | json 'len(data["calls"][0]["completion_ids"][0])') \
        || fail "the recorded session smoke-${group}-1 has no token ids"
    log "group $group recorded (first completion: $tokens token ids)"
done

# 3. one training step: vLLM sleeps, Unsloth trains, the step row lands
deadline=$((SECONDS + TRAIN_SECONDS))
until [[ "$(curl -sf "$URL/v1/training/steps" | json 'max([s["step"] for s in data["data"]] or [0])')" -ge 1 ]]; do
    kill -0 "$GATEWAY" 2>/dev/null || fail "the gateway exited while training"
    (( SECONDS < deadline )) || fail "no training step within ${TRAIN_SECONDS}s"
    sleep 5
done
log "step 1 trained"

# 4. hot-swap: `agent` now answers from step 1, and `agent@1` is addressable
deadline=$((SECONDS + 300))
while true; do
    reply=$(chat smoke-after g-after agent | tr -d '\r') || fail "a request for agent"
    grep -qi '^x-model-step: [1-9]' <<<"$reply" && break
    (( SECONDS < deadline )) || fail "requests for 'agent' were not answered by the new step within 300s"
    sleep 2
done
reply=$(chat smoke-pinned g-after agent@1 | tr -d '\r') || fail "a request for agent@1"
answer=$(sed '1,/^$/d' <<<"$reply" | json 'data["choices"][0]["message"]["content"]')
log "agent@1 says: $answer"
log "PASS"
