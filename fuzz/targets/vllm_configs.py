"""vLLM configs as a Hypothesis strategy, and the handful a campaign can afford.

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

from hypothesis import strategies as st

from engine.config import EngineConfig
from fuzz.targets.vllm_target import COMPILED, VLLM_MODEL, VLLMOptions, cell_name

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
