#!/usr/bin/env bash
# `llmfuzz mutate` on a device host's CPU cores, across device calls: a mutation run on the
# reference engine takes longer than one call may (60 mutants at 120 s on 16 cores: ~17
# minutes), so `start` leaves it running in its own process session and `collect`, in a later
# call made while the machine is still held, waits for it and packs the reports.
#
#   SEEDS="7001 7002" N=60 BPM=120 JOBS=7 bash bench/device_mutate.sh start     # returns at once
#   WAIT=540 bash bench/device_mutate.sh collect "$OUT"                          # <= WAIT s
#
# Each seed runs as `llmfuzz mutate --n N --seed S --budget-per-mutant BPM --jobs JOBS --json`
# (JOBS mutants at once per seed), its report in /tmp/mutate/seed_S.json and its log beside.
# `collect` packs /tmp/mutate into $OUT/mutate.tgz; a seed still running at WAIT is packed as
# far as it got (its .err says where) and named as unfinished on stdout.
set -uo pipefail
phase=${1:?start|collect}
D=/tmp/mutate
case "$phase" in
start)
    mkdir -p "$D"
    # Run from a frozen copy of the tree: a later device call syncs the working tree again, and
    # mutants started after that would otherwise mutate (and run) a different engine.
    rm -rf "$D/tree" && mkdir -p "$D/tree" && tar --exclude=.git -cf - . | tar -xf - -C "$D/tree" && cd "$D/tree"
    export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
    for s in ${SEEDS:-7001 7002}; do
        setsid nohup python3 -m fuzz.cli mutate --n "${N:-60}" --seed "$s" --budget-per-mutant "${BPM:-120}" \
            --jobs "${JOBS:-7}" --json --out "$D/out_$s" >"$D/seed_$s.json" 2>"$D/seed_$s.err" </dev/null &
        echo "$!" >"$D/seed_$s.pid"
    done
    echo "device_mutate.sh: started seeds ${SEEDS:-7001 7002} at $(date -u +%H:%M:%S)"
    ;;
collect)
    OUT=${2:?output directory}
    end=$(( $(date +%s) + ${WAIT:-540} ))
    for p in "$D"/seed_*.pid; do
        while kill -0 "$(cat "$p")" 2>/dev/null && (( $(date +%s) < end )); do sleep 5; done
        kill -0 "$(cat "$p")" 2>/dev/null && echo "device_mutate.sh: $(basename "$p" .pid) unfinished at WAIT"
    done
    nproc >"$D/host.txt"
    tar czf "$OUT/mutate.tgz" -C "$D" --exclude=./tree .
    ;;
*) echo "device_mutate.sh: start or collect, not '$phase'" >&2; exit 2 ;;
esac
