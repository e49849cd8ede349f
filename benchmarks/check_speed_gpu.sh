#!/usr/bin/env bash
# Issue 22 point 3 on the GPU: the check at a worst setting (budget 32, topk 4, batch 4, CUDA graphs, 640- and
# 900-token prompts) on a random checkpoint of Llama-3.1-8B's layout written on the device, cut to LAYERS layers
# (8 by default: the float64 oracle of 32 layers, 64 GB, does not fit an H100 beside the engine; LAYERS=32 on an
# H200). benchmarks/check_speed.py twice: its components (the twin kept vs prefilled every step, the step table
# vs the per-node path, the oracle) over 3 steps after step 0, then the whole `ddcheck run` under --timeout
# (per-step engine and oracle seconds after the warm-up, the warm-up apart, their ratio). Each part writes its
# JSON as it goes and has a time limit, so the script ends in about 8 minutes on an H100 whatever happens.
# Run from the repository root on the GPU machine:
#     bash benchmarks/check_speed_gpu.sh OUTDIR     # OUTDIR/check-speed-gpu*.json and check-speed-gpu.log
# Knobs (environment): PY, LAYERS, TOKENS (max new tokens per request), RUN_TIMEOUT (seconds of the whole run),
# BASELINE (a checkout of older code: its whole run too, about 3 more minutes), and for a check of the script on
# a CPU: SHAPE=check DEVICE=cpu BACKEND=torch GRAPH= PROMPT_LEN=40,60.
set -u
out=${1:?output folder}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SHAPE=${SHAPE:-llama-3.1-8b}
LAYERS=${LAYERS:-8}
TOKENS=${TOKENS:-24}
RUN_TIMEOUT=${RUN_TIMEOUT:-130}
DEVICE=${DEVICE:-cuda}
BACKEND=${BACKEND:-sglang-triton}
GRAPH=${GRAPH---cuda-graph}
PROMPT_LEN=${PROMPT_LEN:-640,900}
log="$out/check-speed-gpu.log"
: > "$log"
say() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$log"; }
ckpt_root=$(mktemp -d)
trap 'rm -rf "$ckpt_root"' EXIT
ckpt="$ckpt_root/ckpt"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$log" 2>&1
fi
say "writing a random $SHAPE checkpoint cut to $LAYERS layers on $DEVICE"
timeout -s TERM 150 "$PY" - "$SHAPE" "$ckpt" "$DEVICE" "$LAYERS" >> "$log" 2>&1 <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from random_checkpoint import write
shape, path, device, layers = sys.argv[1:]
write(shape, Path(path), device, cut={"num_hidden_layers": int(layers)})
EOF
rc=$?
say "checkpoint: exit $rc"
[ "$rc" = 0 ] || exit 1
common=(--model "$ckpt" --dtype bfloat16 --budget 32 --topk 4 --batch 4 --max-new-tokens "$TOKENS"
        --device "$DEVICE" --backend "$BACKEND" --prompt-len "$PROMPT_LEN" $GRAPH)
say "components over 3 steps after step 0"
timeout -s TERM 200 "$PY" benchmarks/check_speed.py "${common[@]}" --steps 3 --skip-whole \
    --out "$out/check-speed-gpu-components.json" >> "$log" 2>&1
say "components: exit $? ($out/check-speed-gpu-components.json)"
baseline=()
limit=$((RUN_TIMEOUT + 75))
if [ -n "${BASELINE:-}" ]; then
  baseline=(--baseline "$BASELINE")
  limit=$((2 * RUN_TIMEOUT + 150))
fi
say "whole check, --timeout $RUN_TIMEOUT"
timeout -s TERM "$limit" "$PY" benchmarks/check_speed.py "${common[@]}" --skip-components \
    --run-timeout "$RUN_TIMEOUT" ${baseline[@]+"${baseline[@]}"} --out "$out/check-speed-gpu.json" >> "$log" 2>&1
say "whole check: exit $? ($out/check-speed-gpu.json)"
