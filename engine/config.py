"""EngineConfig: one self-checking dataclass for model shape, cache, scheduler and layout.

Every impossible value is rejected in `__post_init__` with a `ConfigError` whose one-line
message names the field, so bad input never reaches a rank. Plain values only: this module
imports nothing of the engine.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

_DTYPES = ("float32", "float16", "bfloat16", "float64")
_BACKENDS = ("reference", "torch_flash", "flash_attn")  # as engine/attention/selector.py registers them
_MODES = ("NONE", "FULL")  # PIECEWISE (attention outside the graph) is not built
_WORLDS = ("inproc", "torch")
_LAYOUT_RE = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?$")


class ConfigError(ValueError):
    """A config value that cannot work; the message is one line naming the field."""


def parse_layout(layout: str) -> tuple[int, int]:
    """'tp2pp4' -> (2, 4); 'pp8' -> (1, 8); 'tp8' -> (8, 1); 'tp1pp1' -> (1, 1)."""
    m = _LAYOUT_RE.match(layout.strip().lower())
    if not layout.strip() or m is None or (m.group(1) is None and m.group(2) is None):
        raise ConfigError(f"layout: {layout!r} is not of the form tp{{T}}pp{{P}} (e.g. tp2pp4, pp8, tp8)")
    tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
    if tp < 1 or pp < 1:
        raise ConfigError(f"layout: {layout!r} has a zero degree")
    return tp, pp


def layout_name(tp: int, pp: int) -> str:
    return f"tp{tp}pp{pp}"


def parse_layouts(text: str, base: "EngineConfig") -> list[str]:
    """'tp2pp4,pp8' -> canonical layout names, each checked against `base` (a one-line
    ConfigError naming the bad one)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        tp, pp = parse_layout(item)
        base.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        out.append(layout_name(tp, pp))
    return out


