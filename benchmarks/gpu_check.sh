#!/usr/bin/env bash
# The CLI on the lent GPU, natively: SGLang's kernel under real CUDA graphs.
# Run from the repository root on the GPU machine after the wheels are
# installed (benchmarks/README.md); writes gpu-check.log and JSON into $1.
set -u
out=${1:?output folder}
mkdir -p "$out"
log="$out/gpu-check.log"
run() {  # expected exit code, then the ddcheck arguments
  local want=$1; shift
  python3 -m harness "$@" --device cuda --out "$out/last.jsonl" > "$out/last.txt" 2>&1
  local got=$?
  printf '%s | exit %s (want %s) | ddcheck %s\n' "$([ $got = $want ] && echo ok || echo FAIL)" "$got" "$want" "$*" >> "$log"
  grep -E "max rel|localized|first divergence|tolerance" "$out/last.txt" | head -4 >> "$log"
}
: > "$log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$log"
B="--backend sglang-triton"
run 0 run $B --dtype float32 --budget 16 --topk 1 --no-cuda-graph
run 0 run $B --dtype float32 --budget 16 --topk 2 --cuda-graph --batch 4
run 0 run $B --dtype float16 --budget 16 --topk 1 --cuda-graph --batch 4
run 0 run $B --dtype float16 --budget 32 --topk 4 --no-cuda-graph --batch 4
run 0 run $B --dtype bfloat16 --budget 16 --topk 1 --cuda-graph --batch 4
run 1 run $B --dtype bfloat16 --budget 16 --topk 1 --no-cuda-graph --fault padded-kv-visible
for f in graph-captured-causal stale-graph-mask stale-kv-indices; do
  run 1 run $B --dtype bfloat16 --budget 16 --topk 2 --cuda-graph --batch 4 --fault $f
done
run 1 run $B --dtype bfloat16 --budget 16 --topk 1 --cuda-graph --batch 4 --fault mask-row-stride
# the newer axes under SGLang's kernel and real CUDA graphs: a window (its own static mask buffer), paged KV, sinks
run 0 run $B --dtype bfloat16 --model tiny-swa --budget 8 --topk 2 --cuda-graph --batch 3
run 0 run $B --dtype bfloat16 --sliding-window 8 --page-size 16 --budget 8 --topk 2 --cuda-graph --batch 3
run 0 run $B --dtype bfloat16 --model tiny-sinks --budget 16 --topk 2 --cuda-graph --batch 4
run 1 run $B --dtype bfloat16 --model tiny-swa --budget 8 --topk 2 --cuda-graph --batch 3 --fault swa-window-by-row-index
run 1 run $B --dtype bfloat16 --page-size 16 --budget 16 --topk 2 --batch 2 --fault paged-compaction-permutation
python3 -m harness faults --check --quick --seeds 5 --fault-seeds ${FAULT_SEEDS:-5} $B --json "$out/faults-check-cuda.json" > "$out/faults-check.txt" 2>&1
echo "faults --check exit $?" >> "$log"
