"""vLLM configs: the model (`VLLM_MODEL`), the switches no EngineConfig field holds
(`VLLMOptions`, a Case's `target_options`), config names, a Hypothesis strategy, and the
handful a campaign can afford.

`vllm_configs()` draws (EngineConfig, VLLMOptions) over the knobs vLLM users turn: layout
(tp, pp), eager vs compiled, the chunked-prefill budget (`max_num_batched_tokens`),
`max_num_seqs`, block size, n-gram speculative decoding (k), prefix caching and async
scheduling. Every knob shrinks open: the first layout and mode given (tp1pp1, eager), budget
128, 8 sequences, block 32, no speculation, no prefix caching, no async scheduling. Each knob
is left at its default with probability 1/2, so a draw turns on a few things at once.

An engine start costs 4-90 s on the 2-core machine, so a campaign cannot draw a config per
example. `plan_configs(n, seed, ...)` takes the first n configs of the covering plan
(fuzz.targets.vllm.covering: every pair of dimension values within the first few configs,
cheapest first, then triples), `row_config` turning a plan row into (EngineConfig,
VLLMOptions). The campaign then keeps one engine per config and draws workloads within it.

Combinations vLLM rejects at start-up by design are not drawn: async scheduling with n-gram
speculation (vLLM 0.32: "async scheduling is only supported with EAGLE/MTP/Draft Model/NGram
GPU ... speculative decoding"). On CPU vLLM's platform turns async scheduling off whatever
is asked (platforms/cpu.py: "async scheduling is not required on CPU"), so there the knob
only changes the arguments; it matters on CUDA.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from hypothesis import strategies as st

from engine.config import EngineConfig
from fuzz.targets.options import DTYPE_SHORT, TargetOptions, differing

# A tiny Llama that vLLM's CPU backend accepts: head_dim 64 (its CPU attention rejects 16),
# block size a multiple of 32. 2 query heads over 1 kv head (GQA; tp2 replicates the kv
# head), 2 layers (pp2 = one layer per stage). Prompts up to max_model_len // 2 = 64 tokens
# cover block edges 31/32/33 and 63/64.
VLLM_MODEL = EngineConfig(
    vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=64, intermediate_size=256, block_size=32, num_gpu_blocks=64, max_num_seqs=8,
    max_num_batched_tokens=128, max_model_len=128)


@dataclass(frozen=True, slots=True)
class VLLMOptions(TargetOptions):
    """vLLM switches that have no EngineConfig field (stored in reproducers' meta).
    `kv_blocks`: 0 lets vLLM size the KV cache (1 GiB: thousands of blocks); N > 0 caps it
    at N blocks (`num_gpu_blocks_override`), so a batch no longer fits and vLLM preempts.
    `engine_core_process`: vLLM's engine core in a process of its own, as vLLM serves
    (VLLM_ENABLE_V1_MULTIPROCESSING=1): requests, aborts and outputs cross its ZMQ queues and
    the core steps on its own, so an abort lands while a step runs; off, the core runs inside
    the client's `LLMEngine.step()` (one process fewer to start)."""

    target = "vllm"
    label = "vllm_options"
    enable_prefix_caching: bool = False
    async_scheduling: bool = False
    kv_blocks: int = 0
    engine_core_process: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        # Later fields at their defaults are not written: a reproducer without them keeps one form.
        for k in ("kv_blocks", "engine_core_process"):
            if not d[k]:
                del d[k]
        return d

    def drawn_config(self, cfg: EngineConfig) -> EngineConfig:
        return cfg.replace(enable_prefix_caching=self.enable_prefix_caching)

    def describe(self) -> str:
        on = [k for k, v in self.to_dict().items() if v is True]
        return ",".join(on)


COMPILED = dict(cudagraph_mode="FULL", capture_sizes=(1, 2, 4, 8))  # "compiled": torch.compile on CPU


def cell_name(cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> str:
    """'tp1pp2-eager', 'tp1pp1-compiled-b16-s2-blk64-ngram2-bf16-len256-kv5+enable_prefix_caching'
    (the parts that differ from VLLM_MODEL; `parse_cell_name` inverts it)."""
    name = f"{cfg.layout}-{'eager' if cfg.cudagraph_mode == 'NONE' else 'compiled'}"
    name += differing(cfg, VLLM_MODEL, {"max_num_batched_tokens": "b{}", "max_num_seqs": "s{}", "block_size": "blk{}"})
    if cfg.speculative_method != "none":
        name += f"-{cfg.speculative_method}{cfg.num_speculative_tokens}"
    name += differing(cfg, VLLM_MODEL, {"dtype": "{}", "max_model_len": "len{}"})
    if opts.kv_blocks:
        name += f"-kv{opts.kv_blocks}"
    if opts.describe():
        name += "+" + opts.describe().replace(",", "+")
    return name


_CELL = re.compile(r"^(?P<layout>tp\d+pp\d+)-(?P<mode>eager|compiled)(?:-b(?P<b>\d+))?(?:-s(?P<s>\d+))?"
                   r"(?:-blk(?P<blk>\d+))?(?:-ngram(?P<k>\d+))?(?:-(?P<dt>bf16|fp16|fp32))?(?:-len(?P<len>\d+))?"
                   r"(?:-kv(?P<kv>\d+))?(?P<opts>(?:\+\w+)*)$")


def parse_cell_name(name: str, base: EngineConfig = VLLM_MODEL) -> tuple[EngineConfig, VLLMOptions]:
    """'tp2pp1-compiled-b32-ngram2+enable_prefix_caching' -> (EngineConfig, VLLMOptions);
    ValueError naming the problem otherwise."""
    from engine.config import ConfigError

    m = _CELL.match(name.strip())
    if not m:
        raise ValueError(f"{name!r} is not a vLLM config name like tp1pp2-eager or "
                         f"tp1pp1-compiled-b16-s2-blk64-ngram2-bf16-len256-kv5+enable_prefix_caching")
    ch: dict = {"layout": m["layout"]}
    if m["mode"] == "compiled":
        ch.update(COMPILED)
    for key, field_ in (("b", "max_num_batched_tokens"), ("s", "max_num_seqs"), ("blk", "block_size"),
                        ("len", "max_model_len")):
        if m[key]:
            ch[field_] = int(m[key])
    if m["k"]:
        ch.update(speculative_method="ngram", num_speculative_tokens=int(m["k"]))
    if m["dt"]:
        ch["dtype"] = {v: k for k, v in DTYPE_SHORT.items()}[m["dt"]]
    flags = [f for f in m["opts"].split("+") if f]
    try:
        opts = VLLMOptions(**{f: True for f in flags}, kv_blocks=int(m["kv"] or 0))
    except TypeError:
        raise ValueError(f"{name!r}: unknown option in {'+'.join(flags)!r} (known: enable_prefix_caching, "
                         f"async_scheduling, engine_core_process)") from None
    try:
        return _fit(base.replace(**ch)), opts
    except ConfigError as e:
        raise ValueError(f"{name!r}: {e}") from None


def _fit(cfg: EngineConfig) -> EngineConfig:
    """Our reference engine's KV pool grown to hold max_model_len (its own check), so a
    longer max_model_len is a valid EngineConfig; vLLM's KV size is VLLMOptions.kv_blocks."""
    need = -(-cfg.max_model_len // cfg.block_size) + 1
    return cfg if cfg.num_gpu_blocks >= need else cfg.replace(num_gpu_blocks=need)


VLLM_LAYOUTS = ("tp1pp1", "tp2pp1", "tp1pp2")  # 2 query heads, 2 layers, 2 cores: tp, pp <= 2
VLLM_MODES = ("eager", "compiled")
BUDGETS = (64, 32, 16)  # beside the default 128: prompts up to 64 tokens are chunked
SEQS = (4, 2, 1)  # beside the default 8
BLOCK_SIZES = (64, 128)  # beside the default 32; vLLM's CPU attention needs multiples of 32
NGRAM_K = (2, 1, 4)


def _knob(default, others):
    """default with probability 1/2 (and what it shrinks to), else one of `others`."""
    return st.one_of(st.just(default), st.sampled_from(others))


@st.composite
def vllm_configs(draw, layouts=VLLM_LAYOUTS, modes=VLLM_MODES, base: EngineConfig = VLLM_MODEL):
    """(EngineConfig, VLLMOptions), shrinking toward layouts[0], modes[0] and the defaults."""
    layout = draw(st.sampled_from(layouts))
    mode = draw(st.sampled_from(modes))
    seqs = draw(_knob(base.max_num_seqs, SEQS))
    budget = draw(_knob(base.max_num_batched_tokens, tuple(b for b in BUDGETS if b >= seqs)))
    block = draw(_knob(base.block_size, BLOCK_SIZES))
    k = draw(_knob(0, NGRAM_K))
    prefix = draw(st.booleans())
    async_ = False if k else draw(st.booleans())
    ch = dict(layout=layout, max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=block)
    if mode == "compiled":
        ch.update(COMPILED)
    if k:
        ch.update(speculative_method="ngram", num_speculative_tokens=k)
    return base.replace(**ch), VLLMOptions(enable_prefix_caching=prefix, async_scheduling=async_)


def row_config(row: dict, base: EngineConfig = VLLM_MODEL) -> tuple[EngineConfig, VLLMOptions]:
    """A covering-array row (fuzz.targets.vllm.covering.DIMENSIONS) as (EngineConfig, VLLMOptions).
    A "small" KV cache holds one longest request and one block more: a mixed batch of up to
    8 requests does not fit, so vLLM must preempt (and recompute) requests."""
    ch = dict(layout=row["layout"], max_num_batched_tokens=row["budget"], block_size=row["block"],
              dtype=row["dtype"], max_model_len=row["max_len"])
    if row["mode"] == "compiled":
        ch.update(COMPILED)
    if row["spec"]:
        ch.update(speculative_method="ngram", num_speculative_tokens=row["spec"])
    kv = -(-row["max_len"] // row["block"]) + 1 if row["kv"] == "small" else 0
    return _fit(base.replace(**ch)), VLLMOptions(enable_prefix_caching=row["prefix"], async_scheduling=row["async"],
                                                 kv_blocks=kv, engine_core_process=row.get("core") == "process")


def plan_dimensions(layouts=VLLM_LAYOUTS, modes=VLLM_MODES) -> dict:
    """The covering array's dimensions, with layout and mode restricted to those given."""
    from fuzz.targets.vllm.covering import DIMENSIONS

    return {**DIMENSIONS, "layout": tuple(layouts), "mode": tuple(modes)}


def plan_rows(seed: int = 0, layouts=VLLM_LAYOUTS, modes=VLLM_MODES, exclude: tuple[str, ...] = (),
              base: EngineConfig = VLLM_MODEL, include_known: bool = False) -> tuple[list[dict], int]:
    """The covering plan's rows (fuzz.targets.vllm.covering.covering_plan) minus the excluded
    names, and how many of the first rows cover every pair. Without `include_known`, rows a
    known crash kills (fuzz.targets.vllm.known.KNOWN_CRASHES) are left out (and reported so)."""
    from fuzz.targets.vllm.covering import covering_plan
    from fuzz.targets.vllm.known import KNOWN_CRASHES

    rows, k = covering_plan(plan_dimensions(layouts, modes), seed, excluded=() if include_known else KNOWN_CRASHES)
    exclude = tuple(exclude)
    if not exclude:
        return rows, k
    keep = [i for i, r in enumerate(rows) if not cell_name(*row_config(r, base)).startswith(exclude)]
    return [rows[i] for i in keep], sum(1 for i in keep if i < k)


def plan_configs(n: int, seed: int = 0, layouts=VLLM_LAYOUTS, modes=VLLM_MODES, base: EngineConfig = VLLM_MODEL,
                 exclude: tuple[str, ...] = (), include_known: bool = False) -> list[tuple[EngineConfig, VLLMOptions]]:
    """The first n configs of the covering plan (every pair of dimension values within the
    first k, cheapest first; then triples), none whose name starts with an `exclude` prefix."""
    if n < 1:
        return []
    rows, _ = plan_rows(seed, layouts, modes, exclude, base, include_known)
    return [row_config(r, base) for r in rows[:n]]


def config_row(cfg, opts) -> dict | None:
    """A config as a covering-array row (None when it has a knob the array does not have)."""
    if cfg.max_num_seqs != 8:
        return None
    return {"layout": cfg.layout, "mode": "eager" if cfg.cudagraph_mode == "NONE" else "compiled",
            "spec": cfg.num_speculative_tokens if cfg.speculative_method == "ngram" else 0,
            "budget": cfg.max_num_batched_tokens, "block": cfg.block_size, "prefix": opts.enable_prefix_caching,
            "async": opts.async_scheduling, "dtype": cfg.dtype, "max_len": cfg.max_model_len,
            "kv": "small" if opts.kv_blocks else "large", "core": "process" if opts.engine_core_process else "inproc"}
