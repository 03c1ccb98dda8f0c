"""`EngineTarget`: the plumbing between an engine's own generate call and the black-box runner
protocol (fuzz.targets.blackbox), so that an adapter is a `generate` and little else
(docs/targets.md; exported as `llmfuzz.Target`).

An adapter implements `generate(config, requests)`: run `requests` (token-id prompts, each
with its SamplingParams) on the engine for `config` (the Case's EngineConfig: model shape
and seed, layout, mode, block size, budget...; the weights are `self.checkpoint(config)`, a
Hugging Face directory), and return per request a `Completion` (or a dict of its fields),
as a list in request order or a dict by request id. The base class builds the requests,
times the call, turns whatever the engine raises into a `TargetFailure` keyed by its
signature, and the completions into a `TargetRun`.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from engine.attention.fa_contract import FAInvariantError
from engine.config import EngineConfig
from engine.sample.sampling_params import DEFAULT as GREEDY, SamplingParams
from fuzz.cases.case import Case
from fuzz.targets.checkpoint import checkpoint_dir
from fuzz.targets.runs import RequestResult, TargetFailure, TargetRun, signature


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # generate exactly this many unless a stop in `sampling` ends it (there is no EOS)
    sampling: SamplingParams = GREEDY  # SamplingParams(): greedy on the raw logits
    arrival_step: int = 0  # engine steps to run before adding it (engines without steps may ignore it)
    cache_salt: str | None = None  # prefix caching: share KV only with requests of an equal salt
    logprobs: int = 5  # top-k raw logprobs wanted at each generated position
    prompt_logprobs: int | None = None  # top-k raw logprobs at each prompt position from the second; None: none


@dataclass
class Completion:
    token_ids: Sequence[int]
    # Per generated token: {token id: raw logprob} (log-softmax of the model's logits, before
    # any sampling param), the top-k and the generated token itself.
    logprobs: Sequence[Mapping[int, float]]
    prompt_logprobs: Sequence[Mapping[int, float]] = field(default_factory=tuple)  # prompt token 1, 2, ...


def _position(p: Mapping[int, float] | Sequence) -> tuple[tuple[int, float], ...]:
    pairs = p.items() if isinstance(p, Mapping) else p
    return tuple(sorted(((int(t), float(v)) for t, v in pairs), key=lambda tv: -tv[1]))


def to_result(c: Completion | Mapping[str, Any]) -> RequestResult:
    """A Completion (or a dict of its fields) as the RequestResult the checker compares."""
    get = c.get if isinstance(c, Mapping) else lambda k, d=None: getattr(c, k, d)
    return RequestResult(tuple(int(t) for t in get("token_ids")), tuple(_position(p) for p in get("logprobs")),
                         tuple(_position(p) for p in get("prompt_logprobs", ()) or ()))


def fa_error(e: BaseException | None) -> FAInvariantError | None:
    """The FAInvariantError `e` is or was raised from (an engine may wrap it: ours in RankFailure)."""
    for _ in range(16):
        if e is None or isinstance(e, FAInvariantError):
            return e
        e = e.__cause__ or e.__context__
    return None


class EngineTarget:
    """Base class of an engine adapter: subclass, set `name`, implement `generate`."""

    name = "target"  # names the properties (`<name>_vs_reference`, ...) and the reproducers' folder
    top_k = 5  # raw logprobs asked for at each position
    supports_sampling = False  # True: generate honours Request.sampling (else such Cases are refused)
    supports_prompt_logprobs = False  # True: generate returns prompt_logprobs when a Request asks
    # True: the engine may carry state from one generate call to the next (a persistent batch,
    # a cache), so a failure is replayed on a brand-new instance, in a new process, before it
    # is written as reproducible (docs/targets.md). False: every call starts from scratch.
    keeps_state = True

    def fresh_init(self) -> dict:
        """Keyword arguments (JSON) that make a brand-new instance of this class in a new
        process, where it is imported by `module:qualname` (the fresh replay)."""
        return {}

    def generate(self, config: EngineConfig, requests: list[Request]):
        """Completions of `requests` on the engine for `config` (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__}.generate")  # the one method every adapter writes

    def checkpoint(self, config: EngineConfig) -> str:
        """The Hugging Face directory of `config`'s weights: what the engine must load."""
        return checkpoint_dir(config)

    # -- the runner protocol ------------------------------------------------------------------
    def engine_key(self, case: Case) -> str:
        """Cases with equal keys run on the same engine: by default, equal configs."""
        return json.dumps(case.config.to_dict(), sort_keys=True, default=str)

    def run(self, case: Case, items=None, prompt_logprobs: bool = False) -> TargetRun:
        from fuzz.targets.blackbox import engine_items

        items = engine_items(case) if items is None else items
        reqs = [Request(rid, tuple(r.prompt_token_ids), r.max_tokens, r.params, r.arrival_step, r.cache_salt,
                        self.top_k, self.top_k if prompt_logprobs else None) for rid, r in items]
        t0 = time.perf_counter()
        try:
            out = self.generate(case.config, reqs)
        except TargetFailure:
            raise
        except Exception as e:  # any exception out of the engine is a crash, keyed by where it came from
            fa = fa_error(e)
            if fa is not None:  # the FA guard (fuzz.guard, mode "raise") refused a call in the engine
                raise TargetFailure("fa_invariants", f"FAInvariantError:{fa.argument}", str(fa)) from e
            raise TargetFailure("crash", self.signature(e), f"{type(e).__name__}: {e}"[:400]) from e
        seconds = time.perf_counter() - t0
        if isinstance(out, Mapping):
            results = {str(rid): to_result(c) for rid, c in out.items()}
        else:
            out = list(out)
            if len(out) != len(reqs):
                raise TargetFailure("crash", "WrongNumberOfCompletions@generate",
                                    f"{len(out)} completions for {len(reqs)} requests")
            results = {r.request_id: to_result(c) for r, c in zip(reqs, out)}
        return TargetRun(results, seconds)

    def signature(self, e: BaseException) -> str:
        """`Type@file:function` of the innermost frame in the adapter's package, else of the
        innermost frame outside the Python installation and llmfuzz (no line numbers)."""
        frames = [{"file": f.filename, "func": f.name} for f in traceback.extract_tb(e.__traceback__)]
        package = type(self).__module__.split(".")[0]
        sig = signature(type(e).__name__, frames, package)
        if not sig.endswith(f"<outside {package}>"):
            return sig
        here = os.path.dirname(os.path.abspath(__file__))
        for f in reversed(frames):
            path = os.path.abspath(f["file"])
            if not path.startswith((sys.prefix, sys.base_prefix, here)):
                return f"{type(e).__name__}@{os.path.basename(path)}:{f['func']}"
        return f"{type(e).__name__}@{frames[-1]['func'] if frames else '?'}"

    def close(self) -> None:
        """Release the engine(s)."""
