#!/usr/bin/env bash
# DeepSeek-V3's layout on the lent GPU (issue 24): the tiny presets and the full-width layer shape
# (deepseek-v3-cut: hidden 7168, 128 heads, latent 512 + RoPE 64, experts of 2048; one dense and one MoE layer)
# through SGLang's Triton extend kernel (Lq 576, Lv 512 for the cut: the absorbed MLA shape) and the torch twin,
# eager and under CUDA graphs, bf16 and float32; the MLA/MoE faults and padded-kv-visible caught. Run from the
# repository root on the GPU machine after the wheels are installed (benchmarks/README.md); writes
# deepseek-gpu.log, each run's summary JSONL and deepseek-gpu.json into $1 (default benchmarks/results/deepseek-gpu).
# PART=tiny|cut|all (default all) runs the tiny presets or the full-width cut alone, so that each half fits
# one device call.
set -u
out=${1:-benchmarks/results/deepseek-gpu}
part=${PART:-all}
mkdir -p "$out"
log="$out/deepseek-gpu.log"
rows="$out/rows.jsonl"
: > "$log"; : > "$rows"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$log"
n=0
run() {  # expected exit code, then the ddcheck run arguments
  local want=$1; shift
  n=$((n + 1))
  local t0=$(date +%s%N)
  python3 -m harness run "$@" --device cuda --out "$out/run-$n.jsonl" > "$out/run-$n.txt" 2>&1
  local got=$? t1=$(date +%s%N)
  local secs=$(( (t1 - t0) / 1000000 ))   # ms (no bc on the GPU machine: its absence left the JSON unreadable)
  secs=$(printf "%d.%03d" $((secs / 1000)) $((secs % 1000)))
  printf '%s | exit %s (want %s) | %.1f s | ddcheck run %s\n' "$([ $got = $want ] && echo ok || echo FAIL)" "$got" \
    "$want" "$secs" "$*" >> "$log"
  grep -E "max rel|router ties|localized|Catalog class|time per step" "$out/run-$n.txt" | head -5 >> "$log"
  printf '{"n": %d, "args": "%s", "exit": %d, "want": %d, "seconds": %s}\n' "$n" "$*" "$got" "$want" "$secs" >> "$rows"
}
T="--backend sglang-triton"
want_part() { [ "$part" = all ] || [ "$part" = "$1" ]; }
want_part tiny && for m in tiny-deepseek-v3 tiny-kimi-k2; do
  run 0 $T --model $m --dtype float32 --budget 16 --topk 1 --no-cuda-graph
  run 0 $T --model $m --dtype bfloat16 --budget 16 --topk 2 --cuda-graph --batch 4
  run 0 --backend torch --model $m --dtype bfloat16 --budget 16 --topk 2 --no-cuda-graph --batch 2
done
# the full-width layer shape: SGLang's kernel at DeepSeek-V3's absorbed widths, eager and graphed
C="--model deepseek-v3-cut --max-new-tokens 12"
if want_part cut; then
run 0 $T $C --dtype bfloat16 --budget 16 --topk 1 --no-cuda-graph
run 0 $T $C --dtype bfloat16 --budget 16 --topk 2 --cuda-graph --batch 4
run 0 $T $C --dtype float32 --budget 8 --topk 1 --no-cuda-graph
run 1 $T $C --dtype bfloat16 --budget 16 --topk 1 --no-cuda-graph --fault padded-kv-visible
run 1 $T $C --dtype bfloat16 --budget 16 --topk 2 --no-cuda-graph --fault mla-rope-flat-index
run 1 $T $C --dtype bfloat16 --budget 16 --topk 1 --no-cuda-graph --fault mla-latent-wrong-slot
run 1 $T $C --dtype bfloat16 --budget 16 --topk 1 --no-cuda-graph --fault moe-router-reads-padding
fi
# the faults on the tiny preset under graphs
want_part tiny && for f in padded-kv-visible mla-latent-wrong-slot moe-router-reads-padding; do
  run 1 $T --model tiny-deepseek-v3 --dtype bfloat16 --budget 16 --topk 1 --cuda-graph --batch 3 --fault $f
done
want_part tiny && run 1 $T --model tiny-deepseek-v3 --dtype bfloat16 --budget 16 --topk 2 --cuda-graph --batch 3 --fault mla-rope-flat-index
python3 - "$rows" "$out/deepseek-gpu.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump({"runs": rows, "ok": sum(r["exit"] == r["want"] for r in rows), "total": len(rows)},
          open(sys.argv[2], "w"), indent=1)
print(f"{sum(r['exit'] == r['want'] for r in rows)} of {len(rows)} runs as expected")
PY
cat "$log"
