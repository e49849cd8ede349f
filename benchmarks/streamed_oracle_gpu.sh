#!/usr/bin/env bash
# The layer-streamed oracle on one GPU (issue 22 point 2): a 70B-shaped random checkpoint
# (benchmarks/streamed_oracle.py). Run from the repository root after `make setup` (the streamed
# oracle is an entry point: an older install lacks it). About 10 minutes on an H100.
#  1. dense and streamed side by side, 6 layers of the 70B shape, 32768 vocabulary rows (the dense
#     oracle's 45 GiB of float64 fit an 80 GB GPU next to the bf16 engine)
#  2. streamed alone at 24 layers and the full 128256-row vocabulary (45 GB of bf16 engine weights;
#     the whole model's float64 would be 180 GiB, the streamed oracle holds one 6.4 GiB layer)
set -euo pipefail
PY=${PY:-.venv/bin/python}
"$PY" benchmarks/streamed_oracle.py --device cuda --layers 6 --steps 6 --vocab 32768 --tag 6l
"$PY" benchmarks/streamed_oracle.py --device cuda --layers 24 --steps 4 --oracles streamed --tag 24l
