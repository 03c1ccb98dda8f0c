#!/usr/bin/env bash
# Every verdict figure of the current tree in one device call, bounded by $WALL seconds
# (default 560): on a GPU host with 16+ cores and one or two H200s.
#
#   WALL=560 BPF=30 GPU_BPF=20 PARTS=2 TCB=300 bash bench/device_verify.sh "$OUT"
#
# With flash-attn-4 (bench/fa4_device.sh part1 first, with .fa4/p1; then this call carrying
# .fa4/p2) the flash_attn kernel gets a selftest too; without it, torch_flash only.
# In parallel:
# - CPU selftests of every registered fault in fp32, bf16, --everywhere and --poison stale, each
#   mode split over $PARTS processes by fault, $BPF s a fault (default 12);
# - CPU campaigns, fp32 and bf16, with --jobs 3 each, for what the wall leaves (CAMPAIGNS=0: none);
# - GPU (the first one): `pytest -m gpu`; a bf16 selftest per kernel there is, each split over
#   $PARTS processes, $GPU_BPF s a fault (default $BPF); with TCB=S, a transformers-cb campaign on
#   CUDA of S seconds (its plan: bf16, CUDA graphs on and off, async batching); with a second
#   GPU, a bf16 torch_flash campaign there for what the wall leaves. With GPU_CAMPAIGN=S, a bf16
#   torch_flash campaign of S seconds on the first GPU; with GPU_DETERMINISM=S, a bf16 campaign of
#   S seconds on the last kernel with --oracle determinism (every Case re-run under another
#   Schedule and compared bit for bit: schedule invariance measured on CUDA). allreduce_arrival_order,
#   which only that oracle can see, gets a GPU selftest of its own with --oracle determinism.
# SOLO="F ..." gives each of those faults a GPU selftest process of its own, $SOLO_BPF s (default
# $GPU_BPF; allreduce_arrival_order's gets it too): the faults that need tens of examples, which
# a GPU time-sliced by a dozen processes runs at about one a second each.
# KERNELS="flash_attn" (say) limits the GPU work to those kernels.
# Everything is packed into $OUT/device_verify.tgz.
set -uo pipefail
FINAL="${1:?output directory}"
R=$(mktemp -d)
WALL=${WALL:-560}
BPF=${BPF:-12}
GPU_BPF=${GPU_BPF:-$BPF}
SOLO_BPF=${SOLO_BPF:-$GPU_BPF}
PARTS=${PARTS:-2}
CAMPAIGNS=${CAMPAIGNS:-1}
CPU_SELFTESTS=${CPU_SELFTESTS:-1}
TCB=${TCB:-0}
T0=$(date +%s)
left() { echo $(( WALL - 20 - ($(date +%s) - T0) )); }
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$HOME/fa4/cache
if [[ ! -d $HOME/fa4/site/flash_attn && -d .fa4/p2 && -n "$(ls "$HOME"/fa4/part.* 2>/dev/null)" ]]; then
    cat "$HOME"/fa4/part.* .fa4/p2/* | xz -d | (mkdir -p "$HOME/fa4/site" && tar -x -C "$HOME/fa4/site")
fi
if [[ -z ${KERNELS:-} ]]; then
    KERNELS=torch_flash
    [[ -d $HOME/fa4/site/flash_attn ]] && KERNELS="torch_flash flash_attn"
fi
export PYTHONPATH=$HOME/fa4/site:$HOME/fa4/site/nvidia_cutlass_dsl/dsl_packages:$PWD
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
read -r -a FAULTS <<<"$(python3 -c 'from engine.faults import FAULTS; print(" ".join(sorted(FAULTS)))')"
selftest() {  # selftest NAME BPF ARGS...: the faults dealt over $PARTS processes, JSON in $R/NAME.K.json
    local name=$1 bpf=$2 k i faults
    shift 2
    for ((k = 0; k < PARTS; k++)); do
        faults=()
        for ((i = k; i < ${#FAULTS[@]}; i += PARTS)); do
            [[ $name == *h200* && ${FAULTS[i]} == allreduce_arrival_order ]] && continue  # its own, below
            [[ $name == *h200* && " ${SOLO:-} " == *" ${FAULTS[i]} "* ]] && continue  # its own, below
            faults+=(--fault "${FAULTS[i]}")
        done
        (timeout -k 20 -s INT "$(left)" python3 -m fuzz.cli selftest --json --budget-per-fault "$bpf" \
            --out "/tmp/st-$name-$k" "$@" "${faults[@]}" >"$R/$name.$k.json" 2>"$R/$name.$k.err") &
    done
}
if [[ $CPU_SELFTESTS != 0 ]]; then
    selftest selftest_cpu_fp32 "$BPF" --device cpu
    selftest selftest_cpu_bf16 "$BPF" --device cpu --dtype bfloat16
    selftest selftest_cpu_fp32_everywhere "$BPF" --device cpu --everywhere
    selftest selftest_cpu_fp32_poison_stale "$BPF" --device cpu --poison stale
fi
if [[ $CAMPAIGNS != 0 ]]; then
    for dt in float32 bfloat16; do
        b=$(( $(left) - 90 ))
        (timeout -k 10 -s INT $(( b + 80 )) python3 -m fuzz.cli run --device cpu --dtype $dt --budget "$b" --jobs 3 \
            --seed 11 --out "/tmp/run-$dt" --json >"$R/campaign_cpu_${dt}_${b}s.json" 2>"$R/campaign_cpu_$dt.err") &
    done
fi
if (( GPUS > 0 )); then
    export CUDA_VISIBLE_DEVICES=0
    [[ ${GPU_PYTEST:-1} != 0 ]] && (timeout 240 python3 -m pytest -q -m gpu -rs tests -p no:cacheprovider >"$R/pytest_gpu.txt" 2>&1) &
    for kernel in $KERNELS; do
        selftest "selftest_h200_bf16_$kernel" "$GPU_BPF" --device cuda --dtype bfloat16 --attention-backend "$kernel"
        (timeout -k 20 -s INT "$(left)" python3 -m fuzz.cli selftest --json --budget-per-fault "$SOLO_BPF" \
            --out "/tmp/st-det-$kernel" --device cuda --dtype bfloat16 --attention-backend "$kernel" \
            --oracle determinism --fault allreduce_arrival_order \
            >"$R/selftest_h200_bf16_$kernel.determinism.json" 2>"$R/selftest_h200_bf16_$kernel.determinism.err") &
        for f in ${SOLO:-}; do  # the faults that need many examples: a process each, the whole wall
            (timeout -k 20 -s INT "$(left)" python3 -m fuzz.cli selftest --json --budget-per-fault "$SOLO_BPF" \
                --out "/tmp/st-$kernel-$f" --device cuda --dtype bfloat16 --attention-backend "$kernel" --fault "$f" \
                >"$R/selftest_h200_bf16_$kernel.$f.json" 2>"$R/selftest_h200_bf16_$kernel.$f.err") &
        done
    done
    if (( ${GPU_CAMPAIGN:-0} > 0 )); then
        (timeout -k 10 -s INT $(( GPU_CAMPAIGN + 120 )) python3 -m fuzz.cli run --device cuda --dtype bfloat16 \
            --attention-backend torch_flash --budget "$GPU_CAMPAIGN" --shrink-budget 60 --seed 0 --out /tmp/run-gpu1 \
            --json >"$R/campaign_h200_bf16_torch_flash_${GPU_CAMPAIGN}s.json" 2>"$R/campaign_h200_bf16_torch_flash.err") &
    fi
    if (( ${GPU_DETERMINISM:-0} > 0 )); then
        last=${KERNELS##* }
        (timeout -k 10 -s INT $(( GPU_DETERMINISM + 120 )) python3 -m fuzz.cli run --device cuda --dtype bfloat16 \
            --attention-backend "$last" --oracle determinism --budget "$GPU_DETERMINISM" --shrink-budget 60 --seed 1 \
            --out /tmp/run-gpu-det --json >"$R/campaign_h200_bf16_${last}_determinism_${GPU_DETERMINISM}s.json" \
            2>"$R/campaign_h200_bf16_${last}_determinism.err"
         tar czf "$R/determinism_reproducers.tgz" -C /tmp run-gpu-det 2>/dev/null) &
    fi
    if (( TCB > 0 )); then
        (timeout -k 10 -s INT $(( TCB + 120 )) python3 -m fuzz.cli run --target transformers-cb --device cuda \
            --budget "$TCB" --shrink-budget 60 --seed 1 --out /tmp/run-tcb --json \
            >"$R/campaign_h200_transformers_cb.json" 2>"$R/campaign_h200_transformers_cb.err"
         tar czf "$R/tcb_reproducers.tgz" -C /tmp run-tcb 2>/dev/null) &
    fi
    if (( GPUS > 1 )); then
        b=$(( $(left) - 40 ))
        (export CUDA_VISIBLE_DEVICES=1
         timeout -k 10 -s INT $(( b + 30 )) python3 -m fuzz.cli run --device cuda --dtype bfloat16 \
            --attention-backend torch_flash --budget "$b" --seed 0 --out /tmp/run-gpu --json \
            >"$R/campaign_h200_bf16_torch_flash.json" 2>"$R/campaign_h200_bf16_torch_flash.err") &
    fi
fi
wait
{ nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  echo "kernels: $KERNELS"; echo "faults: ${FAULTS[*]}"; echo "parts: $PARTS, bpf: $BPF cpu, $GPU_BPF gpu"
  echo "wall: $(( $(date +%s) - T0 )) s of $WALL"; } >"$R/host.txt" 2>&1
tar czf "$FINAL/device_verify.tgz" -C "$R" .
