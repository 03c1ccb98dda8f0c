"""Llama decoder for one rank: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Parallelism is a transform of single-device code: each module keeps its shard of the full
Hugging Face weights (column/row-parallel linears, vocab-parallel embedding and LM head,
KV heads replicated when tp > num_kv_heads) and inserts the collective the shard needs.
Pipeline stages keep the layers of `get_pp_indices` and hold `PPMissingLayer` elsewhere.
With sequence parallelism the residual stream between layers is scattered across TP ranks
(reduce_scatter after the row-parallel linears, all_gather before the column-parallel ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.custom_ops import tp_all_gather, tp_all_reduce, tp_reduce_scatter
from engine.faults import SPLIT_K_BY_BATCH_SIZE, FaultSet
from engine.parallel_state import RankGroups
from engine.weights import layer_names


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) layers of stage `pp_rank`; when layers % pp != 0 the last stages get one
    more layer each (the first stage also holds the embedding, the last the LM head)."""
    base, extra = divmod(num_layers, pp_size)
    sizes = [base + (1 if s >= pp_size - extra else 0) for s in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


class PPMissingLayer:
    """Placeholder for a layer that lives on another pipeline stage."""

    def __repr__(self) -> str:
        return "PPMissingLayer()"


@dataclass(slots=True)
class IntermediateTensors:
    """What one PP stage hands the next: hidden_states and residual."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def to_dict(self) -> dict:
        return {"hidden_states": self.hidden_states, "residual": self.residual}


ROW_TILE = 16


def accum_dtype(dtype: str) -> torch.dtype:
    return torch.float64 if dtype in ("float32", "float64") else torch.float32


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in w's (wider) dtype, rounded once to x's dtype at the end.

    The rows are padded to a multiple of ROW_TILE, so the GEMM never takes a small-row path
    (one row is a GEMV, a few rows another kernel), whose blocking would change low bits
    with the batch size: graph padding and batch mixes stay bitwise equal
    (tests/engine/test_batch_invariance.py). One mm over the padded rows is what
    torch.matmul makes of a [tiles, ROW_TILE, K] view (it folds the tiles into rows),
    without the view ops. Weights are kept in the accumulation dtype,
    so splitting output columns (TP) or K (row-parallel partials) changes nothing but that
    final rounding."""
    n, dtype = x.shape[0], x.dtype
    pad = -n % ROW_TILE
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return torch.mm(x.to(w.dtype), w.t())[:n].to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: normalise in fp32, scale after the cast.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D]. rotate_half convention (Hugging Face Llama)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


