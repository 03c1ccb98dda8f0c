"""Efficiency of a fuzz example: the model's arithmetic it needs over the time it takes.

- The floor: a raw PyTorch forward of the same model (plain fp32 ops, no engine: embedding,
  RMSNorm, fused projections, RoPE, SDPA over the step's own tokens, MLP, LM head) timed here
  for every token count the example's forwards had. Every forward counts: each microbatch of
  every engine run (test, reference, determinism) and each request the sequence oracles
  recompute. SDPA over the step's tokens alone is cheaper than attention over the context,
  so the floor is a lower bound and the efficiency a conservative one.
- Where the rest goes, per example: the engine's phases on the rank threads (host
  preparation, the forward, attention, FA recording, graph replay: CPU time of the rank's
  thread, so a rank blocked in a collective is not counted), hand-offs between rank threads
  and the driver (engine wall time minus the ranks' CPU time), and the harness (reference and
  test runs, oracles, checks), with Hypothesis and the campaign as what is left.

`Meter` is installed around one measured campaign pass (bench.cells) and removed after.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import Counter

import torch
import torch.nn.functional as F


class RawModel:
    """The fuzz model as plain tensors: what a forward costs with nothing around it."""

    def __init__(self, cfg) -> None:
        from engine.weights import layer_names, load_state_dict

        sd = {k: v.float() for k, v in load_state_dict(cfg.replace(dtype="float32")).items()}
        self.cfg = cfg
        self.embed, self.norm, self.lm_head = sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"]
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            n = layer_names(i)
            self.layers.append((
                sd[n["input_layernorm.weight"]],
                torch.cat([sd[n["self_attn.q_proj.weight"]], sd[n["self_attn.k_proj.weight"]],
                           sd[n["self_attn.v_proj.weight"]]]),
                sd[n["self_attn.o_proj.weight"]], sd[n["post_attention_layernorm.weight"]],
                torch.cat([sd[n["mlp.gate_proj.weight"]], sd[n["mlp.up_proj.weight"]]]),
                sd[n["mlp.down_proj.weight"]]))
        D = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))

    def _rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        T, H, Hkv, D = ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        freqs = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[None], emb.sin()[None]
        x = F.embedding(ids, self.embed)
        for ln1, wqkv, wo, ln2, wgu, wd in self.layers:
            q, k, v = F.linear(self._rms(x, ln1), wqkv).split([H * D, Hkv * D, Hkv * D], -1)
            q, k, v = (t.view(T, -1, D).transpose(0, 1) for t in (q, k, v))
            q = q * cos + torch.cat((-q[..., D // 2:], q[..., :D // 2]), -1) * sin
            k = k * cos + torch.cat((-k[..., D // 2:], k[..., :D // 2]), -1) * sin
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(o.transpose(0, 1).reshape(T, H * D), wo)
            gate, up = F.linear(self._rms(x, ln2), wgu).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, wd)
        return F.linear(self._rms(x, self.norm), self.lm_head)


def floor_seconds(cfg, token_counts: Counter, reps: int = 5, mode=torch.inference_mode) -> float:
    """Σ over forwards of a raw forward's time at that token count (median of `reps`), in
    inference mode as the engine's forward runs (`mode=torch.no_grad`: the floor the bench
    used before it did, 10-25 % slower at a step's 1-64 tokens)."""
    raw = RawModel(cfg)
    total = 0.0
    with mode():
        for n, times in token_counts.items():
            ids = torch.randint(0, cfg.vocab_size, (max(1, n),))
            raw.forward(ids)  # warm-up
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                raw.forward(ids)
                ts.append(time.perf_counter() - t0)
            total += statistics.median(ts) * times
    return total


