#!/usr/bin/env bash
# ci/merge.sh: one nightly from the shards of a sharded one (`ci/nightly.sh --shard K/N`, one
# machine each): the merged summary, report, job summary, reproducers and example database.
#
#   ci/merge.sh --from DIR [--out DIR]
#
#   --from DIR   one subdirectory per shard, each as `ci/nightly.sh --out` wrote it
#                (summary.json, reproducers/, example-db/): e.g. the shards' CI artifacts
#                downloaded side by side
#   --out DIR    where the merged nightly goes (default out/nightly)
#
# Writes DIR/summary.json (`llmfuzz merge --json`: per-cell totals, one finding per failure,
# the smallest reproducer, the others listed), DIR/report.html, DIR/job_summary.md,
# DIR/reproducers/ (every shard's; their summaries name them by these paths when each shard
# ran with the same --out) and DIR/example-db/ (the union of the shards' databases, added to
# what DIR/example-db holds: next night's $LLMFUZZ_DB).
# Exit code as llmfuzz's: 0 clean, 1 failures found, 2 bad input or no shard summary.
set -uo pipefail

# shellcheck source=ci/lib.sh
source "$(dirname "$0")/lib.sh"

opt=([out]=out/nightly [from]="")
parse_args "out from" "" "$@"
out=${opt[out]} from=${opt[from]}
[[ -n $from && -d $from ]] || die "--from: '$from' is not a directory of shard results"
llmfuzz_python

summaries=() dbs=()
for d in "$from"/*/; do
    if is_json "$d/summary.json"; then summaries+=("$d/summary.json"); fi
    if [[ -d $d/example-db ]]; then dbs+=("$d/example-db"); fi
done
((${#summaries[@]})) || die "--from $from: no shard's summary.json in its subdirectories"
mkdir -p "$out/reproducers" "$out/example-db" || die "cannot create --out $out"
for d in "$from"/*/; do
    if [[ -d $d/reproducers ]]; then cp -R "$d/reproducers/." "$out/reproducers/"; fi
done

db_args=()
if ((${#dbs[@]})); then db_args=(--db "${dbs[@]}" --db-into "$out/example-db"); fi
echo "ci/merge.sh: merging ${#summaries[@]} shard(s) -> $out" >&2
llmfuzz merge "${summaries[@]}" --json --html "$out/report.html" --title "llmfuzz nightly" \
    "${db_args[@]}" >"$out/summary.json"
rc=$?
if ! is_json "$out/summary.json"; then
    rm -f "$out/summary.json"
    echo "ci/merge.sh: llmfuzz merge exited $rc without a summary" >&2
    exit $((rc == 0 ? 2 : rc))
fi
hint=""
if [[ -n ${GITHUB_RUN_ID:-} ]]; then
    hint="Download the reproducers: \`gh run download ${GITHUB_RUN_ID} -n llmfuzz-reproducers -D $out/reproducers\`, then:"
fi
"$PYTHON" -m fuzz.report "$out/summary.json" --markdown "$out/job_summary.md" --title "llmfuzz nightly" \
    ${hint:+--download-hint "$hint"} || { echo "ci/merge.sh: job summary failed" >&2; exit 2; }
echo "ci/merge.sh: wrote $out/summary.json $out/report.html $out/job_summary.md" >&2
exit "$rc"