class LlamaLayer:
    """One decoder layer's shard on one TP rank."""

    def __init__(self, cfg: EngineConfig, idx: int, sd: dict, g: RankGroups) -> None:
        n, tp, r, D = layer_names(idx), cfg.tp, g.tp_rank, cfg.head_dim
        self.idx, self.cfg, self.g = idx, cfg, g
        self.num_heads = cfg.num_attention_heads // tp
        if tp <= cfg.num_key_value_heads:
            self.num_kv_heads = cfg.num_key_value_heads // tp
            kv0 = r * self.num_kv_heads
        else:  # replicate: rank r uses the kv head its query heads belong to
            self.num_kv_heads = 1
            kv0 = r * cfg.num_key_value_heads // tp
        q0 = r * self.num_heads
        # Fused column-parallel projections (vLLM's QKVParallelLinear and
        # MergedColumnParallelLinear): each rank concatenates its own q, k, v shards.
        wq = sd[n["self_attn.q_proj.weight"]][q0 * D:(q0 + self.num_heads) * D]
        wk = sd[n["self_attn.k_proj.weight"]][kv0 * D:(kv0 + self.num_kv_heads) * D]
        wv = sd[n["self_attn.v_proj.weight"]][kv0 * D:(kv0 + self.num_kv_heads) * D]
        self.wqkv = torch.cat([wq, wk, wv]).contiguous()
        self.wo = sd[n["self_attn.o_proj.weight"]][:, q0 * D:(q0 + self.num_heads) * D].contiguous()
        inter = cfg.intermediate_size // tp
        self.inter = inter
        self.wgate_up = torch.cat([sd[n["mlp.gate_proj.weight"]][r * inter:(r + 1) * inter],
                                   sd[n["mlp.up_proj.weight"]][r * inter:(r + 1) * inter]]).contiguous()
        self.wdown = sd[n["mlp.down_proj.weight"]][:, r * inter:(r + 1) * inter].contiguous()
        self.ln1 = sd[n["input_layernorm.weight"]]
        self.ln2 = sd[n["post_attention_layernorm.weight"]]
        # Projections are kept in the accumulation dtype (see `linear`); row-parallel
        # partials are also reduced across ranks in it, so a layout changes nothing but the
        # final rounding: tp8 and tp1 agree to an ulp instead of by the reassociation error
        # of a split K dimension compounded over layers.
        self.acc = accum_dtype(cfg.dtype)
        for name in ("wqkv", "wo", "wgate_up", "wdown"):
            setattr(self, name, getattr(self, name).to(self.acc))
        self.faults = FaultSet()  # the runner's, set with each Case's (GPUModelRunner.faults)

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The layer's GEMMs: one pass over K whatever the batch size (`linear`)."""
        if self.faults.on(SPLIT_K_BY_BATCH_SIZE) and x.shape[0] < ROW_TILE:
            # A split-K path for small batches, its two partials added in the activation dtype.
            k, act = x.shape[1] // 2, self.cfg.torch_dtype()
            return (linear(x[:, :k], w[:, :k]).to(act) + linear(x[:, k:], w[:, k:]).to(act)).to(x.dtype)
        return linear(x, w)

    def _gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_gather(self.g.tp, x, 0) if self.cfg.sequence_parallel else x

    def _row_parallel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        partial = self._linear(x.to(self.acc), w)  # stays wide until after the reduction
        if self.cfg.sequence_parallel:
            out = tp_reduce_scatter(self.g.tp, partial, 0)
        else:
            out = tp_all_reduce(self.g.tp, partial)
        return out.to(x.dtype)

    def forward(self, positions, hidden, residual, cos, sin, attn) -> tuple[torch.Tensor, torch.Tensor]:
        eps, D = self.cfg.rms_norm_eps, self.cfg.head_dim
        # Residual stream (scattered across TP ranks under sequence parallelism).
        residual = hidden if residual is None else hidden + residual
        x = self._gather_seq(rms_norm(residual, self.ln1, eps))
        T = x.shape[0]
        nq, nkv = self.num_heads * D, self.num_kv_heads * D
        qkv = self._linear(x, self.wqkv)
        # q and k heads rotate as one tensor: RoPE is elementwise per head, so the bits are
        # those of two calls, for half the small ops of a tiny model's layer.
        qk = apply_rope(qkv[:, :nq + nkv].view(T, self.num_heads + self.num_kv_heads, D), cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, nq + nkv:].reshape(T, self.num_kv_heads, D)
        o = attn(self.idx, q, k, v)
        hidden = self._row_parallel(o.reshape(T, self.num_heads * D), self.wo)
        residual = hidden + residual
        x = self._gather_seq(rms_norm(residual, self.ln2, eps))
        gate, up = self._linear(x, self.wgate_up).split([self.inter, self.inter], dim=-1)
        return self._row_parallel(F.silu(gate) * up, self.wdown), residual


