"""Case: everything one fuzz example runs, as a frozen value with a versioned JSON form.

A Case is EngineConfig + Workload + Schedule + faults. It is what strategies draw, what
ranks receive, what Hypothesis shrinks and what a reproducer stores. Loading never
executes anything from the file (JSON only); a malformed, truncated or newer-format file
fails with one line naming the problem.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.config import ConfigError, EngineConfig
from engine.faults import FAULTS
from engine.poison import POISON_MODES
from engine.schedule import Schedule

# 2: `fault_scope` (faults in the test run only, or in every run the harness makes).
# 3: `target` and `target_options` (the engine a Case runs on, and that engine's switches).
# 4: `poison` (what a reset leaves in persistent memory: NaN poison or stale finite values).
CASE_FORMAT = 4
TARGETS = ("reference", "vllm")
PLAIN_FORMAT = 2  # what a reference-engine Case is written as (see Case.to_dict)
TARGET_FORMAT = 3  # what a Case on another target is written as
FAULT_SCOPES = ("test", "everywhere")


class CaseFormatError(ValueError):
    """A case file or dict that cannot be loaded; the message is one line."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0  # driver step at which the request is added


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[RequestSpec, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


@dataclass(frozen=True, slots=True)
class Case:
    config: EngineConfig
    workload: Workload
    schedule: Schedule = field(default_factory=Schedule)
    faults: tuple[str, ...] = ()
    # "test": faults switch on in the run under test only (the differential check's view);
    # "everywhere": in every engine run the harness makes (reference included), as a real
    # bug in shared code would be. Only oracles that share no code with it can then see it.
    fault_scope: str = "test"
    # The engine the Case runs on (fuzz.target: "reference", our engine; "vllm") and its
    # switches that no EngineConfig field holds (vLLM: prefix caching, async scheduling).
    # Part of the Case so that minimizing, hashing and reproducers carry them with it.
    target: str = "reference"
    target_options: dict = field(default_factory=dict, hash=False)
    # What every engine reset leaves in the ranks' persistent memory (engine/poison.py):
    # "nan" (loud) or "stale" (finite values of earlier batches, as GPU memory holds).
    poison: str = "nan"

    @property
    def layout(self) -> str:
        return self.config.layout

    @property
    def mode(self) -> str:
        return "eager" if self.config.cudagraph_mode == "NONE" else "graph"

    def describe(self) -> str:
        w = self.workload
        lens = [len(r.prompt_token_ids) for r in w.requests]
        extra = []
        if self.config.sequence_parallel:
            extra.append("sp")
        if self.config.broadcast_pp_output:
            extra.append("broadcast_pp_output")
        if self.config.speculative_method != "none":
            extra.append(f"spec={self.config.speculative_method}:{self.config.num_speculative_tokens}")
        if not self.schedule.is_default:
            extra.append(f"schedule={self.schedule.to_dict()}")
        if self.target != "reference":
            extra.append(f"target={self.target}" + "".join(f"+{k}" for k, v in sorted(self.target_options.items()) if v))
        if self.poison != "nan":
            extra.append(f"poison={self.poison}")
        if self.faults:
            extra.append(f"faults={list(self.faults)}" + (" everywhere" if self.fault_scope == "everywhere" else ""))
        return (f"{self.layout} {self.mode} | {len(lens)} request(s), prompt lens {lens}, "
                f"budget {self.config.max_num_batched_tokens}, blocks {self.config.num_gpu_blocks}"
                + (" | " + " ".join(extra) if extra else ""))

    def validate(self) -> None:
        """Everything a rank would trip over, checked before any rank starts."""
        cfg = self.config
        if not self.workload.requests:
            raise CaseFormatError("workload: no requests")
        for i, r in enumerate(self.workload.requests):
            if not r.prompt_token_ids:
                raise CaseFormatError(f"workload.requests[{i}]: empty prompt")
            if r.max_tokens < 1:
                raise CaseFormatError(f"workload.requests[{i}].max_tokens: {r.max_tokens} < 1")
            if r.arrival_step < 0:
                raise CaseFormatError(f"workload.requests[{i}].arrival_step: negative")
            if len(r.prompt_token_ids) + r.max_tokens > cfg.max_model_len:
                raise CaseFormatError(f"workload.requests[{i}]: prompt + max_tokens exceeds "
                                      f"max_model_len={cfg.max_model_len}")
            bad = [t for t in r.prompt_token_ids if not 0 <= t < cfg.vocab_size]
            if bad:
                raise CaseFormatError(f"workload.requests[{i}]: token id {bad[0]} outside vocab "
                                      f"of {cfg.vocab_size}")
        if self.fault_scope not in FAULT_SCOPES:
            raise CaseFormatError(f"fault_scope: {self.fault_scope!r} is not one of {', '.join(FAULT_SCOPES)}")
        if self.poison not in POISON_MODES:
            raise CaseFormatError(f"poison: {self.poison!r} is not one of {', '.join(POISON_MODES)}")
        if self.target not in TARGETS:
            raise CaseFormatError(f"target: {self.target!r} is not one of {', '.join(TARGETS)}")
        if not isinstance(self.target_options, dict):
            raise CaseFormatError("target_options: expected a JSON object")
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise CaseFormatError(f"faults: unknown fault {unknown[0]!r}")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "format": PLAIN_FORMAT,
            "config": self.config.to_dict(),
            "workload": [{"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                          "arrival_step": r.arrival_step} for r in self.workload.requests],
            "schedule": self.schedule.to_dict(),
            "faults": list(self.faults),
            "fault_scope": self.fault_scope,
        }
        # A reference-engine Case is written exactly as format 2 wrote it: its JSON, and so its
        # reproducer id (a hash of it), stay what they were, and older llmfuzz still loads it.
        if self.target != "reference" or self.target_options:
            d.update(format=TARGET_FORMAT, target=self.target, target_options=dict(self.target_options))
        if self.poison != "nan":  # likewise a NaN-poison Case stays as format 2 or 3 wrote it
            d.update(format=CASE_FORMAT, poison=self.poison)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: object) -> "Case":
        if not isinstance(d, dict):
            raise CaseFormatError("case: expected a JSON object")
        fmt = d.get("format")
        if not isinstance(fmt, int):
            raise CaseFormatError("case.format: missing or not an integer")
        if fmt > CASE_FORMAT:
            raise CaseFormatError(f"case.format: {fmt} is newer than this llmfuzz understands "
                                  f"({CASE_FORMAT}); upgrade llmfuzz")
        for key in ("config", "workload"):
            if key not in d:
                raise CaseFormatError(f"case.{key}: missing")
        try:
            cfg_d = dict(d["config"])
            cfg_d["capture_sizes"] = tuple(cfg_d.get("capture_sizes", ()))
            cfg = EngineConfig.from_dict(cfg_d)
        except ConfigError as e:
            raise CaseFormatError(f"case.config: {e}") from None
        except (TypeError, ValueError) as e:
            raise CaseFormatError(f"case.config: {e}") from None
        try:
            reqs = tuple(RequestSpec(tuple(int(t) for t in r["prompt_token_ids"]), int(r["max_tokens"]),
                                     int(r.get("arrival_step", 0))) for r in d["workload"])
            sched = Schedule.from_dict(d.get("schedule", {}))
            faults = tuple(str(f) for f in d.get("faults", ()))
            scope = str(d.get("fault_scope", "test"))  # format 1 had test-run faults only
            target = str(d.get("target", "reference"))  # formats 1-2: the reference engine
            options = d.get("target_options", {})
            poison = str(d.get("poison", "nan"))  # formats 1-3 ran with NaN poison
        except (KeyError, TypeError, ValueError) as e:
            raise CaseFormatError(f"case: malformed workload/schedule/faults ({type(e).__name__}: {e})") from None
        case = cls(cfg, Workload(reqs), sched, faults, scope, target, options, poison)
        case.validate()
        return case

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CaseFormatError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return cls.from_dict(d)

    def key(self) -> str:
        return self.to_json()


def reference_config(cfg: EngineConfig) -> EngineConfig:
    """The reference run's config: same model, cache and budget; tp1pp1, eager, in-process,
    plain decoding (never speculative: a speculative Case is compared with plain greedy
    decoding), float32 on the test run's weights (a bf16 run's weights rounded to bf16),
    with the reference attention backend (real kernels take half precision only)."""
    half = cfg.dtype not in ("float32", "float64")
    return cfg.replace(tensor_parallel_size=1, pipeline_parallel_size=1, sequence_parallel=False,
                       broadcast_pp_output=False, cudagraph_mode="NONE", capture_sizes=(), world="inproc",
                       speculative_method="none", num_speculative_tokens=0,
                       dtype="float32" if half else cfg.dtype,
                       weights_dtype=cfg.weights_dtype or (cfg.dtype if half else None),
                       attention_backend="reference")
