#!/usr/bin/env bash
# ci/gpu.sh: the GPU nightly leg (self-hosted runner labelled `gpu`; see ci/workflows/nightly.yml).
#
#   ci/gpu.sh [--budget SECONDS] [--out DIR] [--layouts L] [--modes M] [--seed N]
#   (defaults: --budget 1800, --out out/gpu)
#
# 1. `pytest -m gpu` (JUnit XML in DIR/junit-gpu.xml);
# 2. a fuzz campaign on the GPU: `llmfuzz run --device cuda --profile nightly --json`
#    -> DIR/summary.json, DIR/reproducers/;
# 3. the report: DIR/report.html, DIR/job_summary.md.
# Needs a torch that sees a CUDA device: without one it prints one line and exits 2 (on
# this leg a missing GPU is a broken runner, not a pass).
# Exit code: 2 if anything got bad input or no GPU, else 1 if the tests or the campaign
# failed, else 0.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "ci/gpu.sh: $*" >&2; exit 2; }

budget=1800 out=out/gpu
run_extra=()
while (($#)); do
    case $1 in
        --budget|--out|--layouts|--modes|--seed)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
                --budget) budget=$2 ;;
                --out) out=$2 ;;
                *) run_extra+=("$1" "$2") ;;
            esac
            shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ $budget =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--budget: '$budget' is not a number of seconds"
command -v llmfuzz >/dev/null || die "llmfuzz is not installed (pip install -e '.[test]' first)"
# The interpreter llmfuzz runs under (its shebang), so the report and checks see the same
# packages; $PYTHON overrides.
if [[ -z ${PYTHON:-} ]]; then
    shebang=$(head -n1 "$(command -v llmfuzz)")
    PYTHON=${shebang#\#!}
    [[ -x $PYTHON ]] || PYTHON=python3
fi
why=$("$PYTHON" -c '
import torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
' 2>&1) || die "cannot import torch: ${why##*$'\n'}"
[[ -z $why ]] || die "no GPU: $why; the GPU leg needs one"

mkdir -p "$out" || die "cannot create --out $out"
export LLMFUZZ_PROFILE=nightly
export LLMFUZZ_DB=${LLMFUZZ_DB:-$out/example-db}
mkdir -p "$LLMFUZZ_DB"
rm -f "$out/summary.json" "$out/report.html" "$out/job_summary.md" "$out/junit-gpu.xml"
"$PYTHON" -c 'import torch; print("ci/gpu.sh:", torch.cuda.get_device_name(0), "torch", torch.__version__)' >&2

pytest -m gpu -q --junitxml "$out/junit-gpu.xml"
test_rc=$?
# 5: nothing collected. The suite has gpu tests, so that is a broken selection, not a pass.
((test_rc == 0)) || echo "ci/gpu.sh: pytest -m gpu exited $test_rc" >&2

echo "ci/gpu.sh: fuzzing on cuda for ${budget}s -> $out" >&2
llmfuzz run --device cuda --profile nightly --budget "$budget" --json --out "$out/reproducers" \
    "${run_extra[@]}" >"$out/summary.json"
run_rc=$?
if "$PYTHON" -c 'import json,sys; json.load(open(sys.argv[1]))' "$out/summary.json" 2>/dev/null; then
    "$PYTHON" -m fuzz.report "$out/summary.json" --html "$out/report.html" --markdown "$out/job_summary.md" \
        --title "llmfuzz GPU nightly" || run_rc=2
else
    rm -f "$out/summary.json"
    printf '## llmfuzz GPU nightly\n\n**llmfuzz run exited %s without a summary** (see the log).\n' "$run_rc" \
        >"$out/job_summary.md"
    ((run_rc == 0)) && run_rc=2
fi
if ((test_rc != 0)); then
    # shellcheck disable=SC2016  # the backticks are Markdown
    printf '\n`pytest -m gpu` exited %s (JUnit XML: %s).\n' "$test_rc" "$out/junit-gpu.xml" >>"$out/job_summary.md"
fi

if ((run_rc == 2 || run_rc == 130)); then exit "$run_rc"; fi
((test_rc == 0 && run_rc == 0)) || exit 1
exit 0
