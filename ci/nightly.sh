#!/usr/bin/env bash
# ci/nightly.sh: the nightly fuzz run, the same commands on any machine as in CI
# (.github/workflows/nightly.yml): fuzz campaign, selftest, mutation score, report.
#
#   ci/nightly.sh [--budget SECONDS] [--out DIR] [--selftest-budget SECONDS]
#                 [--layouts L] [--modes M] [--seed N] [--fault NAME]... [--jobs J]
#                 [--shard K/N | --shards N] [--mutate N [--mutate-seed S] [--mutate-budget SECONDS]]
#
#   --budget S           fuzz campaign time budget (default 600); the shrink phase after it
#                        runs up to max(60 s, budget/4) more
#   --out DIR            where everything goes (default out/nightly, which .gitignore ignores)
#   --selftest-budget S  seconds per fault for `llmfuzz selftest` (default 60; 0 skips it:
#                        the CI fuzz job does, because selftest is its own job there)
#   --layouts, --modes, --seed, --fault, --jobs   passed to `llmfuzz run`
#   --shard K/N          passed to `llmfuzz run`: this machine's share of a campaign N run
#                        between them; ci/merge.sh puts the N results together
#   --mutate N           after the selftest, `llmfuzz mutate --n N` on a fresh seed (the date's,
#                        or --mutate-seed S) with --mutate-budget seconds a mutant (default 60);
#                        the score goes into the report (default 0: no mutation run)
#   --shards N           the CI matrix on this machine: N shards at once, each `--shard K/N`
#                        for the whole budget with its share of the cores (--jobs, default
#                        cores/N) into DIR/shards/K, one shared example database, then
#                        ci/merge.sh into DIR; the selftest and report follow on the merged run
#
# Writes DIR/summary.json (`llmfuzz run --json`), DIR/reproducers/, DIR/selftest.json,
# DIR/report.html, DIR/job_summary.md (Markdown: failures and their replay commands), and with
# --mutate DIR/mutate.json (`llmfuzz mutate --json`; its survivors under DIR/mutate/).
# The Hypothesis example database is $LLMFUZZ_DB (default DIR/example-db): point it at the
# previous night's copy to replay what was found before.
# Exit code as llmfuzz's: 0 clean, 1 failures found (or a fault the selftest missed),
# 2 bad input, 130 interrupted before any summary.
set -uo pipefail

# shellcheck source=ci/lib.sh
source "$(dirname "$0")/lib.sh"

