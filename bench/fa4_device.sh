#!/usr/bin/env bash
# GPU measurements with flash-attn-4 on a 2 x H200 machine (2 x H200, `nvidia-h200-x2`), with the
# flash-attn-4 wheels (flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1 with its libs parts) packed
# with xz and split into .fa4/p1 and .fa4/p2 (the machine has no network). Three device calls, each within
# 30 s of the last (the machine stays warm that long; $HOME/fa4 lives as long as it does):
#
#   call 1, carry [".fa4/p1"]:  bash bench/fa4_device.sh part1
#   call 2, carry [".fa4/p2"]:  bash bench/fa4_device.sh single   # unpacks; one GPU per job
#   call 3:                     bash bench/fa4_device.sh double   # both GPUs, world=torch (NCCL)
#
# single: in parallel, `pytest -m gpu` (GPU 0), selftest --device cuda --dtype bfloat16 with
#   --attention-backend flash_attn (GPU 0) and torch_flash (GPU 1), and a single-GPU campaign per
#   kernel (flash_attn on GPU 0, torch_flash on GPU 1), each $BUDGET s (default 300).
# double: bench/nccl_graph.py (tp2pp1, tp1pp2: graph == eager bitwise over NCCL) for torch_flash and
#   flash_attn, beside a two-GPU campaign over tp2pp1,tp1pp2 x eager,graph in bf16 on torch_flash.
# Everything lands in $OUT/<phase>.tar.gz (plus the JSON files themselves, at most 7).
# KERNELS="flash_attn" (say) limits the single phase's selftests and campaigns to those kernels.
set -u
phase=${1:?part1|single|double}
BUDGET=${BUDGET:-300}
R=/tmp/fa4res/$phase
mkdir -p "$R"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$HOME/fa4/cache
export PYTHONPATH=$HOME/fa4/site:$HOME/fa4/site/nvidia_cutlass_dsl/dsl_packages:$PWD
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

