#!/usr/bin/env bash
# Distil first, then reinforce, on one GPU (examples/distil/README.md):
#
#   bash examples/distil/run.sh record     # the agent on a hosted model, recorded and rewarded
#   bash examples/distil/run.sh distil     # the good sessions, fine-tuned into the student (SFT steps)
#   bash examples/distil/run.sh reinforce  # the student serves the agent; GRPO goes on from the newest step
#   bash examples/distil/run.sh all        # the three in turn
#
# Settings are environment variables (defaults below). The *_ARGS ones are extra flags, split
# on spaces. record and reinforce start `rlproxy serve` in the background on $PORT, wait for
# /healthz to be ok (with INIT_FROM: until the new run's step 0 is loaded; it answers 503
# `loading` before), run the agent and stop the gateway again (also on an error or Ctrl-C); its
# log is $STATE/logs/PHASE-gateway.log.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

PYTHON=${PYTHON:-python}
RLPROXY=${RLPROXY:-rlproxy}                           # the command, e.g. "python -m gateway.cli"
STATE=${STATE:-.rlproxy-distil}                       # --state-dir: the store and the checkpoints
PORT=${PORT:-8000}
# the teacher: a hosted OpenAI-compatible API (--engine openai)
TEACHER_URL=${TEACHER_URL:-https://api.openai.com/v1}
TEACHER_KEY=${TEACHER_KEY:-${OPENAI_API_KEY:-}}       # handed to the gateway in its environment, never on argv
TEACHER_MODEL=${TEACHER_MODEL:-gpt-4.1-mini}          # the id the agent asks for, sent upstream as it is
TASKS=${TASKS:-40}                                    # record: groups (tasks) the teacher plays
TEACHER_ROLLOUTS=${TEACHER_ROLLOUTS:-4}               # record: rollouts per task
RECORD_ARGS=${RECORD_ARGS:-}                          # record: more `rlproxy serve` flags
# the selection and the supervised run
MIN_REWARD=${MIN_REWARD:-0.8}
EPOCHS=${EPOCHS:-2}
SFT_ARGS=${SFT_ARGS:-}                                # distil: more `rlproxy train` flags (--max-steps, selection)
# the student
STUDENT=${STUDENT:-Qwen/Qwen2.5-1.5B-Instruct}        # --base-model
STUDENT_NAME=${STUDENT_NAME:-agent}                   # --model-name of the supervised run
ENGINE=${ENGINE:-vllm}
BACKEND=${BACKEND:-peft}                              # unsloth: Unsloth's (pip install 'rlproxy[gpu]')
DEVICE=${DEVICE:-cuda}
ROW_TOKENS=${ROW_TOKENS:-8192}                        # --max-tokens-per-row: a whole conversation in one row
TRAIN_ARGS=${TRAIN_ARGS:-}                            # distil and reinforce: e.g. --lora-rank, --learning-rate
if [[ $ENGINE == vllm ]]; then
    ENGINE_ARGS=${ENGINE_ARGS:---gpu-mode colocated --vllm-arg=--max-model-len=16384 --vllm-arg=--enable-auto-tool-choice --vllm-arg=--tool-call-parser=hermes}
else
    ENGINE_ARGS=${ENGINE_ARGS:-}
fi
# reinforce
RL_NAME=${RL_NAME:-$STUDENT_NAME}                     # another name with INIT_FROM: a new run
INIT_FROM=${INIT_FROM:-}                              # NAME@STEP: the new run's step 0
RL_TASKS=${RL_TASKS:-200}
ROLLOUTS=${ROLLOUTS:-8}
SERVE_ARGS=${SERVE_ARGS:-}                            # reinforce: more `rlproxy serve` flags (--groups-per-step, ...)
DRAIN=${DRAIN:-900}                                   # reinforce: seconds to wait for the last groups' steps (0: none)
# the agent
AGENT=${AGENT:-$PYTHON $ROOT/examples/retail/agent.py}  # called with --base-url --model --tasks --rollouts
AGENT_ARGS=${AGENT_ARGS:-}                            # more agent flags, both phases (--max-turns, --task, ...)
RULER=${RULER:-0}                                     # 1: the agent asks for RULER scores (--ruler)
JUDGE_MODEL=${JUDGE_MODEL:-self}                      # RULER judge: self (the model served), or a litellm id
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-1200}              # seconds for the gateway's /healthz to be ok

