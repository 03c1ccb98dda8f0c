"""The solo oracle: each request alone, whole, on the engine's layer math with plain attention.

It reuses the engine's Llama layers (so a bug in the model math itself is the transformers
oracle's to find) but none of what serves them: no scheduler, chunking, preemption, batch,
reorder, attention metadata, paged KV cache, speculation, graphs, or parallelism. Attention
is dense causal over the request's own tokens, accumulated one precision wider than the
inputs as the reference kernel does. In the test dtype it is also the precision baseline of
the logits check (`fuzz.verdict.tolerance`): what plain low-precision arithmetic alone costs.
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model import LlamaForCausalLM
from engine.parallel_state import RankGroups, SoloGroup
from engine.weights import load_state_dict
from fuzz.verdict.oracles.sequence import SequenceOracle


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of one sequence -> [T, Hq, D] in q's dtype."""
    T, Hq, _ = q.shape
    acc = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    rep = Hq // k.shape[1]
    k = k.to(acc).repeat_interleave(rep, dim=1)
    v = v.to(acc).repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), k) * scale
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)


class SoloOracle(SequenceOracle):
    name = "solo"

    def build(self, cfg: EngineConfig) -> LlamaForCausalLM:
        one = cfg.replace(tensor_parallel_size=1, pipeline_parallel_size=1, sequence_parallel=False,
                          broadcast_pp_output=False, cudagraph_mode="NONE", capture_sizes=(),
                          speculative_method="none", num_speculative_tokens=0, attention_backend="reference")
        groups = RankGroups(0, 0, 0, SoloGroup(0, "tp"), SoloGroup(0, "pp"), SoloGroup(0, "world"))
        return LlamaForCausalLM(one, load_state_dict(one), groups).to(cfg.device)

    def forward(self, model: LlamaForCausalLM, cfg: EngineConfig, ids: torch.Tensor) -> torch.Tensor:
        scale = cfg.head_dim ** -0.5
        ids = ids.to(cfg.device)
        pos = torch.arange(ids.shape[0], device=cfg.device)
        hidden = model.forward(ids, pos, None, lambda layer, q, k, v: dense_causal_attention(q, k, v, scale))
        return model.compute_logits(hidden)