opt=([budget]=600 [out]=out/nightly [selftest-budget]=60 [mutate]=0 [mutate-budget]=60
     [mutate-seed]=$(( $(date -u +%Y) * 1000 + 10#$(date -u +%j) )))
opt[shards]=""
parse_args "budget out selftest-budget shards mutate mutate-seed mutate-budget" "layouts modes seed fault shard jobs" "$@"
budget=${opt[budget]} out=${opt[out]} selftest_budget=${opt[selftest-budget]} shards=${opt[shards]}
mutate_n=${opt[mutate]} mutate_seed=${opt[mutate-seed]} mutate_budget=${opt[mutate-budget]}
[[ $mutate_n =~ ^[0-9]+$ ]] || die "--mutate: '$mutate_n' is not a whole number of mutants"
[[ $mutate_seed =~ ^[0-9]+$ ]] || die "--mutate-seed: '$mutate_seed' is not a whole number"
is_num "$mutate_budget" || die "--mutate-budget: '$mutate_budget' is not a number of seconds"
is_num "$budget" || die "--budget: '$budget' is not a number of seconds"
is_num "$selftest_budget" || die "--selftest-budget: '$selftest_budget' is not a number of seconds"
if [[ -n $shards ]]; then
    [[ $shards =~ ^[1-9][0-9]*$ ]] || die "--shards: '$shards' is not a positive whole number"
    [[ " ${run_extra[*]} " != *" --shard "* ]] || die "--shards and --shard: give one (--shard is one machine's share)"
fi
llmfuzz_python

# --shards N: this script N times at once as the matrix's machines (`--shard K/N`, the cores
# dealt between them, one example database they all read and write), then ci/merge.sh. Sets
# run_rc: merge's exit code, or a shard's that ended without a summary (2, 130) when merge's is 0.
run_shards() {
    local k jobs=() pids=() rcs=() self
    self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
    [[ " ${run_extra[*]} " == *" --jobs "* ]] || jobs=(--jobs $(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 )))
    rm -rf "$out/shards"
    echo "ci/nightly.sh: $shards shards at once for ${budget}s each (database $LLMFUZZ_DB) -> $out/shards" >&2
    for ((k = 1; k <= shards; k++)); do
        bash "$self" --budget "$budget" --out "$out/shards/$k" --selftest-budget 0 --shard "$k/$shards" \
            "${jobs[@]}" "${run_extra[@]}" &
        pids+=($!)
    done
    trap 'kill -INT "${pids[@]}" 2>/dev/null' INT
    trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
    for k in "${!pids[@]}"; do
        while :; do
            wait "${pids[$k]}"; rcs[k]=$?
            kill -0 "${pids[$k]}" 2>/dev/null || break  # a trapped signal interrupted the wait
        done
    done
    trap - INT TERM
    forwarding bash "$(dirname "$self")/merge.sh" --from "$out/shards" --out "$out"
    run_rc=$rc
    for k in "${!rcs[@]}"; do
        if ((rcs[k] != 0 && rcs[k] != 1)); then
            echo "ci/nightly.sh: shard $((k + 1))/$shards exited ${rcs[k]}" >&2
            ((run_rc == 0)) && run_rc=${rcs[k]}
        fi
    done
}

mkdir -p "$out" || die "cannot create --out $out"
export LLMFUZZ_PROFILE=nightly
export LLMFUZZ_DB=${LLMFUZZ_DB:-$out/example-db}
mkdir -p "$LLMFUZZ_DB"  # Hypothesis creates it lazily; the CI upload wants it to exist
rm -f "$out/summary.json" "$out/selftest.json" "$out/mutate.json" "$out/report.html" "$out/job_summary.md"

if [[ -n $shards ]]; then
    run_shards
else
    echo "ci/nightly.sh: fuzzing for ${budget}s (database $LLMFUZZ_DB) -> $out" >&2
    forwarding llmfuzz run --profile nightly --budget "$budget" --json --out "$out/reproducers" \
        "${run_extra[@]}" >"$out/summary.json"
    run_rc=$rc
fi
if ! is_json "$out/summary.json"; then
    rm -f "$out/summary.json"
    printf '## llmfuzz nightly\n\n**llmfuzz run exited %s without a summary** (see the log).\n' "$run_rc" \
        >"$out/job_summary.md"
    echo "ci/nightly.sh: llmfuzz run exited $run_rc without a summary" >&2
    exit $((run_rc == 0 ? 2 : run_rc))
fi

st_rc=0 st_args=()
if [[ $selftest_budget != 0 && $selftest_budget != 0.0 ]]; then
    echo "ci/nightly.sh: selftest, ${selftest_budget}s per fault" >&2
    # Its own throwaway database: fault-triggered examples must not enter the nightly one.
    forwarding env LLMFUZZ_DB="$out/selftest-db" llmfuzz selftest --profile nightly --json \
        --budget-per-fault "$selftest_budget" --out "$out/selftest-reproducers" >"$out/selftest.json"
    st_rc=$rc
    if is_json "$out/selftest.json"; then
        st_args=(--selftest "$out/selftest.json")
    else
        rm -f "$out/selftest.json"
        echo "ci/nightly.sh: llmfuzz selftest exited $st_rc without a summary" >&2
        ((st_rc == 0)) && st_rc=2
    fi
fi

mu_rc=0
if ((mutate_n > 0)); then
    # How strong the green run is: mutants of the engine's bookkeeping on a seed no night used
    # before (docs/mutate.md). A low score fails nothing; a run that cannot finish is reported.
    echo "ci/nightly.sh: llmfuzz mutate --n $mutate_n --seed $mutate_seed, ${mutate_budget}s a mutant" >&2
    forwarding llmfuzz mutate --n "$mutate_n" --seed "$mutate_seed" --budget-per-mutant "$mutate_budget" \
        --jobs "$(nproc)" --json --out "$out/mutate" >"$out/mutate.json"
    mu_rc=$rc
    if is_json "$out/mutate.json"; then
        st_args+=(--mutate "$out/mutate.json")
    else
        rm -f "$out/mutate.json"
        echo "ci/nightly.sh: llmfuzz mutate exited $mu_rc without a report" >&2
    fi
fi

hint=""
if [[ -n ${GITHUB_RUN_ID:-} ]]; then
    hint="Download the reproducers: \`gh run download ${GITHUB_RUN_ID} -n llmfuzz-reproducers -D $out/reproducers\`, then:"
fi
"$PYTHON" -m fuzz.report "$out/summary.json" "${st_args[@]}" --html "$out/report.html" \
    --markdown "$out/job_summary.md" --title "llmfuzz nightly" ${hint:+--download-hint "$hint"} \
    || { echo "ci/nightly.sh: report failed" >&2; exit 2; }
echo "ci/nightly.sh: wrote $out/summary.json $out/report.html $out/job_summary.md" >&2

for code in 130 2 1; do
    if ((run_rc == code || st_rc == code)); then exit "$code"; fi
done
((mu_rc == 130 || mu_rc == 2)) && exit "$mu_rc"
((run_rc == 0 && st_rc == 0)) || exit 1
exit 0
