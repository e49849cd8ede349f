#!/usr/bin/env bash
# The layer-streamed oracle on one GPU (issue 22 point 2): a 70B-shaped random checkpoint
# (benchmarks/streamed_oracle.py). Run from the repository root after `make setup` (the streamed
# oracle is an entry point: an older install lacks it).
#   benchmarks/streamed_oracle_gpu.sh [24l|6l|ds|all]    (default 24l)
#  24l: the streamed oracle alone at 24 layers and the full 128256-row vocabulary (45 GB of bf16
#       engine weights; the whole model's float64 would be 180 GiB, the streamed oracle holds two
#       6.4 GiB layers: one computed, the next read on a thread). Each run is killed after
#       RUN_TIMEOUT seconds (default 450: with the checkpoint's writing, under 9 minutes on an
#       H100); results/streamed-oracle-cuda-24l.json is written before the run and after it.
#  6l:  dense and streamed side by side, 6 layers, 32768 vocabulary rows (the dense oracle's
#       45 GiB of float64 fit an 80 GB GPU next to the bf16 engine): the per-step ratio.
#  ds:  deepseek-v3-cut (full-width MLA + MoE layers) judged by both oracles, the streamed one's
#       distance from the dense one's answers (benchmarks/deepseek_oracle_gpu.py --oracles dense,streamed).
set -euo pipefail
PY=${PY:-.venv/bin/python}
STAGE=${1:-24l}
RUN_TIMEOUT=${RUN_TIMEOUT:-450}
case "$STAGE" in 24l|6l|ds|all) ;; *) echo "usage: $0 [24l|6l|ds|all]" >&2; exit 2;; esac
if [ "$STAGE" = ds ] || [ "$STAGE" = all ]; then
  PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout "$RUN_TIMEOUT" "$PY" benchmarks/deepseek_oracle_gpu.py \
    --shape deepseek-v3-cut --device cuda --oracles dense,streamed
fi
if [ "$STAGE" = 6l ] || [ "$STAGE" = all ]; then
  "$PY" benchmarks/streamed_oracle.py --device cuda --layers 6 --steps 6 --vocab 32768 --tag 6l \
    --run-timeout "$RUN_TIMEOUT"
fi
if [ "$STAGE" = 24l ] || [ "$STAGE" = all ]; then
  "$PY" benchmarks/streamed_oracle.py --device cuda --layers 24 --steps 3 --oracles streamed --tag 24l \
    --run-timeout "$RUN_TIMEOUT"
fi
