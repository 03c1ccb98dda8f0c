#!/usr/bin/env bash
# On a GPU machine: find the GPU-relevant faults with real kernels and keep one minimal
# reproducer per fault as reproducers/gpu/<fault>.json (what tests/fuzz/campaign/test_reproducers.py
# replays under `pytest -m gpu`).  Usage: scripts/make_gpu_reproducers.sh [OUTDIR]
set -euo pipefail
out=${1:-out/gpu-faults}
faults=(graph_stale_max_seqlen pp_shared_staging_buffer stale_query_start_loc_tail intermediate_copy_unsynced)
args=(); for f in "${faults[@]}"; do args+=(--fault "$f"); done
python -m fuzz.cli selftest --device cuda --attention-backend torch_flash --dtype bfloat16 \
    --budget-per-fault 60 --json --out "$out" "${args[@]}" > "$out.json"
python - "$out.json" <<'PY'
import json, shutil, sys
for f in json.load(open(sys.argv[1]))["faults"]:
    if f["detected"]:
        shutil.copy(f["reproducer"], f"reproducers/gpu/{f['name']}.json")
    print(f["name"], "detected" if f["detected"] else "NOT DETECTED", f["seconds"], f["property"])
PY
