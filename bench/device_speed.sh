#!/usr/bin/env bash
# Speed on a many-core host (CPU only, GPUs hidden):
# `llmfuzz bench --quick --json` for a baseline tree (d8b20ee here) and HEAD, side by
# side (in-process CPU cells, plus the GPU cells the host has), and `--jobs 16` against `--jobs 1`.
# (With CUDA_VISIBLE_DEVICES="" the CUDA build of torch 2.11 there segfaulted in 3 of 5 runs.)
#
#   rm -rf bench-out/{before,after} && mkdir -p bench-out/{before,after}
#   git archive d8b20ee | tar -x -C bench-out/before && git archive HEAD | tar -x -C bench-out/after
#   bash bench/device_speed.sh "$OUT"          # on the host, from the repository root
set -uo pipefail
OUT="${1:?output directory}"
export PYTHONFAULTHANDLER=1  # a crash leaves its stack in the .err file
B=bench-out/before A=bench-out/after
(cd "$A" && PYTHONPATH=. timeout 560 python bench/jobs_scaling.py --jobs 16 --budget 40 --shrink-budget 20 \
    > "$OUT/jobs_scaling_jobs16.json" 2> "$OUT/jobs_scaling.err") &
(cd "$B" && PYTHONPATH=. timeout 560 python -m fuzz.cli bench --quick --json > "$OUT/bench_quick_before.json" 2> "$OUT/before.err") &
(cd "$A" && PYTHONPATH=. timeout 560 python -m fuzz.cli bench --quick --json > "$OUT/bench_quick_after.json" 2> "$OUT/after.err") &
wait
nproc > "$OUT/nproc.txt"; python -c "import torch; print(torch.__version__)" >> "$OUT/nproc.txt"
