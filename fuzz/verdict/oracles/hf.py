"""The transformers oracle: Hugging Face's `LlamaForCausalLM`, the only oracle that shares no
code with the engine (its own RMSNorm, RoPE, GQA attention, SwiGLU and LM head). One class
serves two uses:

- the harness's sequence oracle (`fuzz.verdict.oracles.sequence`): built from the engine's
  weights for a config (`build`), run in the test run's dtype on its device (the weights
  rounded through that dtype first), one request at a time over its whole teacher-forced
  sequence;
- a black-box target's third oracle (`logprobs`, used by `fuzz.verdict.compare.
  check_teacher_forced`): loaded from a Hugging Face checkpoint directory, the one the target
  loads too, in float32; the fp64 log-softmax at every position of one causal forward over
  contiguous tokens (no paging, no chunking).

Either way the model runs with eager attention, in eval mode, cached in the one LRU of models
(`SequenceOracle.models`): by the config's model fields, or by the directory.
"""
from __future__ import annotations

import importlib.util

import torch

from engine.config import EngineConfig
from engine.weights import hf_config_dict, load_state_dict
from fuzz.verdict.oracles.sequence import SequenceOracle


def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _eval(model, device, dtype):
    """An HF model ready to be an oracle: on `device` in `dtype`, in eval mode."""
    return model.to(device=device, dtype=dtype).eval()


class TransformersOracle(SequenceOracle):
    name = "transformers"
    available = staticmethod(available)

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
        return _eval(model, cfg.device, cfg.torch_dtype())

    def forward(self, model, cfg: EngineConfig, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids[None].to(cfg.device)).logits[0]

    def pretrained(self, path: str):
        """The model in the Hugging Face directory `path` (float32 on the CPU), cached."""
        key = ("checkpoint", path)
        if key not in self.models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
            self.models[key] = _eval(model, "cpu", torch.float32)
            while len(self.models) > self.MODELS:
                self.models.popitem(last=False)
        self.models.move_to_end(key)
        return self.models[key]

    def logprobs(self, path: str, tokens: tuple[int, ...] | list[int]) -> torch.Tensor:
        """[len(tokens), vocab] fp64 log-softmax of the logits of the model in `path`, fed `tokens`."""
        with torch.inference_mode():
            logits = self.pretrained(path)(torch.tensor([list(tokens)], dtype=torch.long)).logits[0]
        return torch.log_softmax(logits.double(), -1)