class LlamaForCausalLM:
    """The rank's slice of the model: embedding on stage 0, layers of `get_pp_indices`,
    final norm and LM head on the last stage."""

    def __init__(self, cfg: EngineConfig, sd: dict, g: RankGroups) -> None:
        self.cfg, self.g = cfg, g
        self.start, self.end = get_pp_indices(cfg.num_hidden_layers, g.pp_rank, cfg.pp)
        self.run_end = self.end  # the runner lowers it for the pp_uneven_partition fault
        self.is_first = g.pp_rank == 0
        self.is_last = g.pp_rank == cfg.pp - 1
        vshard = cfg.vocab_size // cfg.tp
        vocab_start = g.tp_rank * vshard
        # The rank's coordinates as tensors: read inside the forward as data, they leave a
        # captured graph the same for every TP rank (engine/cpu_graph.py shares one trace).
        self.vocab_start = torch.tensor(vocab_start)
        self.tp_rank = torch.tensor([g.tp_rank])
        self.embed = sd["model.embed_tokens.weight"][vocab_start:vocab_start + vshard].contiguous() \
            if self.is_first else PPMissingLayer()
        self.layers = [LlamaLayer(cfg, i, sd, g) if self.start <= i < self.end else PPMissingLayer()
                       for i in range(cfg.num_hidden_layers)]
        self.norm = sd["model.norm.weight"] if self.is_last else PPMissingLayer()
        self.lm_head = sd["lm_head.weight"][vocab_start:vocab_start + vshard].to(
            accum_dtype(cfg.dtype)) if self.is_last else PPMissingLayer()
        D = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))

    def to(self, device: str) -> "LlamaForCausalLM":
        for obj in [self] + [layer for layer in self.layers if isinstance(layer, LlamaLayer)]:
            for k, v in vars(obj).items():
                if isinstance(v, torch.Tensor):
                    setattr(obj, k, v.to(device))
        return self

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.cfg.torch_dtype()
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        vshard = self.embed.shape[0]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < vshard)
        out = F.embedding(local.clamp(0, vshard - 1), self.embed) * mine[:, None].to(self.embed.dtype)
        return tp_all_reduce(self.g.tp, out)

    def scatter_seq(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a sequence-parallel residual (token count padded to tp)."""
        tp = self.cfg.tp
        rows = x.view(tp, x.shape[0] // tp, *x.shape[1:])  # the count is padded to a multiple of tp
        return rows.index_select(0, self.tp_rank)[0]  # a tensor index: no host read

    def forward(self, input_ids, positions, intermediate: IntermediateTensors | None, attn,
                return_hidden_states: bool = False):
        """Last stage: normed hidden states, or with `return_hidden_states` the pair (normed,
        pre-norm) -- the pre-norm ones feed an EAGLE draft head (engine/eagle.py)."""
        hidden, residual, cos, sin = self.forward_in(input_ids, positions, intermediate)
        for layer in self.live_layers():
            hidden, residual = layer.forward(positions, hidden, residual, cos, sin, attn)
        return self.forward_out(hidden, residual, return_hidden_states)

    def live_layers(self) -> list[LlamaLayer]:
        return self.layers[self.start:self.run_end]

    def forward_in(self, input_ids, positions, intermediate: IntermediateTensors | None):
        """What comes before the stage's layers: (hidden, residual, cos, sin); residual is
        None on the first stage. (The three parts of `forward` are also captured one by one:
        engine/graph_runner.py.)"""
        cos, sin = self.rope(positions)
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.cfg.sequence_parallel:
                hidden = self.scatter_seq(hidden)
        else:
            hidden, residual = intermediate.hidden_states, intermediate.residual
            if self.cfg.sequence_parallel:  # hidden crosses stages whole, residual scattered
                hidden = self.scatter_seq(hidden)
        return hidden, residual, cos, sin

    def forward_out(self, hidden, residual, return_hidden_states: bool = False):
        """What comes after the stage's layers: IntermediateTensors, or on the last stage the
        normed hidden states (and the pre-norm ones, see `forward`)."""
        if not self.is_last:
            if self.cfg.sequence_parallel:
                hidden = tp_all_gather(self.g.tp, hidden, 0)
            return IntermediateTensors(hidden, residual)
        pre = hidden + residual
        out = rms_norm(pre, self.norm, self.cfg.rms_norm_eps)
        if self.cfg.sequence_parallel:
            out = tp_all_gather(self.g.tp, out, 0)
        if not return_hidden_states:
            return out
        return out, tp_all_gather(self.g.tp, pre, 0) if self.cfg.sequence_parallel else pre

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return tp_all_gather(self.g.tp, linear(hidden, self.lm_head), -1)
