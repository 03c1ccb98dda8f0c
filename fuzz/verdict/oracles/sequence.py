"""Oracles that recompute each request alone, as one causal forward over its whole sequence.

The engine produces a request's logits step by step: prefill chunks, decodes through the
paged KV cache, batched with other requests, possibly preempted, speculated and reordered.
A sequence oracle takes all of that off the path: it feeds the prompt and the tokens the
runs were teacher-forced with (prompt + forced[:-1]) in one causal forward and reads the
logits row of every generated position. Results are cached per (model, prompt, tokens):
shrinking and Hypothesis's mutations re-run the same requests many times.
"""
from __future__ import annotations

import abc
import time
from collections import OrderedDict

import torch

from engine.config import EngineConfig
from engine.llm_engine import TokenRecord, Trace

# The config fields that decide a model's weights and arithmetic (not its layout).
MODEL_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rms_norm_eps",
                "dtype", "weights_dtype", "device", "model_path", "seed")


def model_key(cfg: EngineConfig) -> tuple:
    return tuple(getattr(cfg, f) for f in MODEL_FIELDS)


class SequenceOracle(abc.ABC):
    """Base: a subclass builds a model for a config and maps token ids to logits rows."""

    name = "sequence"
    MODELS, RESULTS = 4, 512  # a campaign uses one or two models; results are ~a few KB

    def __init__(self) -> None:
        self.models: OrderedDict[tuple, object] = OrderedDict()
        self.results: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.seconds = 0.0  # time spent computing (cache hits cost nothing)

    @abc.abstractmethod
    def build(self, cfg: EngineConfig):
        """The model for `cfg` (built once per model key, cached)."""

    @abc.abstractmethod
    def forward(self, model, cfg: EngineConfig, ids: torch.Tensor) -> torch.Tensor:
        """[L] token ids -> [L, vocab] float32 logits of a causal forward."""

    def _model(self, cfg: EngineConfig):
        key = model_key(cfg)
        if key not in self.models:
            self.models[key] = self.build(cfg)
            while len(self.models) > self.MODELS:
                self.models.popitem(last=False)
        self.models.move_to_end(key)
        return self.models[key]

    @staticmethod
    def result_key(cfg: EngineConfig, prompt: tuple[int, ...], forced: tuple[int, ...]) -> tuple:
        """What a request's rows are cached under (a hit runs no forward)."""
        return model_key(cfg), prompt, forced

    def request_logits(self, cfg: EngineConfig, prompt: tuple[int, ...], forced: tuple[int, ...]) -> torch.Tensor:
        """[len(forced), vocab]: row i is the distribution after prompt + forced[:i]."""
        key = self.result_key(cfg, prompt, forced)
        hit = self.results.get(key)
        if hit is not None:
            self.results.move_to_end(key)
            return hit
        t0 = time.perf_counter()
        ids = torch.tensor(list(prompt) + list(forced[:-1]), dtype=torch.int64)
        with torch.inference_mode():  # as the engine's forward (engine/model_runner.py)
            logits = self.forward(self._model(cfg), cfg, ids)
        # clone: a view would keep the prompt positions' rows alive in the cache too (and,
        # made outside inference mode, the cached rows are plain tensors)
        rows = logits[len(prompt) - 1:].float().cpu().clone()
        self.seconds += time.perf_counter() - t0
        self.results[key] = rows
        if len(self.results) > self.RESULTS:
            self.results.popitem(last=False)
        return rows

    def prompt_logits(self, cfg: EngineConfig, prompt: tuple[int, ...]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row i is the distribution after prompt[:i + 1], the one
        that predicts prompt token i + 1 (what prompt logprobs report)."""
        key = ("prompt",) + self.result_key(cfg, prompt, ())
        hit = self.results.get(key)
        if hit is not None:
            self.results.move_to_end(key)
            return hit
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.forward(self._model(cfg), cfg, torch.tensor(list(prompt), dtype=torch.int64))
        rows = logits[:-1].float().cpu().clone()
        self.seconds += time.perf_counter() - t0
        self.results[key] = rows
        if len(self.results) > self.RESULTS:
            self.results.popitem(last=False)
        return rows

    def trace(self, cfg: EngineConfig, workload, forced: dict[str, list[int]]) -> Trace:
        """A Trace shaped like an engine run's (tokens only) for the same teacher forcing: one
        entry per request the engine ran (a request with sampling n > 1 is its children;
        `Workload.engine_requests`), over the tokens it was forced with (an aborted request's
        prefix; none when it was aborted before it sampled). The rows are raw logits: what a
        request's sampling params do with them is the sampling oracle's to check."""
        out = Trace()
        for rid, _, r, _ in workload.engine_requests():
            toks = tuple(forced.get(rid, ()))
            if not toks:
                out.tokens[rid] = []
                continue
            rows = self.request_logits(cfg, tuple(r.prompt_token_ids), toks)
            argmax = rows.argmax(-1).tolist()
            out.tokens[rid] = [TokenRecord(0, 0, rows[j], argmax[j], toks[j]) for j in range(len(toks))]
        return out
