#!/usr/bin/env bash
# Issue 24's measurements on a many-core host (the lent H200 host; CPU only, GPUs hidden):
# `llmfuzz bench --quick --json` for the tree before (session 3, d8b20ee) and after, side by
# side, per-cell efficiency over 20 s windows, and `--jobs 16` against `--jobs 1`.
#
#   rm -rf bench-out/{before,after} && mkdir -p bench-out/{before,after}
#   git archive d8b20ee | tar -x -C bench-out/before && git archive HEAD | tar -x -C bench-out/after
#   bash bench/device_speed.sh "$OUT"          # on the host, from the repository root
set -uo pipefail
OUT="${1:?output directory}"
export CUDA_VISIBLE_DEVICES=""  # the CPU figures of the issue; the GPUs would add cells
B=bench-out/before A=bench-out/after
(cd "$A" && PYTHONPATH=. timeout 560 python bench/jobs_scaling.py --jobs 16 --budget 60 --shrink-budget 30 \
    > "$OUT/jobs_scaling_jobs16.json" 2> "$OUT/jobs_scaling.err") &
(cd "$B" && PYTHONPATH=. timeout 560 python -m fuzz.cli bench --quick --json > "$OUT/bench_quick_before.json" 2> "$OUT/before.err") &
(cd "$A" && PYTHONPATH=. timeout 560 python -m fuzz.cli bench --quick --json > "$OUT/bench_quick_after.json" 2> "$OUT/after.err") &
(cd "$A" && PYTHONPATH=. timeout 560 python bench/speed_cells.py --budget 20 > "$OUT/speed_cells_after.json" 2> "$OUT/cells_after.err") &
(PYTHONPATH=$B timeout 560 python bench/speed_cells.py --budget 20 > "$OUT/speed_cells_before.json" 2> "$OUT/cells_before.err") &
wait
nproc > "$OUT/nproc.txt"; python -c "import torch; print(torch.__version__)" >> "$OUT/nproc.txt"