BASE_URL="http://127.0.0.1:$PORT"
GATEWAY_PID=
AGENT_PID=

words() { # words NAME "text": the array NAME holds the text's words
    read -r -a "$1" <<<"$2" || true
}
words rlproxy_cmd "$RLPROXY"

say() { printf '\n== %s\n' "$*"; }

cleanup() {
    if [[ -n $AGENT_PID ]]; then
        kill -TERM "$AGENT_PID" 2>/dev/null || true
        wait "$AGENT_PID" 2>/dev/null || true
        AGENT_PID=
    fi
    stop_gateway
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

http() { # http GET|POST PATH: the answer's body on stdout; fails on an error or no answer
    "$PYTHON" - "$1" "$BASE_URL$2" <<'PY'
import sys
import urllib.request

method, url = sys.argv[1], sys.argv[2]
data = b"{}" if method == "POST" else None
request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=30) as answer:
    sys.stdout.write(answer.read().decode())
PY
}

start_gateway() { # start_gateway PHASE FLAGS...: `rlproxy serve FLAGS` in the background, once healthy
    local phase=$1
    shift
    local log="$STATE/logs/$phase-gateway.log"
    mkdir -p "$STATE/logs"
    if http GET /healthz >/dev/null 2>&1; then
        echo "something already answers at $BASE_URL: stop it, or set PORT" >&2
        return 1
    fi
    # RULER calls only the judges the gateway is started with (self is always allowed)
    [[ $RULER != 1 || $JUDGE_MODEL == self ]] || set -- "$@" --judge-model "$JUDGE_MODEL"
    say "$phase: rlproxy serve $* (log: $log)"
    set -m # its own process group: stopped as a whole, and Ctrl-C reaches it only through us
    "${rlproxy_cmd[@]}" serve --state-dir "$STATE" --host 127.0.0.1 --port "$PORT" "$@" </dev/null >>"$log" 2>&1 &
    GATEWAY_PID=$!
    set +m
    local waited=0
    until http GET /healthz >/dev/null 2>&1; do
        if ! kill -0 "$GATEWAY_PID" 2>/dev/null; then
            wait "$GATEWAY_PID" 2>/dev/null || true
            GATEWAY_PID=
            echo "the gateway exited while starting; the end of $log:" >&2
            tail -n 30 "$log" >&2
            return 1
        fi
        if ((waited >= STARTUP_TIMEOUT)); then
            echo "the gateway's $BASE_URL/healthz was not ok in $STARTUP_TIMEOUT s; see $log" >&2
            return 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "gateway up at $BASE_URL/v1 (dashboard: $BASE_URL/ui)"
}

stop_gateway() { # SIGTERM: the gateway stops its trainer (after the step in progress) and vLLM
    [[ -n $GATEWAY_PID ]] || return 0
    local pid=$GATEWAY_PID waited=0
    GATEWAY_PID=
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && ((waited < 120)); do
        sleep 1
        waited=$((waited + 1))
    done
    kill -KILL -- "-$pid" 2>/dev/null || true # whatever of its process group is left
    wait "$pid" 2>/dev/null || true
    echo "gateway stopped"
}

run_agent() { # run_agent MODEL TASKS ROLLOUTS
    local agent extra ruler=() shown="$AGENT --model $1 --tasks $2 --rollouts $3"
    words agent "$AGENT"
    words extra "$AGENT_ARGS"
    if [[ $RULER == 1 ]]; then
        ruler=(--ruler --judge-model "$JUDGE_MODEL")
        shown+=" ${ruler[*]}"
    fi
    say "agent: $shown${AGENT_ARGS:+ $AGENT_ARGS}"
    # In the background and waited for, so that a signal stops the run at once.
    "${agent[@]}" --base-url "$BASE_URL/v1" --model "$1" --tasks "$2" --rollouts "$3" \
        ${ruler[@]+"${ruler[@]}"} ${extra[@]+"${extra[@]}"} &
    AGENT_PID=$!
    wait "$AGENT_PID"
    AGENT_PID=
}