class Meter:
    """Timing wrappers over the engine's and the harness's phases, installed for one pass."""

    RANK_PHASES = (("engine.model_runner", "GPUModelRunner", "prepare", "host_prepare"),
                   ("engine.model_runner", "GPUModelRunner", "execute", "execute"),
                   ("engine.model_runner", "GPUModelRunner", "_forward", "forward"),  # eager
                   ("engine.custom_ops", None, "varlen_attention", "attention"),
                   ("engine.custom_ops", None, "reshape_and_cache", "kv_write"),
                   ("engine.custom_ops", None, "_record", "fa_record"),
                   ("engine.graph_runner", "CUDAGraphRunner", "run", "graph_replay"))
    HARNESS_PHASES = (("fuzz.verdict.harness", "Harness", "_run", "engine_runs"),
                      ("fuzz.verdict.harness", "Harness", "oracle_traces", "sequence_oracles"),
                      ("fuzz.verdict.harness", None, "check_fa_records", "fa_check"),
                      ("fuzz.verdict.harness", None, "check_logits", "logits_check"))

    def __init__(self) -> None:
        self.cpu, self.wall, self.tokens = Counter(), Counter(), Counter()
        self._undo: list = []
        self._lock = threading.Lock()

    def _wrap(self, module: str, cls: str | None, name: str, label: str, clock) -> None:
        import importlib

        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        orig = getattr(owner, name)
        store = self.cpu if clock is time.thread_time else self.wall

        def wrapper(*a, **kw):
            t0 = clock()
            try:
                return orig(*a, **kw)
            finally:
                store[label] += clock() - t0
        setattr(owner, name, wrapper)
        self._undo.append((owner, name, orig))

    def install(self) -> "Meter":
        from engine.scheduler import Scheduler
        from fuzz.verdict.oracles.sequence import SequenceOracle

        for mod, cls, name, label in self.RANK_PHASES:
            self._wrap(mod, cls, name, label, time.thread_time)
        for mod, cls, name, label in self.HARNESS_PHASES:
            self._wrap(mod, cls, name, label, time.perf_counter)
        meter = self
        schedule, request_logits = Scheduler.schedule, SequenceOracle.request_logits

        def counted_schedule(sched, *a, **kw):
            so = schedule(sched, *a, **kw)
            if so is not None:  # one forward of this many tokens (each microbatch is one)
                meter.tokens[so.total_num_scheduled_tokens] += 1
            return so

        def counted_logits(oracle, cfg, prompt, forced):
            if oracle.result_key(cfg, prompt, forced) not in oracle.results:  # a hit runs no forward
                meter.tokens[len(prompt) + len(forced) - 1] += 1
            return request_logits(oracle, cfg, prompt, forced)
        Scheduler.schedule, SequenceOracle.request_logits = counted_schedule, counted_logits
        self._undo += [(Scheduler, "schedule", schedule), (SequenceOracle, "request_logits", request_logits)]
        return self

    def remove(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo.clear()

    def report(self, cfg, examples: int, seconds: float) -> dict:
        """Per-example figures and the efficiency (floor / whole example time)."""
        n = max(examples, 1)
        floor = floor_seconds(cfg, self.tokens)
        engine_wall = self.wall["engine_runs"]
        rank_cpu = self.cpu["host_prepare"] + self.cpu["execute"]
        per = {
            "floor_s": floor / n,
            "example_s": seconds / n,
            "forwards": sum(self.tokens.values()) / n,
            "engine": {"host_prepare_s": self.cpu["host_prepare"] / n,
                       "execute_s": self.cpu["execute"] / n,
                       "forward_s": self.cpu["forward"] / n,
                       "attention_s": self.cpu["attention"] / n,
                       "kv_write_s": self.cpu["kv_write"] / n,
                       "fa_record_s": self.cpu["fa_record"] / n,
                       "graph_replay_s": self.cpu["graph_replay"] / n,
                       "handoffs_and_driver_s": max(0.0, engine_wall - rank_cpu) / n},
            "harness": {"engine_runs_s": engine_wall / n,
                        "sequence_oracles_s": self.wall["sequence_oracles"] / n,
                        "fa_check_s": self.wall["fa_check"] / n,
                        "logits_check_s": self.wall["logits_check"] / n,
                        "hypothesis_and_campaign_s": max(0.0, seconds - engine_wall - self.wall["sequence_oracles"]
                                                         - self.wall["fa_check"] - self.wall["logits_check"]) / n},
        }
        out = {"efficiency": round(floor / seconds, 3) if seconds else None}
        if seconds:  # comparable with the figures measured before the forward ran in inference mode
            out["efficiency_no_grad_floor"] = round(floor_seconds(cfg, self.tokens, mode=torch.no_grad) / seconds, 3)
        out["per_example"] = _rounded(per)
        return out


def _rounded(d):
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 5) for k, v in d.items()}
