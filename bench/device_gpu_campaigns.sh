#!/usr/bin/env bash
# The GPU figures of one H200 host in one device call, bounded by $WALL seconds (default 560):
#
#   WALL=560 BUDGET=300 bash bench/device_gpu_campaigns.sh "$OUT"
#
# In parallel on the one GPU:
# - `pytest -m gpu` (the GPU tests, first, so a failure is named);
# - a bf16 torch_flash campaign of the reference engine, $BUDGET s, default --jobs;
# - a transformers-cb campaign on CUDA in bf16, $BUDGET s (its plan has CUDA graphs on and off);
# - a bf16 torch_flash selftest of every registered fault, $BPF s a fault (default 12), split
#   over two processes by fault halves.
# Everything is packed into $OUT/device_gpu_campaigns.tgz.
set -uo pipefail
FINAL="${1:?output directory}"
R=$(mktemp -d)
WALL=${WALL:-560}
BUDGET=${BUDGET:-300}
BPF=${BPF:-12}
T0=$(date +%s)
left() { echo $(( WALL - 20 - ($(date +%s) - T0) )); }
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
read -r -a FAULTS <<<"$(python3 -c 'from engine.faults import FAULTS; print(" ".join(sorted(FAULTS)))')"
half=$(( (${#FAULTS[@]} + 1) / 2 ))
(timeout 200 python3 -m pytest -q -m gpu -rs tests -p no:cacheprovider >"$R/pytest_gpu.txt" 2>&1) &
(timeout -k 10 -s INT $(( BUDGET + 120 )) python3 -m fuzz.cli run --device cuda --dtype bfloat16 \
    --attention-backend torch_flash --budget "$BUDGET" --shrink-budget 60 --seed 0 --out /tmp/run-gpu --json \
    >"$R/campaign_h200_bf16_torch_flash_${BUDGET}s.json" 2>"$R/campaign_h200_bf16_torch_flash.err") &
(timeout -k 10 -s INT $(( BUDGET + 120 )) python3 -m fuzz.cli run --target transformers-cb --device cuda \
    --budget "$BUDGET" --shrink-budget 60 --seed 0 --out /tmp/run-tcb --json \
    >"$R/campaign_h200_transformers_cb_${BUDGET}s.json" 2>"$R/campaign_h200_transformers_cb.err"
 tar czf "$R/tcb_reproducers.tgz" -C /tmp run-tcb 2>/dev/null) &
for part in a b; do
    if [[ $part == a ]]; then faults=("${FAULTS[@]:0:half}"); else faults=("${FAULTS[@]:half}"); fi
    (timeout -k 20 -s INT "$(left)" python3 -m fuzz.cli selftest --json --device cuda --dtype bfloat16 \
        --attention-backend torch_flash --budget-per-fault "$BPF" --out "/tmp/st-$part" \
        $(printf -- '--fault %s ' "${faults[@]}") \
        >"$R/selftest_h200_bf16_torch_flash.$part.json" 2>"$R/selftest_h200_bf16_torch_flash.$part.err") &
done
wait
{ nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
  echo "faults: ${FAULTS[*]}"; echo "wall: $(( $(date +%s) - T0 )) s of $WALL"; } >"$R/host.txt" 2>&1
tar czf "$FINAL/device_gpu_campaigns.tgz" -C "$R" .
