#!/usr/bin/env bash
# Issue 22 point 1 on a host with >= 4 GPUs (NCCL): the TP matrix of benchmarks/tp_matrix.py on CUDA, and one
# CLI run per rank count on a real model's layout. Run from the repository root after `make setup`:
#     bash benchmarks/tp_gpu.sh            # writes benchmarks/results/tp-nccl-*.json and tp-nccl.log
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/tp-nccl.log"
# the tiny preset (4 heads, 2 KV heads): every TP fault, kv-heads-sharded at --tp 4
$PY benchmarks/tp_matrix.py --device cuda --backend sglang-triton --tp 1,2,4 \
    --out "$OUT/tp-nccl-tiny.json" 2>&1 | tee -a "$OUT/tp-nccl.log"
# Llama-3.1-8B's layout cut to 2 layers (32 heads, 8 KV heads) in bf16, judged by the noise floor
$PY benchmarks/tp_matrix.py --device cuda --backend sglang-triton --dtype bfloat16 --model llama-8b-cut --tp 1,2,4 \
    --out "$OUT/tp-nccl-llama-8b-cut.json" 2>&1 | tee -a "$OUT/tp-nccl.log"
# the CLI as a user runs it
for tp in 2 4; do
  $PY -m harness run --tp "$tp" --budget 16 --topk 1 --no-cuda-graph --device cuda --backend sglang-triton \
      --out "$OUT/tp-nccl-run-tp$tp.jsonl" 2>&1 | tail -n 25 | tee -a "$OUT/tp-nccl.log"
done
