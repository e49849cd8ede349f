#!/usr/bin/env bash
# The oracle's time per verify step next to the engine's on one GPU, before and after the oracle judged a
# step in one pass (issue 22 point 3; benchmarks/oracle_speed.py). The Llama-3.1-8B shape cut to LAYERS
# decoder layers (default 8: about 22 GiB of float64 weights, their rounded copy as much, the bf16 engine
# a quarter), random weights written on the device (benchmarks/random_checkpoint.py), the seeded stand-in
# drafter, 640 and 900-token prompts, SGLang's kernel under graphs. Run from the repository root after
# `make setup`; under 8 minutes on an H100. Each setting is its own process with its own time limit and
# JSON file (written after each of its runs), so a setting that fails or runs out of time leaves the others.
#   LAYERS=8 PY=.venv/bin/python OUT=benchmarks/results bash benchmarks/oracle_speed_gpu.sh
# SETTING_GROUPS: space-separated processes, each a comma list of budget:topk:batch run on one loading (default: the
# two settings above); MATRIX=default: the gate's general matrix (budget 4/8/16/32 x topk 1/2/4 x batch 1/4,
# graphs on), one process per budget. MODES: a comma list of before, every-twin and after (default before,after);
# REPEAT: runs of each mode per setting, interleaved (default 1).
#   MATRIX=default MODES=after BUDGETS="4 8" bash benchmarks/oracle_speed_gpu.sh
set -u
PY=${PY:-.venv/bin/python}
LAYERS=${LAYERS:-8}
OUT=${OUT:-benchmarks/results}
CKPT=${CKPT:-${TMPDIR:-/tmp}/oracle-speed-8b-${LAYERS}l}
LIMIT=${LIMIT:-200}          # seconds per setting (both runs)
TOKENS=${TOKENS:-16}
MODES=${MODES:-before,after}
SETTING_GROUPS=${SETTING_GROUPS:-16:1:1 32:4:4}
if [ "${MATRIX:-}" = default ]; then
  SETTING_GROUPS=""
  for b in ${BUDGETS:-4 8 16 32}; do SETTING_GROUPS="$SETTING_GROUPS $b:1:1,$b:2:1,$b:4:1,$b:1:4,$b:2:4,$b:4:4"; done
fi
mkdir -p "$OUT"
LOG="$OUT/oracle-speed-gpu.log"
echo "oracle_speed_gpu.sh: LAYERS=$LAYERS TOKENS=$TOKENS $(date -u +%FT%TZ)" | tee -a "$LOG"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
if [ ! -f "$CKPT/config.json" ]; then
  PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from random_checkpoint import write
print(write('llama-3.1-8b', Path('$CKPT'), 'cuda', cut={'num_hidden_layers': $LAYERS}))
" 2>&1 | tee -a "$LOG" || { echo "checkpoint not written" | tee -a "$LOG"; exit 1; }
fi
for setting in $SETTING_GROUPS; do
  tag=${setting//:/-}; tag=${tag//,/_}
  echo "== settings $setting (budget:topk:batch), modes $MODES ==" | tee -a "$LOG"
  start=$SECONDS
  PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout "$LIMIT" "$PY" benchmarks/oracle_speed.py --model "$CKPT" --device cuda \
    --backend sglang-triton --cuda-graph --drafter noisy --prompt-lens 640,900 --settings "$setting" --modes "$MODES" \
    --max-new-tokens "$TOKENS" --repeat "${REPEAT:-1}" --out "$OUT/oracle-speed-gpu-${LAYERS}l-$tag.json" 2>&1 | tail -n 20 | tee -a "$LOG"
  echo "exit ${PIPESTATUS[0]} after $((SECONDS - start)) s" | tee -a "$LOG"
done
