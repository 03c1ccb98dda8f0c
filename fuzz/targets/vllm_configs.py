"""vLLM configs: the model (`VLLM_MODEL`), the switches no EngineConfig field holds
(`VLLMOptions`, a Case's `target_options`), config names, a Hypothesis strategy, and the
handful a campaign can afford.

`vllm_configs()` draws (EngineConfig, VLLMOptions) over the knobs vLLM users turn: layout
(tp, pp), eager vs compiled, the chunked-prefill budget (`max_num_batched_tokens`),
`max_num_seqs`, block size, n-gram speculative decoding (k), prefix caching and async
scheduling. Every knob shrinks open: the first layout and mode given (tp1pp1, eager), budget
128, 8 sequences, block 32, no speculation, no prefix caching, no async scheduling. Each knob
is left at its default with probability 1/2, so a draw turns on a few things at once.

An engine start costs ~40-100 s on the 2-core machine, so a campaign cannot draw a config per
example. `plan_configs(n, seed, ...)` draws configs from the strategy with a fixed seed and
picks n of them: the simplest (plain tp1pp1 eager) first, then one per layout x mode (so tp1,
tp2 and pp2 are each seen eager and compiled), then further draws round robin over the
layout x mode groups; ordered simplest first (fewest knobs away from the defaults). The campaign then keeps one engine per config and
draws workloads within it.

Combinations vLLM rejects at start-up by design are not drawn: async scheduling with n-gram
speculation (vLLM 0.32: "async scheduling is only supported with EAGLE/MTP/Draft Model/NGram
GPU ... speculative decoding"). On CPU vLLM's platform turns async scheduling off whatever
is asked (platforms/cpu.py: "async scheduling is not required on CPU"), so there the knob
only changes the arguments; it matters on CUDA.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from hypothesis import strategies as st

from engine.config import EngineConfig

if TYPE_CHECKING:
    from fuzz.case import Case

# A tiny Llama that vLLM's CPU backend accepts: head_dim 64 (its CPU attention rejects 16),
# block size a multiple of 32. 2 query heads over 1 kv head (GQA; tp2 replicates the kv
# head), 2 layers (pp2 = one layer per stage). Prompts up to max_model_len // 2 = 64 tokens
# cover block edges 31/32/33 and 63/64.
VLLM_MODEL = EngineConfig(
    vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=64, intermediate_size=256, block_size=32, num_gpu_blocks=64, max_num_seqs=8,
    max_num_batched_tokens=128, max_model_len=128)


@dataclass(frozen=True, slots=True)
class VLLMOptions:
    """vLLM switches that have no EngineConfig field (stored in reproducers' meta)."""

    enable_prefix_caching: bool = False
    async_scheduling: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "VLLMOptions":
        d = dict(d or {})
        unknown = sorted(set(d) - {"enable_prefix_caching", "async_scheduling"})
        if unknown:
            raise ValueError(f"vllm_options: unknown field {unknown[0]!r}")
        return cls(**d)

    @classmethod
    def of(cls, case: Case) -> "VLLMOptions":
        """A Case's options (its `target_options`; the defaults for a Case that has none)."""
        return cls.from_dict(case.target_options)

    def on(self, case: Case) -> Case:
        """`case` for vLLM with these options."""
        return replace(case, target="vllm", target_options=self.to_dict())

    def describe(self) -> str:
        on = [k for k, v in self.to_dict().items() if v]
        return ",".join(on)


COMPILED = dict(cudagraph_mode="FULL", capture_sizes=(1, 2, 4, 8))  # "compiled": torch.compile on CPU


def cell_name(cfg: EngineConfig, opts: VLLMOptions = VLLMOptions()) -> str:
    """'tp1pp2-eager', 'tp1pp1-compiled-b16-s2-blk64-ngram2+enable_prefix_caching' (the parts
    that differ from VLLM_MODEL; `parse_cell_name` inverts it)."""
    name = f"{cfg.layout}-{'eager' if cfg.cudagraph_mode == 'NONE' else 'compiled'}"
    if cfg.max_num_batched_tokens != VLLM_MODEL.max_num_batched_tokens:
        name += f"-b{cfg.max_num_batched_tokens}"
    if cfg.max_num_seqs != VLLM_MODEL.max_num_seqs:
        name += f"-s{cfg.max_num_seqs}"
    if cfg.block_size != VLLM_MODEL.block_size:
        name += f"-blk{cfg.block_size}"
    if cfg.speculative_method != "none":
        name += f"-{cfg.speculative_method}{cfg.num_speculative_tokens}"
    if opts.describe():
        name += "+" + opts.describe().replace(",", "+")
    return name


_CELL = re.compile(r"^(?P<layout>tp\d+pp\d+)-(?P<mode>eager|compiled)(?:-b(?P<b>\d+))?(?:-s(?P<s>\d+))?"
                   r"(?:-blk(?P<blk>\d+))?(?:-ngram(?P<k>\d+))?(?P<opts>(?:\+\w+)*)$")


def parse_cell_name(name: str, base: EngineConfig = VLLM_MODEL) -> tuple[EngineConfig, VLLMOptions]:
    """'tp2pp1-compiled-b32-ngram2+enable_prefix_caching' -> (EngineConfig, VLLMOptions);
    ValueError naming the problem otherwise."""
    from engine.config import ConfigError

    m = _CELL.match(name.strip())
    if not m:
        raise ValueError(f"{name!r} is not a vLLM config name like tp1pp2-eager or "
                         f"tp1pp1-compiled-b16-s2-blk64-ngram2+enable_prefix_caching")
    ch: dict = {"layout": m["layout"]}
    if m["mode"] == "compiled":
        ch.update(COMPILED)
    for key, field_ in (("b", "max_num_batched_tokens"), ("s", "max_num_seqs"), ("blk", "block_size")):
        if m[key]:
            ch[field_] = int(m[key])
    if m["k"]:
        ch.update(speculative_method="ngram", num_speculative_tokens=int(m["k"]))
    flags = [f for f in m["opts"].split("+") if f]
    try:
        opts = VLLMOptions(**{f: True for f in flags})
    except TypeError:
        raise ValueError(f"{name!r}: unknown option in {'+'.join(flags)!r} (known: enable_prefix_caching, "
                         f"async_scheduling)") from None
    try:
        return base.replace(**ch), opts
    except ConfigError as e:
        raise ValueError(f"{name!r}: {e}") from None


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


def complexity(cfg: EngineConfig, opts: VLLMOptions, base: EngineConfig = VLLM_MODEL) -> tuple:
    """Sort key, simplest first: workers, compiled, then how many knobs differ from base."""
    knobs = sum((cfg.max_num_batched_tokens != base.max_num_batched_tokens, cfg.max_num_seqs != base.max_num_seqs,
                 cfg.block_size != base.block_size, cfg.speculative_method != "none",
                 opts.enable_prefix_caching, opts.async_scheduling))
    return (knobs > 0, cfg.world_size, cfg.cudagraph_mode != "NONE", knobs, cell_name(cfg, opts))


def draw_configs(count: int, seed: int, layouts=VLLM_LAYOUTS, modes=VLLM_MODES,
                 base: EngineConfig = VLLM_MODEL) -> list[tuple[EngineConfig, VLLMOptions]]:
    """`count` draws of vllm_configs(), deterministic for a seed (Hypothesis's generator under
    @seed, no database, no shrinking)."""
    from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

    out: list = []

    @hseed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(vllm_configs(layouts, modes, base))
    def collect(c) -> None:
        out.append(c)

    collect()
    return out


def plan_configs(n: int, seed: int = 0, layouts=VLLM_LAYOUTS, modes=VLLM_MODES,
                 base: EngineConfig = VLLM_MODEL, exclude: tuple[str, ...] = ()) -> list[tuple[EngineConfig, VLLMOptions]]:
    """n distinct configs for a campaign, simplest first (module docstring), none whose name
    starts with one of the `exclude` prefixes."""
    if n < 1:
        return []
    exclude = tuple(exclude)

    def ok(c) -> bool:
        return not (exclude and cell_name(*c).startswith(exclude))

    simplest = (base.replace(layout=layouts[0], **(COMPILED if modes[0] == "compiled" else {})), VLLMOptions())
    chosen = {cell_name(*simplest): simplest} if ok(simplest) else {}
    pool = [c for c in draw_configs(max(8 * n, 64), seed, layouts, modes, base) if ok(c)]

    def add(c) -> None:
        if len(chosen) < n:
            chosen.setdefault(cell_name(*c), c)

    def group(c) -> tuple:
        return c[0].layout, c[0].cudagraph_mode != "NONE"

    groups = [(layout, mode == "compiled") for layout in layouts for mode in modes]
    by_group = {g: [c for c in pool if group(c) == g and cell_name(*c) not in chosen] for g in groups}
    for g in groups:  # coverage: every layout x mode (knobs as drawn), unless already there
        if by_group[g] and not any(group(c) == g for c in chosen.values()):
            add(by_group[g].pop(0))
    while len(chosen) < n and any(by_group.values()):  # then round robin over the groups
        for g in groups:
            while by_group[g] and cell_name(*by_group[g][0]) in chosen:
                by_group[g].pop(0)
            if by_group[g]:
                add(by_group[g].pop(0))
    return sorted(chosen.values(), key=lambda c: complexity(*c, base=base))
