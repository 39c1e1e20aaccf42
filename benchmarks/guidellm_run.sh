#!/usr/bin/env bash
# Run a guidellm (0.8.x) concurrent-streams benchmark against an OpenAI-compatible server.
#
# Usage: benchmarks/guidellm_run.sh TARGET_URL MODEL_NAME STREAMS [MAX_SECONDS]
#   TARGET_URL   server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is stripped)
#   MODEL_NAME   the served model id (as listed by /v1/models), e.g. SmolLM2-135M-Instruct
#   STREAMS      concurrent streams; a comma list (e.g. 1,8,32) runs one benchmark per value
#   MAX_SECONDS  per-benchmark duration cap (default 60)
#
# Optional environment:
#   PROMPT_TOKENS (128)  OUTPUT_TOKENS (64)  MAX_REQUESTS (unset: no cap)  SEED (42)
#   ENDPOINT (/v1/chat/completions, or /v1/completions)
#   TOKENIZER_DIR (default: $HF_MODEL_DIR, else deepinfer's HF conversion of the default model, in its cache dir)
#   GUIDELLM (default: guidellm on PATH)  OUT_DIR (benchmarks/results)
#   GUIDELLM_WORKERS (1: client worker processes; guidellm's default of 10 is too many for 2 cores)
#
# Writes OUT_DIR/guidellm_<model>_c<streams>_<stamp>.{json,csv,log} (and _ttft.png) and prints guidellm's tables.
# Synthetic requests carry max_tokens=OUTPUT_TOKENS + ignore_eos, so output lengths are exact.
set -euo pipefail

if [[ $# -lt 3 || $# -gt 4 ]]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
TARGET=${1%/}
TARGET=${TARGET%/v1}
MODEL=$2
STREAMS=$3
MAX_SECONDS=${4:-60}

PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
SEED=${SEED:-42}
ENDPOINT=${ENDPOINT:-/v1/chat/completions}
GUIDELLM=${GUIDELLM:-$(command -v guidellm || true)}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT_DIR=${OUT_DIR:-$HERE/results}

if [[ -z ${TOKENIZER_DIR:-} ]]; then
    TOKENIZER_DIR=${HF_MODEL_DIR:-$(python3 -c \
        'from deepinfer.weights import resolve_model; print(resolve_model(None).directory)' || true)}
fi
if [[ ! -f $TOKENIZER_DIR/tokenizer.json ]]; then
    echo "error: no tokenizer.json in TOKENIZER_DIR=$TOKENIZER_DIR" >&2
    exit 2
fi
if [[ ! -x $GUIDELLM ]]; then
    echo "error: guidellm not found (${GUIDELLM:-not on PATH}); set GUIDELLM to its executable" >&2
    exit 2
fi

mkdir -p "$OUT_DIR"
STAMP=$(date +%Y%m%d-%H%M%S)
BASE="$OUT_DIR/guidellm_$(tr -c 'A-Za-z0-9.-' '_' <<<"$MODEL" | sed 's/_*$//')_c${STREAMS//,/-}_$STAMP"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export GUIDELLM__MAX_WORKER_PROCESSES=${GUIDELLM_WORKERS:-1}
export GUIDELLM__LOGGING__LOG_FILE="$BASE.guidellm.log"

constraints=(--constraint "kind=max_duration,seconds=$MAX_SECONDS")
if [[ -n ${MAX_REQUESTS:-} ]]; then
    constraints+=(--constraint "kind=max_requests,count=$MAX_REQUESTS")
fi
# several stream counts: key=value strings split on commas, so pass the profile as a JSON object
if [[ $STREAMS == *,* ]]; then
    profile="{\"kind\": \"concurrent\", \"streams\": [$STREAMS]}"
else
    profile="kind=concurrent,streams=$STREAMS"
fi

cmd=("$GUIDELLM" run
    --backend "kind=openai_http,target=$TARGET,model=$MODEL,request_format=$ENDPOINT"
    --tokenizer "kind=huggingface_auto,model=$TOKENIZER_DIR"
    --profile "$profile"
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS"
    "${constraints[@]}"
    --seed "kind=static,value=$SEED"
    --output "kind=json,path=$BASE.json"
    --output "kind=csv,path=$BASE.csv"
    --disable-progress)
printf '%q ' "${cmd[@]}" >"$BASE.log"
echo >>"$BASE.log"
echo "guidellm -> $TARGET model=$MODEL streams=$STREAMS max_seconds=$MAX_SECONDS" \
    "prompt=$PROMPT_TOKENS output=$OUTPUT_TOKENS tokenizer=$TOKENIZER_DIR"
set +e
"${cmd[@]}" 2>&1 | tee -a "$BASE.log"
rc=${PIPESTATUS[0]}
set -e
echo "results: $BASE.json $BASE.csv (console log: $BASE.log) rc=$rc"
# the TTFT distribution next to the JSON (deepinfer's plotter; a note, not a failure, without matplotlib)
if [[ -f $BASE.json ]]; then
    python3 -c 'import sys; from deepinfer.bench.plots import plot_after_run; plot_after_run(sys.argv[1])' "$BASE.json" || true
fi
exit "$rc"
