#!/usr/bin/env bash
# A/B of two source trees' `deepinfer serve` under guidellm: ab_serve.sh STREAMS REPEATS TREE_A TREE_B
# Session 18: WRONG as written. Run from /work/main, `python3 -m` puts the working directory ahead of PYTHONPATH,
# so both arms ran main's code. Kept as the record of what session 17 ran; see BENCHMARKS.md session 18.
set -u
STREAMS=$1; REPEATS=$2; A=$3; B=$4
export HF_HUB_OFFLINE=1 GUIDELLM=/tmp/guidellm-venv/bin/guidellm MAX_REQUESTS=$((STREAMS*4)) OUT_DIR=/tmp/s17/ab
mkdir -p $OUT_DIR
for rep in $(seq 1 $REPEATS); do
  if (( rep % 2 )); then order="$A $B"; else order="$B $A"; fi
  for tree in $order; do
    PYTHONPATH=$tree setsid python3 -m deepinfer.cli serve --port 8101 --max-num-seqs 64 --kv-cache-memory 2GiB > /tmp/s17/ab/server_$(basename $tree).log 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do curl -sf http://127.0.0.1:8101/health >/dev/null && break; sleep 1; done
    out=$(/work/main/benchmarks/guidellm_run.sh http://127.0.0.1:8101 SmolLM2-135M-Instruct $STREAMS 150 2>&1 | sed -n 's/^results: \([^ ]*\.json\) .*/\1/p')
    kill -INT -- -$pid; sleep 5; kill -KILL -- -$pid 2>/dev/null
    python3 - "$out" "$(basename $tree)" "$STREAMS" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"][0]
m = b["metrics"]
g = lambda n, s: m[n]["successful"][s] if s in m[n]["successful"] else m[n]["successful"]["percentiles"][s]
print(f"c{sys.argv[3]} {sys.argv[2]:8s} out {g('output_tokens_per_second', 'mean'):6.1f} tok/s  TTFT mean {g('time_to_first_token_ms', 'mean'):6.0f} p95 {g('time_to_first_token_ms', 'p95'):6.0f}  ITL {g('inter_token_latency_ms', 'mean'):5.1f}  {sys.argv[1]}", flush=True)
PY
  done
done
