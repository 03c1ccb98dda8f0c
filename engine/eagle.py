"""EagleProposer: an EAGLE-style draft head on the last PP rank (speculative decoding:
docs/bug_classes.md#spec_rollback_missing).

The draft is one Llama decoder layer fed with `fc(concat(embed(token), target_hidden))`: at
position q it sees the target's pre-final-norm hidden state h_q and the token at q + 1, and
predicts the token at q + 2 through the target's final norm and LM head. It runs where h_q
exists, on the last PP stage (every TP rank of that stage runs the same unsharded head, so
no collective is needed and the ranks agree bitwise); the drafts go back to the driver in
ModelRunnerOutput and reach every rank in the next SchedulerOutput, like n-gram drafts.

Per target step the proposer runs:
  1. one pass over every scheduled token with the target's own attention metadata, so the
     draft KV cache holds an entry for every position the target computed (prefill chunks
     included: later draft steps attend over them);
  2. k - 1 steps of one token per request, each with its OWN metadata: positions advance by
     one, seq_lens grow by one, slot_mapping points at the position's slot through the
     request's block table. The scheduler allocates k lookahead slots per eagle request so
     these slots exist (vLLM's num_lookahead_tokens).
Draft KV at rejected or drafted positions is overwritten by the next step's pass 1 before any
query reads it (a query at position p reads keys <= p, and pass 1 rewrites every position
from num_computed_tokens on). The draft runs eager in graph mode too: it is not captured.

Weights come from the model seed (a separate stream), so drafts are deterministic. Fully
random weights would accept nothing, so the head reuses what the target knows: embedding,
final norm and LM head are tied to the target's (full copies; every rank holds the full state
dict), `fc` is near [I_token | 0.5 I_hidden] and the decoder layer adds a residual update of
seeded weights. On the seeded (random) target no cheap head predicts well: measured variants
(token only, hidden only, both, layer gain 0..1) all accept 2-5 % of drafts; this one is among
the best (bench/spec_acceptance.py). A checkpoint's target (model_path) still gets a seeded head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionContext, AttentionMetadataBuilder, CommonAttentionMetadata
from engine.attention.selector import AttentionBackend
from engine.config import EngineConfig
from engine.custom_ops import AttentionSink, register_sink
from engine.model import LlamaLayer, accum_dtype, linear, rms_norm
from engine.outputs import EagleInputs
from engine.parallel_state import RankGroups, SoloGroup
from engine.poison import KV_POISON, fill_floats
from engine.spec_decode import verify_greedy
from engine.weights import layer_names

DRAFT_SEED_OFFSET = 0xEA61E  # the draft's weight stream, apart from the target's
FC_TOKEN_GAIN, FC_HIDDEN_GAIN, FC_NOISE = 1.0, 0.5, 0.05
LAYER_GAIN = 0.5  # attention and MLP of the draft layer: a residual update that matters


def make_draft_state_dict(cfg: EngineConfig) -> dict[str, torch.Tensor]:
    """Seeded draft weights: `fc.weight` [H, 2H] and one decoder layer under the name of
    layer `num_hidden_layers` (one past the target's, so FA records and KV keys stay apart)."""
    g = torch.Generator().manual_seed(cfg.seed + DRAFT_SEED_OFFSET)
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D

    def lin(out_f: int, in_f: int, gain: float) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f ** 0.5)

    eye = torch.eye(H)
    sd = {"fc.weight": torch.cat([FC_TOKEN_GAIN * eye, FC_HIDDEN_GAIN * eye], 1) + lin(H, 2 * H, FC_NOISE)}
    shapes = {"self_attn.q_proj.weight": (nq, H), "self_attn.k_proj.weight": (nkv, H),
              "self_attn.v_proj.weight": (nkv, H), "self_attn.o_proj.weight": (H, nq),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    for short, full in layer_names(cfg.num_hidden_layers).items():
        sd[full] = torch.ones(H) if short.endswith("layernorm.weight") else lin(*shapes[short], LAYER_GAIN)
    return {k: v.to(cfg.torch_dtype()) for k, v in sd.items()}


class EagleProposer:
    """Draft head of one last-stage rank: its own layer, KV cache and attention metadata."""

    def __init__(self, cfg: EngineConfig, target_sd: dict, rank: int, records: list | None,
                 attn_backend: type[AttentionBackend]) -> None:
        self.cfg, self.k = cfg, cfg.num_speculative_tokens
        self.layer_idx = cfg.num_hidden_layers
        # The head is unsharded: a tp1pp1 view of the config and groups of one rank.
        dcfg = cfg.replace(tensor_parallel_size=1, pipeline_parallel_size=1, sequence_parallel=False,
                           broadcast_pp_output=False, cudagraph_mode="NONE", capture_sizes=())
        solo = SoloGroup(rank, "draft")
        sd = make_draft_state_dict(cfg)
        self.layer = LlamaLayer(dcfg, self.layer_idx, sd, RankGroups(rank, 0, 0, solo, solo, solo))
        dev, acc = cfg.device, accum_dtype(cfg.dtype)
        for name, v in vars(self.layer).items():
            if isinstance(v, torch.Tensor):
                setattr(self.layer, name, v.to(dev))
        self.fc = sd["fc.weight"].to(dev, acc)
        # Tied to the target (full, unsharded copies: every rank holds the full state dict).
        self.embed = target_sd["model.embed_tokens.weight"].to(dev)
        self.norm = target_sd["model.norm.weight"].to(dev)
        self.lm_head = target_sd["lm_head.weight"].to(dev, acc)
        D = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).to(dev)
        shape = (cfg.num_gpu_blocks, cfg.block_size, cfg.num_key_value_heads, D)
        self.kv_caches = {self.layer_idx: (torch.zeros(shape, dtype=cfg.torch_dtype(), device=dev),
                                           torch.zeros(shape, dtype=cfg.torch_dtype(), device=dev))}
        # Its own sink (same record list as the runner's): its calls are checked like the target's.
        self.sink = AttentionSink(rank, attn_backend, records, key_len_pad=cfg.max_model_len)
        register_sink(self.sink)
        self.builder = AttentionMetadataBuilder()
        self.scale = D ** -0.5
        self.last_metadata: list[CommonAttentionMetadata] = []  # of the last propose(), for tests

    def reset(self, poison: str) -> None:
        for i, t in enumerate(self.kv_caches[self.layer_idx]):
            fill_floats(t, poison, f"draft_kv{i}", nan_value=KV_POISON)

    def draft_from(self, e: EagleInputs, argmax: list[int]) -> tuple[list[int], list[int]]:
        """Per sampling request: the token index to draft from -- the last position this
        rank's own greedy verification keeps (the driver's may differ under teacher forcing;
        it then drops these drafts) -- and how many drafts fit below max_model_len."""
        rows, num, i = [], [], 0
        for r, drafts, p0 in zip(e.sample_rows, e.drafts, e.first_positions):
            a = len(verify_greedy(drafts, argmax[i:i + r])) - 1
            rows.append(e.logits_indices[i + a])
            num.append(max(0, min(self.k, self.cfg.max_model_len - (p0 + a + 2))))  # p0 + a + 2 tokens known
            i += r
        return rows, num

    def step_metadata(self, positions: torch.Tensor, block_table: torch.Tensor) -> CommonAttentionMetadata:
        """One query token per request at `positions`; it attends to keys 0..position and
        writes its KV to the slot of `position` in the request's block-table row."""
        R, bs, dev = positions.shape[0], self.cfg.block_size, positions.device
        seq_lens = (positions + 1).to(torch.int32)
        blocks = block_table[torch.arange(R, device=dev), positions // bs].to(torch.int64)
        return self.builder.build(
            query_start_loc=torch.arange(R + 1, dtype=torch.int32, device=dev), seq_lens=seq_lens,
            block_table=block_table, slot_mapping=blocks * bs + positions % bs, num_reqs=R,
            num_actual_tokens=R, max_query_len=1, max_seq_len=int(seq_lens.max()))

    def _forward(self, input_ids, positions, hidden, md: CommonAttentionMetadata) -> torch.Tensor:
        """Draft features (pre-norm, like the target hidden states it is fed) for each token."""
        self.sink.num_reqs, self.sink.num_actual_tokens = md.num_reqs, md.num_actual_tokens
        self.sink.reset_snapshot()  # every forward has its own metadata
        self.last_metadata.append(md)
        x = linear(torch.cat([F.embedding(input_ids, self.embed), hidden], -1), self.fc)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        attn = AttentionContext(md, self.kv_caches, self.scale, self.sink)
        out, residual = self.layer.forward(positions, x, None, cos, sin, attn)
        return out + residual

    def _sample(self, feat: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(feat, self.norm, self.cfg.rms_norm_eps), self.lm_head).argmax(-1)

    def propose(self, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                target_hidden_states: torch.Tensor, common_md: CommonAttentionMetadata,
                last_token_indices: torch.Tensor, block_table: torch.Tensor, num_drafts: list[int],
                microbatch: int = 0) -> list[list[int]]:
        """Drafts per sampling request.

        target_token_ids[t] is the token AFTER token t (shifted by one; the sampled token
        at sampled rows); last_token_indices[i] is request i's last verified row;
        block_table[i] its block-table row; num_drafts[i] how many drafts it may take."""
        self.sink.microbatch = microbatch
        self.last_metadata = []
        feat = self._forward(target_token_ids, target_positions, target_hidden_states, common_md)
        R, k = len(num_drafts), max(num_drafts, default=0)
        if R == 0 or k == 0:
            return [[] for _ in range(R)]
        feat, pos = feat[last_token_indices], target_positions[last_token_indices]
        tok = self._sample(feat)
        out = torch.zeros(R, k, dtype=torch.int64, device=tok.device)
        out[:, 0] = tok
        idx, want = torch.arange(R, device=tok.device), torch.tensor(num_drafts, device=tok.device)
        for j in range(1, k):
            keep = want[idx] > j  # requests near max_model_len stop early
            idx, tok, feat, pos = idx[keep], tok[keep], feat[keep], pos[keep] + 1
            if idx.numel() == 0:
                break
            # The draft token d_j sits at pos + 1; its KV goes to pos (EAGLE's shift by one).
            feat = self._forward(tok, pos, feat, self.step_metadata(pos, block_table[idx]))
            tok = self._sample(feat)
            out[idx, j] = tok
        rows = out.tolist()
        return [rows[i][:n] for i, n in enumerate(num_drafts)]
