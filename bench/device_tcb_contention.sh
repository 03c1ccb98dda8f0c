#!/usr/bin/env bash
# transformers-cb's async-batching finding under the tool's own contention, on one GPU host:
#   PYTHONPATH=$PWD bash bench/device_tcb_contention.sh OUT [WHEEL_DIR]
# 1. each reproducer under reproducers/transformers_cb/ recorded on CUDA, replayed by llmfuzz
#    under --contention (default gpu:3,cpu:6; TCB_CONTENTION), TCB_REPLAYS times: its rate;
# 2. the stand-alone script docs/findings/transformers_cb_async_race.py: async on/off x
#    graphs on/off under stress, the failing pair on a quiet GPU, and CUDA_LAUNCH_BLOCKING=1;
# 3. with WHEEL_DIR: step 2's failing pair again on every transformers wheel in it.
# Every step has a time limit; OUT/summary.txt has a line per step, the rest is detail.
set -u
OUT=${1:?usage: device_tcb_contention.sh OUT [WHEEL_DIR]}
WHEELS=${2:-}
CONTENTION=${TCB_CONTENTION:-gpu:3,cpu:6}
REPLAYS=${TCB_REPLAYS:-4}
REPEAT=${TCB_REPEAT:-3}
STEPS=${TCB_STEPS:-replay,script,blocking,wheels}
mkdir -p "$OUT"
SUM="$OUT/summary.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0))" | tee -a "$SUM"
step() {  # step NAME LIMIT_S COMMAND...: run it, keep its output, one summary line
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s: $(tail -n 1 "$OUT/$name.out" | cut -c1-300)" | tee -a "$SUM"
}
SCRIPT=docs/findings/transformers_cb_async_race.py
if [[ $STEPS == *replay* ]]; then
    for f in $(grep -l '"device": "cuda"' -r reproducers/transformers_cb --include='*.json'); do
        step "replay-$(basename "$f" .json)" 300 python3 -m fuzz.cli replay "$f" --contention "$CONTENTION" \
            --replays "$REPLAYS" --json
        grep -h "Replayed" "$OUT/replay-$(basename "$f" .json).err" | tee -a "$SUM"
    done
fi
if [[ $STEPS == *script* ]]; then
    for a in on off; do for g in on off; do
        step "script-async$a-graphs$g" 150 python3 "$SCRIPT" --async $a --graphs $g --repeat "$REPEAT"
    done; done
    step "script-quiet-asyncon-graphson" 150 python3 "$SCRIPT" --stress 0 --cpu 0 --repeat "$REPEAT"
fi
if [[ $STEPS == *blocking* ]]; then
    CUDA_LAUNCH_BLOCKING=1 step "script-launch-blocking" 200 python3 "$SCRIPT" --repeat "$REPEAT"
    grep -h -m 5 -E "Assertion|assert|\.cu:|AcceleratorError|CUDA error" "$OUT/script-launch-blocking.err" \
        | cut -c1-400 | tee -a "$SUM"
fi
if [[ $STEPS == *wheels* && -n $WHEELS ]]; then
    for w in "$WHEELS"/transformers-*.whl; do
        v=$(basename "$w" | cut -d- -f2)
        pip install -q --no-deps --target "/tmp/tf-$v" "$w" >/dev/null 2>&1 || { echo "wheel $v: install failed" | tee -a "$SUM"; continue; }
        PYTHONPATH="/tmp/tf-$v:${PYTHONPATH:-}" step "script-tf$v-asyncon" 150 python3 "$SCRIPT" --repeat "$REPEAT"
        PYTHONPATH="/tmp/tf-$v:${PYTHONPATH:-}" step "script-tf$v-asyncoff" 150 python3 "$SCRIPT" --async off \
            --repeat "$REPEAT"
    done
fi
