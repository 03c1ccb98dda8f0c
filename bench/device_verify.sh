#!/usr/bin/env bash
# Every verdict figure of the current tree in one device call, bounded by $WALL seconds
# (default 560): on a GPU host with 16+ cores, one or two H200s.
#
#   WALL=560 bash bench/device_verify.sh "$OUT"
#
# With flash-attn-4 (bench/fa4_device.sh part1 first, with .fa4/p1; then this call carrying
# .fa4/p2) the flash_attn kernel gets a selftest too; without it, torch_flash only.
# In parallel:
# - CPU selftests of every registered fault in fp32, bf16, --everywhere and --poison stale, each
#   mode split over two processes by fault (halves), $BPF s a fault (default 12);
# - CPU campaigns, fp32 and bf16, with --jobs 3 each, for what the wall leaves;
# - GPU: `pytest -m gpu`, then bf16 selftests on the kernels there are (2 GPUs: one each), then a
#   bf16 campaign with torch_flash.
# Everything is packed into $OUT/device_verify.tgz.
set -uo pipefail
FINAL="${1:?output directory}"
R=$(mktemp -d)
WALL=${WALL:-560}
BPF=${BPF:-12}
T0=$(date +%s)
left() { echo $(( WALL - 20 - ($(date +%s) - T0) )); }
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$HOME/fa4/cache
if [[ ! -d $HOME/fa4/site/flash_attn && -d .fa4/p2 && -n "$(ls "$HOME"/fa4/part.* 2>/dev/null)" ]]; then
    cat "$HOME"/fa4/part.* .fa4/p2/* | xz -d | (mkdir -p "$HOME/fa4/site" && tar -x -C "$HOME/fa4/site")
fi
KERNELS=torch_flash
[[ -d $HOME/fa4/site/flash_attn ]] && KERNELS="torch_flash flash_attn"
export PYTHONPATH=$HOME/fa4/site:$HOME/fa4/site/nvidia_cutlass_dsl/dsl_packages:$PWD
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
read -r -a FAULTS <<<"$(python3 -c 'from engine.faults import FAULTS; print(" ".join(sorted(FAULTS)))')"
half=$(( (${#FAULTS[@]} + 1) / 2 ))
selftest() {  # selftest NAME ARGS...: both halves of the faults, JSON in $R/NAME.{a,b}.json
    local name=$1; shift
    local part faults
    for part in a b; do
        if [[ $part == a ]]; then faults=("${FAULTS[@]:0:half}"); else faults=("${FAULTS[@]:half}"); fi
        (timeout -k 20 -s INT "$(left)" python3 -m fuzz.cli selftest --json --budget-per-fault "$BPF" \
            --out "/tmp/st-$name-$part" "$@" $(printf -- '--fault %s ' "${faults[@]}") \
            >"$R/$name.$part.json" 2>"$R/$name.$part.err") &
    done
}
selftest selftest_cpu_fp32 --device cpu
selftest selftest_cpu_bf16 --device cpu --dtype bfloat16
selftest selftest_cpu_fp32_everywhere --device cpu --everywhere
selftest selftest_cpu_fp32_poison_stale --device cpu --poison stale
for dt in float32 bfloat16; do
    b=$(( $(left) - 90 ))
    (timeout -k 10 -s INT $(( b + 80 )) python3 -m fuzz.cli run --device cpu --dtype $dt --budget "$b" --jobs 3 \
        --seed 11 --out "/tmp/run-$dt" --json >"$R/campaign_cpu_${dt}_${b}s.json" 2>"$R/campaign_cpu_$dt.err") &
done
gpu_selftest() {  # gpu_selftest KERNEL: a bf16 selftest on this process's GPU
    timeout -k 10 -s INT "$(( $(left) * ${2:-1} / ${3:-1} ))" python3 -m fuzz.cli selftest --json --device cuda \
        --dtype bfloat16 --attention-backend "$1" --budget-per-fault "$BPF" --out "/tmp/st-$1" \
        >"$R/selftest_h200_bf16_$1.json" 2>"$R/selftest_h200_bf16_$1.err"
}
if (( GPUS > 0 )); then
    (export CUDA_VISIBLE_DEVICES=0
     timeout "$(( $(left) / 3 ))" python3 -m pytest -q -m gpu -rs tests -p no:cacheprovider >"$R/pytest_gpu.txt" 2>&1
     if (( GPUS > 1 )) || [[ $KERNELS == torch_flash ]]; then gpu_selftest torch_flash 2 3
     else gpu_selftest torch_flash 1 2; gpu_selftest flash_attn 1 1; fi
     b=$(( $(left) - 40 ))
     (( b > 30 )) && timeout -k 10 -s INT $(( b + 30 )) python3 -m fuzz.cli run --device cuda --dtype bfloat16 \
        --attention-backend torch_flash --budget "$b" --seed 0 --out /tmp/run-gpu --json \
        >"$R/campaign_h200_bf16_torch_flash_${b}s.json" 2>"$R/campaign_h200_bf16_torch_flash.err") &
    if (( GPUS > 1 )) && [[ $KERNELS == *flash_attn* ]]; then
        (export CUDA_VISIBLE_DEVICES=1; gpu_selftest flash_attn) &
    fi
fi
wait
{ nproc; python3 -c "import torch; print(torch.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  echo "kernels: $KERNELS"; echo "faults: ${FAULTS[*]}"; echo "wall: $(( $(date +%s) - T0 )) s of $WALL"; } >"$R/host.txt" 2>&1
tar czf "$FINAL/device_verify.tgz" -C "$R" .
