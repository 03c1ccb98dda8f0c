"""The transformers oracle: Hugging Face's `LlamaForCausalLM` on the engine's weights.

The only oracle that shares no code with the engine: its own RMSNorm, RoPE, GQA attention,
SwiGLU and LM head. It runs in float32 on the test run's weights (rounded through the test
dtype first), one request at a time over its whole teacher-forced sequence.
"""
from __future__ import annotations

import importlib.util

import torch

from engine.config import EngineConfig
from engine.weights import hf_config_dict, load_state_dict
from fuzz.oracles.sequence import SequenceOracle


def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


class TransformersOracle(SequenceOracle):
    name = "transformers"

    def build(self, cfg: EngineConfig):
        import transformers

        hf = transformers.LlamaConfig(**{k: v for k, v in hf_config_dict(cfg).items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
        hf._attn_implementation = "eager"
        with torch.device("meta"):  # no random init: every weight is assigned below
            model = transformers.LlamaForCausalLM(hf)
        model.load_state_dict(load_state_dict(cfg), assign=True)
        # RoPE's inverse frequencies are a buffer the meta init left empty: build them again.
        model.model.rotary_emb = type(model.model.rotary_emb)(config=hf)
        return model.to(device=cfg.device, dtype=cfg.torch_dtype()).eval()

    def forward(self, model, cfg: EngineConfig, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids[None].to(cfg.device)).logits[0]
