#!/usr/bin/env bash
# Triage of the wrong greedy tokens transformers-cb found on CUDA (docs/transformers_cb.md, the
# "not yet triaged" section): the library's behaviour or the harness's? Run from the repository
# root on the GPU host (nothing installed but torch and transformers; no network):
#
#     PYTHONPATH=$PWD bash scripts/tcb_cuda_triage.sh OUTDIR
#
# For each of the two reproducers: its model and requests exported (scripts/tcb_export.py),
# then the stand-alone check (scripts/cb_greedy_check.py: the library driven as the harness
# drives it, without the harness) in the failing config (CUDA graphs and async batching on,
# TRIAGE_REPEAT=5 batches) and with both off; the reproducers' gpu tests; the check with each
# switch alone; `llmfuzz replay` (python3 -m fuzz.cli replay) once each; the failing config
# with a hook on the LM head like the harness's logits tap; two more replays each. The other
# variants run TRIAGE_REPEAT_OTHER=3 batches. Each step has a time limit; past the budget
# (TRIAGE_BUDGET_S, default 330 s) the remaining steps are skipped and listed as skipped, so
# the whole stays under 6 minutes. OUTDIR/summary.txt: one line per step (exit status,
# seconds, verdict); OUTDIR/<reproducer>/<variant>.jsonl: the check's lines (.log: its
# stderr); OUTDIR/pytest.txt, OUTDIR/replay-*.json. TRIAGE_DEVICE=cpu: a smoke test anywhere.
set -u
out=${1:?usage: PYTHONPATH=\$PWD bash scripts/tcb_cuda_triage.sh OUTDIR}
budget=${TRIAGE_BUDGET_S:-330}
repeat=${TRIAGE_REPEAT:-5}
other=${TRIAGE_REPEAT_OTHER:-3}
device=${TRIAGE_DEVICE:-cuda}  # cpu: a smoke test of this script (graphs and async turned off there)
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
repros=(reproducers/transformers_cb/unreproduced/transformers_cb_batch_invariance/401dff3151eb.json
        reproducers/transformers_cb/unreproduced/transformers_cb_vs_reference/510e0b1acbd6.json)
mkdir -p "$out"
summary=$out/summary.txt
: > "$summary"
start=$SECONDS

# One line on what a step wrote: the check's verdict line, a replay's JSON, pytest's last line;
# the last line of its stderr where it wrote nothing.
digest() {
    "$py" - "$1" "$2" <<'PY' 2>/dev/null || tail -n 1 "$1" 2>/dev/null | cut -c1-300
import json, sys
lines = [l for l in open(sys.argv[1]) if l.strip()]
if not lines:
    err = [l for l in open(sys.argv[2], errors="replace") if l.strip()]
    print("stderr: " + (err[-1].strip()[:300] if err else "(empty)")); sys.exit()
last = lines[-1]
try:
    d = json.loads(last)
except ValueError:
    print(last.strip()[:300]); sys.exit()
if "verdict" in d and "replay_rate" in d:
    first = (d["differing"] or d["errors"] or d["near_ties"] or [None])[0]
    print(f"{d['verdict']} {d['replay_rate']} (near-tie repeats {d['repeats_near_tie']}) "
          f"attn={d['config']['attn_used']} offloads={[r['offloads'] for r in d['runs']]} first: {json.dumps(first)[:400]}")
elif "reproduces" in d:
    print(f"reproduces={d['reproduces']} {d['verdict']}: {(d['message'] or '')[:300]}")
else:
    print(last.strip()[:300])
PY
}

# step NAME LIMIT_S OUTFILE COMMAND...: run it under the smaller of its limit and the budget left.
step() {
    local name=$1 limit=$2 file=$3
    shift 3
    local left=$((budget - (SECONDS - start)))
    if ((left < 20)); then
        echo "$name: SKIPPED (budget of ${budget}s spent)" | tee -a "$summary"
        return
    fi
    ((limit > left)) && limit=$left
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$file" 2> "${file%.*}.log"
    local rc=$? late=""
    ((rc == 124 || rc == 137)) && late="TIMED OUT after ${limit}s; "
    echo "$name: rc=$rc $((SECONDS - t0))s $late$(digest "$file" "${file%.*}.log")" | tee -a "$summary"
}

{
    echo "started $(date -u +%FT%TZ) on $(hostname), device $device, budget ${budget}s, repeat $repeat/$other"
    nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv,noheader 2>&1
    "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1
} | tee -a "$summary"

names=()
for r in "${repros[@]}"; do
    n=$(basename "$r" .json)
    names+=("$n")
    step "export $n" 60 "$out/$n.export.txt" "$py" scripts/tcb_export.py "$r" "$out/$n"
done

# check NAME VARIANT FLAGS...: the stand-alone check on NAME's export.
check() {
    local n=$1 v=$2
    shift 2
    step "check $n $v" 90 "$out/$n/$v.jsonl" "$py" scripts/cb_greedy_check.py "$out/$n/model" "$out/$n/case.json" \
        --device "$device" --dtype bfloat16 --label "$v" "$@"
}

# graph1-async1 is the failing config: TRIAGE_REPEAT batches; in the first reproducer the
# wrong token was the run alone's, so its two requests also run alone 3 times there. Then
# both off, then each one alone, TRIAGE_REPEAT_OTHER batches each (a rate beside 5/5 or 0/5).
for n in "${names[@]}"; do
    solo=1
    [[ $n == 401dff3151eb ]] && solo=3
    check "$n" graph1-async1 --repeat "$repeat" --cuda-graph on --async-batching on --solo-repeat "$solo"
done
for n in "${names[@]}"; do check "$n" graph0-async0 --repeat "$other" --cuda-graph off --async-batching off; done

step "pytest -m gpu reproducers" 150 "$out/pytest.txt" \
    "$py" -m pytest -q -m gpu tests/fuzz/targets/transformers_cb/test_tcb_reproducers.py -rs
for n in "${names[@]}"; do check "$n" graph0-async1 --repeat "$other" --cuda-graph off --async-batching on; done
for n in "${names[@]}"; do check "$n" graph1-async0 --repeat "$other" --cuda-graph on --async-batching off; done
replay() {
    local k=$1 r n
    for r in "${repros[@]}"; do
        n=$(basename "$r" .json)
        step "replay $n #$k" 60 "$out/replay-$n-$k.json" "$py" -m fuzz.cli replay --json "$r"
    done
}
replay 1
# The harness adds a forward hook on the LM head (its logits tap), captured into the graphs:
# does it change the tokens? Before the second and third replays: if the check agrees and the
# replay fails, this is the next question.
for n in "${names[@]}"; do
    check "$n" graph1-async1-hook --repeat "$other" --cuda-graph on --async-batching on --lm-head-hook
done
replay 2
replay 3

echo "done in $((SECONDS - start))s; lines: $out/<reproducer>/<variant>.jsonl" | tee -a "$summary"