finish() {
    tar -C /tmp/fa4res -czf "$OUT/$phase.tar.gz" "$phase"
    n=0
    for f in "$R"/*.json; do
        [[ -f $f && $n -lt 7 ]] && cp "$f" "$OUT/" && n=$((n + 1))
    done
    log "done; $(ls "$OUT" | tr '\n' ' ')"
}

case $phase in
part1)
    mkdir -p "$HOME/fa4" && cp .fa4/p1/* "$HOME/fa4/" && ls -la "$HOME/fa4"
    nvidia-smi -L
    python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
    ;;
single)
    if [[ ! -d $HOME/fa4/site/flash_attn ]]; then
        cat "$HOME"/fa4/part.* .fa4/p2/* | xz -d | (mkdir -p "$HOME/fa4/site" && tar -x -C "$HOME/fa4/site") \
            || { echo "unpack failed (did call 1 run on this machine?)"; exit 3; }
    fi
    log "unpacked"
    python3 - <<'EOF' 2>&1 | tee "$R/versions.txt"
import importlib.metadata as md, torch
from engine.attention.flash_attn_backend import probe
import flash_attn.cute  # noqa: F401  (the real import, CuTe DSL included)
print(probe().line())
print("torch", torch.__version__, "cuda", torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for d in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi", "hypothesis", "transformers"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "-")
EOF
    log "jobs start"
    (CUDA_VISIBLE_DEVICES=0 timeout 500 python3 -m pytest -m gpu -rs -s -q -p no:cacheprovider \
        --junitxml "$R/junit_gpu.xml" >"$R/pytest_gpu.log" 2>&1; echo "rc=$?" >>"$R/pytest_gpu.log") &
    for k in ${KERNELS:-flash_attn torch_flash}; do
        gpu=$([[ $k == flash_attn ]] && echo 0 || echo 1)
        (CUDA_VISIBLE_DEVICES=$gpu timeout -s INT 480 python3 -m fuzz.cli selftest --device cuda --dtype bfloat16 \
            --attention-backend $k --budget-per-fault 25 --seed 2 --out "$R/selftest_repro_$k" --json \
            >"$R/selftest_h200_bf16_$k.json" 2>"$R/selftest_$k.log"; echo "rc=$?" >>"$R/selftest_$k.log") &
        (CUDA_VISIBLE_DEVICES=$gpu timeout -s INT $((BUDGET + 170)) python3 -m fuzz.cli run --device cuda \
            --attention-backend $k --budget "$BUDGET" --seed 0 --out "$R/run_repro_$k" --json \
            >"$R/run${BUDGET}_h200_bf16_$k.json" 2>"$R/run_$k.log"; echo "rc=$?" >>"$R/run_$k.log") &
    done
    wait
    log "jobs done"
    tail -n 30 "$R/pytest_gpu.log"; tail -n 3 "$R"/*.log
    finish
    ;;
stale)
    # graph_stale_max_seqlen under flash_attn, cold (its own empty kernel cache, as the first
    # fault of a selftest in a fresh process is) and warm (after a 40 s graph campaign compiled
    # the fuzz model's kernels into the cache the selftest then reads).
    if [[ ! -d $HOME/fa4/site/flash_attn ]]; then
        cat "$HOME"/fa4/part.* .fa4/p2/* | xz -d | (mkdir -p "$HOME/fa4/site" && tar -x -C "$HOME/fa4/site") || exit 3
    fi
    log "unpacked"
    st=(python3 -m fuzz.cli selftest --device cuda --dtype bfloat16 --attention-backend flash_attn
        --fault graph_stale_max_seqlen --seed 2 --json)
    (export CUDA_VISIBLE_DEVICES=${COLD_GPU:-1} FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$HOME/fa4/cache_cold
     timeout -s INT 200 "${st[@]}" --budget-per-fault 90 --out "$R/repro_cold" \
        >"$R/selftest_h200_bf16_flash_attn_stale_cold90.json" 2>"$R/cold.log"; echo "rc=$?" >>"$R/cold.log") &
    (export CUDA_VISIBLE_DEVICES=0 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$HOME/fa4/cache_warm
     timeout -s INT 100 python3 -m fuzz.cli run --device cuda --attention-backend flash_attn --layouts tp1pp1 \
        --modes graph --budget 40 --seed 5 --out "$R/repro_warmup" --json >"$R/warmup_run40.json" 2>"$R/warmup.log"
     log "warm-up done"
     timeout -s INT 120 "${st[@]}" --budget-per-fault 25 --out "$R/repro_warm" \
        >"$R/selftest_h200_bf16_flash_attn_stale_warm25.json" 2>"$R/warm.log"; echo "rc=$?" >>"$R/warm.log") &
    wait
    log "jobs done"
    tail -n 2 "$R"/*.log
    finish
    ;;
double)
    python3 -c 'import torch; assert torch.cuda.device_count() >= 2, "needs 2 GPUs"' || exit 3
    log "start"
    (for k in torch_flash flash_attn; do
        timeout 200 python3 bench/nccl_graph.py --layouts tp2pp1,tp1pp2 --dtype bfloat16 --attention-backend $k \
            >"$R/nccl_graph_h200x2_bf16_$k.json" 2>"$R/nccl_graph_$k.log"; echo "rc=$?" >>"$R/nccl_graph_$k.log"
    done) &
    (timeout -s INT $((BUDGET + 170)) python3 -m fuzz.cli run --device cuda --world torch --layouts tp2pp1,tp1pp2 \
        --modes eager,graph --dtype bfloat16 --attention-backend torch_flash --budget "$BUDGET" --seed 0 \
        --out "$R/run_repro" --json >"$R/run${BUDGET}_h200x2_nccl_bf16_torch_flash.json" 2>"$R/run_nccl.log"
     echo "rc=$?" >>"$R/run_nccl.log") &
    wait
    log "jobs done"
    tail -n 3 "$R"/*.log
    finish
    ;;
esac