@dataclass(slots=True)
class EngineConfig:
    """Model dims, KV cache, scheduler budget, layout and mode of one engine."""

    # Model shape (Llama; names follow transformers' LlamaConfig).
    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"
    # The dtype the weights were stored in, when it differs from the compute dtype: weights
    # are rounded through it first. A float32 oracle for a bf16 run computes on the bf16
    # run's very weights, so what it measures is compute error, not weight rounding.
    weights_dtype: str | None = None
    device: str = "cpu"
    model_path: str | None = None  # local safetensors / HF dir; None = seeded weights
    seed: int = 0
    # KV cache and scheduler.
    block_size: int = 4
    num_gpu_blocks: int = 64  # includes the null block 0
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64  # the chunked-prefill token budget per step
    max_model_len: int = 128
    enable_chunked_prefill: bool = True
    # Share the KV of full blocks between requests with an equal prefix (vLLM v1's automatic
    # prefix caching, engine/kv_cache.py). Off: scheduling is exactly what it was without it.
    enable_prefix_caching: bool = False
    # Schedule step N+1 before step N's sampled tokens are back (vLLM's async_scheduling;
    # engine/async_sched.py). Off: one step of a request in flight at a time, as before.
    async_scheduling: bool = False
    attention_backend: str = "reference"
    # Layout and execution.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    broadcast_pp_output: bool = False
    world: str = "inproc"
    cudagraph_mode: str = "NONE"
    capture_sizes: tuple[int, ...] = ()
    step_timeout_s: float = 60.0
    # Speculative decoding (greedy verification; "ngram" = prompt lookup in the driver,
    # "eagle" = a draft head on the last PP rank, engine/eagle.py).
    speculative_method: str = "none"
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        self.capture_sizes = tuple(sorted(set(int(s) for s in self.capture_sizes)))
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "intermediate_size", "block_size",
                    "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                    "tensor_parallel_size", "pipeline_parallel_size")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name}: must be a positive int, got {v!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta: must be > 0, got {self.rope_theta!r}")
        if not self.rms_norm_eps >= 0:
            raise ConfigError(f"rms_norm_eps: must be >= 0, got {self.rms_norm_eps!r}")
        for name in ("enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s: must be > 0, got {self.step_timeout_s!r}")
        _choice("dtype", self.dtype, _DTYPES)
        if self.weights_dtype is not None:
            _choice("weights_dtype", self.weights_dtype, _DTYPES)
        _choice("attention_backend", self.attention_backend, _BACKENDS)
        _choice("cudagraph_mode", self.cudagraph_mode, _MODES)
        _choice("world", self.world, _WORLDS)
        _choice("speculative_method", self.speculative_method, ("none", "ngram", "eagle"))
        if self.speculative_method != "none" and not 1 <= self.num_speculative_tokens <= 8:
            raise ConfigError(f"num_speculative_tokens: {self.num_speculative_tokens} is not within 1..8 "
                              f"for speculative_method={self.speculative_method}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device: {self.device!r} is neither 'cpu' nor 'cuda[:N]'")
        # Whether a backend's package is importable is the selector's question
        # (engine/attention/selector.py), asked before any rank starts.
        if self.attention_backend != "reference":
            if not self.device.startswith("cuda"):
                raise ConfigError(f"attention_backend: {self.attention_backend} runs on CUDA only (device={self.device})")
            if self.dtype not in ("float16", "bfloat16"):
                raise ConfigError(f"attention_backend: {self.attention_backend} needs float16 or bfloat16, not {self.dtype}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: {self.head_dim} must be even for RoPE")
        if self.num_gpu_blocks < 2:
            raise ConfigError("num_gpu_blocks: need at least 2 (block 0 is the null block)")
        if self.max_model_len > (self.num_gpu_blocks - 1) * self.block_size:
            raise ConfigError(f"max_model_len: {self.max_model_len} tokens do not fit in "
                              f"{self.num_gpu_blocks - 1} usable blocks of {self.block_size}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(f"max_num_batched_tokens: {self.max_num_batched_tokens} < max_model_len="
                              f"{self.max_model_len} needs enable_chunked_prefill")
        if any(s < 1 for s in self.capture_sizes):
            raise ConfigError(f"capture_sizes: sizes must be positive, got {self.capture_sizes}")
        if self.cudagraph_mode != "NONE" and not self.capture_sizes:
            raise ConfigError(f"capture_sizes: cudagraph_mode={self.cudagraph_mode} needs at least one size")
        if self.cudagraph_mode != "NONE" and self.device.startswith("cuda") and self.world == "inproc" \
                and self.tensor_parallel_size > 1:
            # Host-side collectives between rank threads do not replay inside a CUDA graph.
            raise ConfigError("cudagraph_mode: FULL graphs with tp > 1 on CUDA need world='torch' (NCCL)")
        self._check_layout()

    def _check_layout(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        name = layout_name(tp, pp)
        if self.num_attention_heads % tp:
            raise ConfigError(f"layout: {name} needs num_attention_heads={self.num_attention_heads} "
                              f"divisible by tp={tp}")
        kv = self.num_key_value_heads
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            raise ConfigError(f"layout: {name} needs tp={tp} and num_key_value_heads={kv} "
                              f"to divide one another (kv heads are split or replicated)")
        if self.vocab_size % tp:
            raise ConfigError(f"layout: {name} needs vocab_size={self.vocab_size} divisible by tp={tp}")
        if self.intermediate_size % tp:
            raise ConfigError(f"layout: {name} needs intermediate_size={self.intermediate_size} "
                              f"divisible by tp={tp}")
        if pp > self.num_hidden_layers:
            raise ConfigError(f"layout: {name} has more stages ({pp}) than layers ({self.num_hidden_layers})")
        if self.sequence_parallel and tp == 1:
            raise ConfigError("sequence_parallel: needs tp > 1")

    # Derived values -------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def layout(self) -> str:
        return layout_name(self.tp, self.pp)

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> "EngineConfig":
        if "layout" in changes:
            tp, pp = parse_layout(changes.pop("layout"))
            changes.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["capture_sizes"] = list(self.capture_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"config: unknown field {unknown[0]!r}")
        return cls(**d)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(allowed)}")

