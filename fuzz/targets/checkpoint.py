"""The Hugging Face checkpoint of a Case's model: what a black-box engine loads, so that it, our
reference engine and transformers run the very same tensors (docs/targets.md)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

from engine.config import EngineConfig


def checkpoint_dir(cfg: EngineConfig) -> str:
    """The HF directory a black-box engine loads (vLLM's too): the Case's model_path, or our
    seeded weights written once per model shape + seed under $LLMFUZZ_CACHE (default
    ~/.cache/llmfuzz; the folder keeps its first name, vllm-models, so caches stay valid)."""
    if cfg.model_path:
        return cfg.model_path
    from engine.weights import hf_config_dict, save_hf_checkpoint

    ident = json.dumps({"hf": hf_config_dict(cfg), "seed": cfg.seed}, sort_keys=True)
    root = os.environ.get("LLMFUZZ_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmfuzz")
    path = os.path.join(root, "vllm-models", hashlib.sha256(ident.encode()).hexdigest()[:12])
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".tmp-")
        save_hf_checkpoint(cfg, tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path
