#!/usr/bin/env bash
# On a one-GPU host (16 cores):
# - examples/s and efficiency of the in-process CPU cells (`bench/speed_cells.py`, 20 s a
#   cell, graph cells after a 20 s warm-up) for two trees (a baseline commit and HEAD), side
#   by side;
# - beside them, a CUDA campaign (bf16, torch_flash) with `--jobs 1`; then, alone, the same
#   campaign with the default --jobs (workers sharing the GPU, fuzz/campaign/jobs.py).
#
#   rm -rf bench-out/{before,after} && mkdir -p bench-out/{before,after}
#   git archive 635454f | tar -x -C bench-out/before && git archive HEAD | tar -x -C bench-out/after
#   bash bench/device_graph_gpu_jobs.sh "$OUT"          # on the host, from the repository root
set -uo pipefail
OUT="${1:?output directory}"
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1
B=bench-out/before A=bench-out/after
CELLS=tp1pp1/eager,tp1pp1/graph,tp2pp4/eager,tp2pp4/graph,tp1pp8/eager,tp1pp8/graph
(cd "$B" && PYTHONPATH=. timeout 420 python bench/speed_cells.py --cells $CELLS --budget 20 \
    > "$OUT/cells_before.json" 2> "$OUT/cells_before.err") &
(cd "$A" && PYTHONPATH=. timeout 420 python bench/speed_cells.py --cells $CELLS --budget 20 \
    > "$OUT/cells_after.json" 2> "$OUT/cells_after.err") &
(cd "$A" && PYTHONPATH=. timeout 300 python -m fuzz.cli run --device cuda --budget 120 --shrink-budget 30 \
    --jobs 1 --seed 7 --json --out "$OUT/repro_jobs1" > "$OUT/gpu_jobs1.json" 2> "$OUT/gpu_jobs1.err")
wait
(cd "$A" && PYTHONPATH=. timeout 300 python -m fuzz.cli run --device cuda --budget 120 --shrink-budget 30 \
    --seed 7 --json --out "$OUT/repro_default" > "$OUT/gpu_default.json" 2> "$OUT/gpu_default.err")
nproc > "$OUT/host.txt"; python -c "import torch; print(torch.__version__)" >> "$OUT/host.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/host.txt"
