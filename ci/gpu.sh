#!/usr/bin/env bash
# ci/gpu.sh: the GPU nightly leg (self-hosted runner labelled `gpu`; see .github/workflows/nightly.yml).
#
#   ci/gpu.sh [--budget SECONDS] [--out DIR] [--layouts L] [--modes M] [--seed N]
#             [--dtype D] [--attention-backend K[,K]] [--world inproc|torch]
#   (defaults: --budget 1800, --out out/gpu)
#
# 1. `pytest -m gpu` (JUnit XML in DIR/junit-gpu.xml);
# 2. a fuzz campaign on the GPU: `llmfuzz run --device cuda --profile nightly --json`
#    -> DIR/summary.json, DIR/reproducers/. By default it fuzzes what users run: bf16 on the
#    real kernels, torch_flash (PyTorch's FlashAttention-2) plus flash_attn when the flash-attn
#    package is importable (flash-attn-4's flash_attn.cute, or FlashAttention-2), each kernel
#    a cell of the campaign, named in the summary. The old leg, fp32 on the Python reference
#    attention: `--dtype float32 --attention-backend reference`. `--world torch` (NCCL) adds
#    CUDA graphs with tp > 1 on a machine of several GPUs;
# 3. the report: DIR/report.html, DIR/job_summary.md.
# Needs a torch that sees a CUDA device: without one it prints one line and exits 2 (on
# this leg a missing GPU is a broken runner, not a pass).
# Exit code: 2 if anything got bad input or no GPU, else 1 if the tests or the campaign
# failed, else 0.
set -uo pipefail

# shellcheck source=ci/lib.sh
source "$(dirname "$0")/lib.sh"

opt=([budget]=1800 [out]=out/gpu)
parse_args "budget out" "layouts modes seed dtype attention-backend world" "$@"
budget=${opt[budget]} out=${opt[out]}
is_num "$budget" || die "--budget: '$budget' is not a number of seconds"
llmfuzz_python
why=$("$PYTHON" -c '
import torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
' 2>&1) || die "cannot import torch: ${why##*$'\n'}"
[[ -z $why ]] || die "no GPU: $why; the GPU leg needs one"

mkdir -p "$out" || die "cannot create --out $out"
export LLMFUZZ_PROFILE=nightly
# flash-attn-4 JIT-compiles each kernel variant (seconds) in every process; its disk cache lets the
# campaign's worker processes (a fresh one after each fatal error) share what pytest compiled.
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
export LLMFUZZ_DB=${LLMFUZZ_DB:-$out/example-db}
mkdir -p "$LLMFUZZ_DB"
rm -f "$out/summary.json" "$out/report.html" "$out/job_summary.md" "$out/junit-gpu.xml"
"$PYTHON" -c 'import torch; print("ci/gpu.sh:", torch.cuda.get_device_name(0), "torch", torch.__version__)' >&2
"$PYTHON" -c '
from engine.attention.flash_attn_backend import INSTALL_HINT, probe
f = probe()
print("ci/gpu.sh:", f.line() if f else f"flash_attn not importable ({INSTALL_HINT}): its tests skip, torch_flash only")
' >&2

pytest -m gpu -q --junitxml "$out/junit-gpu.xml"
test_rc=$?
# 5: nothing collected. The suite has gpu tests, so that is a broken selection, not a pass.
((test_rc == 0)) || echo "ci/gpu.sh: pytest -m gpu exited $test_rc" >&2

echo "ci/gpu.sh: fuzzing on cuda for ${budget}s -> $out" >&2
forwarding llmfuzz run --device cuda --profile nightly --budget "$budget" --json --out "$out/reproducers" \
    "${run_extra[@]}" >"$out/summary.json"
run_rc=$rc
if is_json "$out/summary.json"; then
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
