#!/usr/bin/env bash
# The engine on a CUDA GPU against HF transformers: the tiny-random-model tests (greedy token identity, prefix
# cache, chunked prefill, preemption, logprobs, bf16 closeness; DeepSeek-V4, sparse MoE, Gemma 3) and the
# engine tests, with device auto (= cuda where torch sees a GPU). CI never runs this: it is for a machine
# with a GPU and its own CUDA build of torch (the device tool of this workplace, one call).
#
# Usage (repository root): bash tests/device/cuda_check.sh [WHEELS_DIR] [TOKENIZER_DIR]
#   WHEELS_DIR (.whl): wheels of what that machine's Python lacks, installed with --no-deps into /tmp/site
#     (seen missing on the H200 image, Python 3.12: gguf fastapi starlette annotated-doc uvicorn pydantic
#     pydantic-core annotated-types typing-inspection xgrammar opentelemetry-api importlib-metadata;
#     `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 ...`)
#   TOKENIZER_DIR (WHEELS_DIR/tok): the default model's tokenizer files alone (tokenizer.json,
#     tokenizer_config.json, chat_template.jinja, config.json): the ~100 MB GGUF need not travel
#     (tests/conftest.py's `tokenizer_dir` fixture reads DEEPINFER_TEST_TOKENIZER_DIR).
# Writes pytest's log to $OUT/pytest.log when OUT is set. Session 27 got as far as the imports on an H200
# (torch 2.11.0+cu130, transformers 5.17, device auto -> cuda) before the workplace paused GPU loans: the
# tests themselves have not run on CUDA yet.
set -uo pipefail
WHEELS=${1:-.whl}
TOK=${2:-$WHEELS/tok}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DEEPINFER_TEST_TOKENIZER_DIR=$(cd "$TOK" && pwd)
nvidia-smi -L 2>/dev/null || true
python3 -c "import torch; from deepinfer.engine.runner import resolve_device; \
print('torch', torch.__version__, 'device auto ->', resolve_device('auto'))"
LOG=${OUT:-/tmp}/pytest.log
timeout -k 10 480 python3 -m pytest -q -p no:cacheprovider --timeout 120 -o addopts="" -m "not slow and not clients" \
    tests/models/test_models_vs_hf.py tests/models/test_deepseek_v4.py tests/models/test_sparse_moe.py \
    tests/models/test_gemma3.py tests/engine --ignore=tests/engine/test_determinism.py \
    --ignore=tests/engine/test_structured.py --maxfail 40 -rf 2>&1 | tee "$LOG" | tail -n 60