steps() { # the run's steps, as the store has them (an SQLite store under $STATE)
    [[ -f $STATE/rlproxy.db ]] || return 0
    "$PYTHON" - "$STATE/rlproxy.db" "$1" <<'PY'
import json
import sqlite3
import sys

db, model = sys.argv[1], sys.argv[2]
rows = sqlite3.connect(db).execute("SELECT step, metrics FROM steps WHERE model = ? ORDER BY step", (model,))
for step, metrics in rows:
    metrics = json.loads(metrics or "{}")
    if step == 0:
        print(f"  {model}@0: the start" + (f" ({metrics['init_from']})" if "init_from" in metrics else ""))
        continue
    kind = metrics.get("objective", "grpo")
    shown = {k: round(v, 4) for k, v in metrics.items() if k in ("loss", "val_loss", "reward_mean") and v is not None}
    print(f"  {model}@{step}: {kind} {shown}")
PY
}

record() {
    [[ -n $TEACHER_KEY ]] || echo "note: no TEACHER_KEY (or OPENAI_API_KEY): the teacher is called without a key"
    # --base-model: what the openai engine calls itself, so that RULER's judge `self` is the teacher
    words extra "$RECORD_ARGS"
    RLPROXY_UPSTREAM_API_KEY=$TEACHER_KEY start_gateway record --engine openai --upstream-url "$TEACHER_URL" \
        --base-model "$TEACHER_MODEL" --trainer off ${extra[@]+"${extra[@]}"}
    run_agent "$TEACHER_MODEL" "$TASKS" "$TEACHER_ROLLOUTS"
    stop_gateway
}

distil() {
    local selection=(--model "$TEACHER_MODEL" --min-reward "$MIN_REWARD") train sft
    words train "$TRAIN_ARGS"
    words sft "$SFT_ARGS"
    say "distil: the teacher's sessions rewarded >= $MIN_REWARD ($STATE/distil-selection.jsonl)"
    "${rlproxy_cmd[@]}" export --state-dir "$STATE" "${selection[@]}" -o "$STATE/distil-selection.jsonl"
    say "distil: rlproxy train --objective sft into $STUDENT, served as $STUDENT_NAME"
    "${rlproxy_cmd[@]}" train --objective sft --state-dir "$STATE" "${selection[@]}" --epochs "$EPOCHS" \
        --base-model "$STUDENT" --model-name "$STUDENT_NAME" --backend "$BACKEND" --device "$DEVICE" \
        --max-tokens-per-row "$ROW_TOKENS" ${train[@]+"${train[@]}"} ${sft[@]+"${sft[@]}"}
    steps "$STUDENT_NAME"
}

drain() { # train what the agent left: ask for a step now, until no group of this phase waits
    ((DRAIN > 0)) || return 0
    say "reinforce: waiting up to $DRAIN s for the trainer to take the last groups"
    local waited=0 left
    while :; do
        left=$(http GET "/v1/groups?state=pending&split=train&since=$1&limit=500" | "$PYTHON" -c '
import json, sys
groups = json.load(sys.stdin)["data"]
print(sum(1 for g in groups if g["model"] == sys.argv[1] and not g.get("failed") and g["n_sessions"]))' "$RL_NAME")
        ((left > 0)) || return 0
        ((waited < DRAIN)) || {
            echo "$left group(s) not trained yet: they stay in the store, and the next serve trains them"
            return 0
        }
        http POST /v1/training/trigger >/dev/null # a step now, even with fewer than --groups-per-step groups
        sleep 5
        waited=$((waited + 5))
    done
}

reinforce() {
    local serve=(--engine "$ENGINE" --base-model "$STUDENT" --model-name "$RL_NAME" --backend "$BACKEND"
        --device "$DEVICE" --max-tokens-per-row "$ROW_TOKENS" --trainer auto) engine train extra started
    [[ -z $INIT_FROM ]] || serve+=(--init-from "$INIT_FROM")
    words engine "$ENGINE_ARGS"
    words train "$TRAIN_ARGS"
    words extra "$SERVE_ARGS"
    started=$(date +%s)
    start_gateway reinforce "${serve[@]}" ${engine[@]+"${engine[@]}"} ${train[@]+"${train[@]}"} \
        ${extra[@]+"${extra[@]}"}
    run_agent "$RL_NAME" "$RL_TASKS" "$ROLLOUTS"
    drain "$started"
    stop_gateway
    steps "$RL_NAME"
}

case ${1:-} in
record | distil | reinforce) "$1" ;;
all)
    record
    distil
    reinforce
    ;;
*)
    echo "usage: bash examples/distil/run.sh record|distil|reinforce|all (settings: examples/distil/README.md)" >&2
    exit 2
    ;;
esac
