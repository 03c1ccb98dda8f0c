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
from engine.sample.requests import fan_out
from engine.sample.sampling_params import DEFAULT as DEFAULT_SAMPLING, SamplingParams
from engine.schedule import Schedule

# 2: `fault_scope` (faults in the test run only, or in every run the harness makes).
# 3: `target` and `target_options` (the engine a Case runs on, and that engine's switches).
# 4: `poison` (what a reset leaves in persistent memory: NaN poison or stale finite values).
# 5: prefix caching (`config.enable_prefix_caching`, and a request's `cache_salt`).
# 6: a request's `sampling` (its non-default SamplingParams) and `abort_step`.
# 7: async scheduling (`config.async_scheduling`, and the schedule's `async_wait`).
# 8: a request's `abort_in_step` (its abort lands while the step it is due at runs).
CASE_FORMAT = 8
TARGETS = ("reference", "vllm", "transformers-cb")
PLAIN_FORMAT = 2  # what a reference-engine Case is written as (see Case.to_dict)
TARGET_FORMAT = 3  # what a Case on another target is written as
POISON_FORMAT = 4  # ... with stale poison
PREFIX_FORMAT = 5  # ... with prefix caching on or a salted request
REQUEST_FORMAT = 6  # ... with a request that samples with non-default params or is aborted
ASYNC_FORMAT = 7  # ... with async scheduling on or a schedule that waits
IN_STEP_FORMAT = 8  # ... with an abort that lands while its step runs
FAULT_SCOPES = ("test", "everywhere")


class CaseFormatError(ValueError):
    """A case file or dict that cannot be loaded; the message is one line."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0  # driver step at which the request is added
    # Prefix caching shares KV blocks only between requests of an equal salt (None: unsalted).
    cache_salt: str | None = None
    # How the request turns logits into tokens (engine/sample/sampling_params.py); None: plain
    # greedy, as before sampling existed (SamplingParams() and a dict of fields are normalised).
    sampling: SamplingParams | None = None
    # The driver step before which the harness aborts the request (engine.abort_request); None:
    # never. The abort comes after that step's arrivals, so abort_step == arrival_step aborts
    # it before it ever runs.
    abort_step: int | None = None
    # The abort lands while step `abort_step` runs: after the engine scheduled it, before its
    # oldest microbatch returns, as a client's abort reaches vLLM's engine core between two of
    # its busy loop's turns while a batch executes. Whatever that step scheduled of the
    # request is then in flight, in every layout and mode (between steps only PP microbatches
    # or an async step ahead can be).
    abort_in_step: bool = False

    def __post_init__(self) -> None:
        s = self.sampling
        if isinstance(s, dict):
            s = SamplingParams.from_dict(s)
        object.__setattr__(self, "sampling", None if s == DEFAULT_SAMPLING else s)

    @property
    def params(self) -> SamplingParams:
        return DEFAULT_SAMPLING if self.sampling is None else self.sampling


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[RequestSpec, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens of every sequence the engine runs (n > 1 counts n times)."""
        return sum((len(r.prompt_token_ids) + r.max_tokens) * r.params.n for r in self.requests)

    def engine_requests(self) -> list[tuple[str, int, RequestSpec, SamplingParams | None]]:
        """What the engine runs, in workload order: (request id, workload index, spec, params
        to pass to add_request). Request i is "r{i}"; one with sampling n > 1 is its n children
        (vLLM's parallel sampling, `engine.sample.requests.fan_out`: "{k}_r{i}", n = 1 each),
        which the harness adds one by one so that each gets its own teacher forcing."""
        out = []
        for i, r in enumerate(self.requests):
            if r.sampling is None:
                out.append((f"r{i}", i, r, None))
            else:
                out.extend((rid, i, r, p) for rid, p in fan_out(f"r{i}", r.sampling))
        return out

    def aborted_ids(self) -> set[str]:
        """Engine request ids whose request has an abort_step (the abort may find it finished)."""
        return {rid for rid, _, r, _ in self.engine_requests() if r.abort_step is not None}


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
    # The engine the Case runs on (fuzz.targets.base: "reference", our engine; "vllm") and its
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
        if self.config.enable_prefix_caching:
            extra.append("prefix_caching")
        if self.config.async_scheduling:
            extra.append("async_scheduling")
        salts = [r.cache_salt for r in w.requests]
        if any(s is not None for s in salts):
            extra.append(f"salts={salts}")
        if self.config.speculative_method != "none":
            extra.append(f"spec={self.config.speculative_method}:{self.config.num_speculative_tokens}")
        sampling = {i: r.sampling.to_dict() for i, r in enumerate(w.requests) if r.sampling is not None}
        if sampling:
            extra.append("sampling=" + ",".join(f"r{i}{d}" for i, d in sampling.items()).replace(" ", ""))
        aborts = [f"r{i}@{r.abort_step}" + ("(in step)" if r.abort_in_step else "")
                  for i, r in enumerate(w.requests) if r.abort_step is not None]
        if aborts:
            extra.append("abort=" + ",".join(aborts))
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
            if r.cache_salt is not None and not isinstance(r.cache_salt, str):
                raise CaseFormatError(f"workload.requests[{i}].cache_salt: expected a string or null")
            if r.abort_step is not None and (not isinstance(r.abort_step, int) or isinstance(r.abort_step, bool)
                                             or r.abort_step < r.arrival_step):
                raise CaseFormatError(f"workload.requests[{i}].abort_step: {r.abort_step!r} is not an integer "
                                      f">= its arrival_step {r.arrival_step}")
            if r.abort_in_step is not False and (r.abort_in_step is not True or r.abort_step is None):
                raise CaseFormatError(f"workload.requests[{i}].abort_in_step: {r.abort_in_step!r} needs true "
                                      f"and an abort_step")
            if r.sampling is not None:
                _check_sampling(f"workload.requests[{i}].sampling", r, cfg)
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
        config = self.config.to_dict()
        # Prefix caching off and no salt: written as before caching existed (the same JSON and
        # reproducer id; and older llmfuzz loads it); on, as format 5, which older ones refuse.
        prefix = bool(config.pop("enable_prefix_caching", False))
        if prefix:
            config["enable_prefix_caching"] = True
        asynchronous = bool(config.pop("async_scheduling", False))  # likewise: written only when on
        if asynchronous:
            config["async_scheduling"] = True
        workload = []
        for r in self.workload.requests:
            wr = {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens,
                  "arrival_step": r.arrival_step}
            if r.cache_salt is not None:
                wr["cache_salt"] = r.cache_salt
                prefix = True
            # Written only when set: a Case without them keeps its JSON (and reproducer id).
            if r.sampling is not None:
                wr["sampling"] = r.sampling.to_dict()
            if r.abort_step is not None:
                wr["abort_step"] = r.abort_step
            if r.abort_in_step:
                wr["abort_in_step"] = True
            workload.append(wr)
        d = {
            "format": PLAIN_FORMAT,
            "config": config,
            "workload": workload,
            "schedule": self.schedule.to_dict(),
            "faults": list(self.faults),
            "fault_scope": self.fault_scope,
        }
        # A reference-engine Case is written exactly as format 2 wrote it: its JSON, and so its
        # reproducer id (a hash of it), stay what they were, and older llmfuzz still loads it.
        if self.target != "reference" or self.target_options:
            d.update(format=TARGET_FORMAT, target=self.target, target_options=dict(self.target_options))
        if self.poison != "nan":  # likewise a NaN-poison Case stays as format 2 or 3 wrote it
            d.update(format=POISON_FORMAT, poison=self.poison)
        if prefix:
            d["format"] = PREFIX_FORMAT
        if any(r.sampling is not None or r.abort_step is not None for r in self.workload.requests):
            d["format"] = REQUEST_FORMAT
        if asynchronous or self.schedule.async_wait:
            d["format"] = ASYNC_FORMAT
        if any(r.abort_in_step for r in self.workload.requests):
            d["format"] = IN_STEP_FORMAT
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
            reqs = tuple(_request(i, r) for i, r in enumerate(d["workload"]))
            sched = Schedule.from_dict(d.get("schedule", {}))
            faults = tuple(str(f) for f in d.get("faults", ()))
            scope = str(d.get("fault_scope", "test"))  # format 1 had test-run faults only
            target = str(d.get("target", "reference"))  # formats 1-2: the reference engine
            options = d.get("target_options", {})
            poison = str(d.get("poison", "nan"))  # formats 1-3 ran with NaN poison
        except CaseFormatError:
            raise
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


def _salt(v: object) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"cache_salt: expected a string or null, got {v!r}")
    return v


def _request(i: int, r: dict) -> RequestSpec:
    where = f"case.workload[{i}]"
    sampling = r.get("sampling")
    if sampling is not None:
        if not isinstance(sampling, dict):
            raise CaseFormatError(f"{where}.sampling: expected a JSON object of SamplingParams fields")
        try:  # JSON lists -> the tuples SamplingParams holds (it normalises nested lists too)
            sampling = SamplingParams.from_dict(sampling)
        except ConfigError as e:  # "SamplingParams.top_p: ..." -> "case.workload[0].sampling.top_p: ..."
            msg = str(e)
            raise CaseFormatError(f"{where}.sampling{msg[len('SamplingParams'):]}" if msg.startswith("SamplingParams")
                                  else f"{where}.sampling: {msg}") from None
        except (TypeError, ValueError) as e:
            raise CaseFormatError(f"{where}.sampling: {e}") from None
    abort = r.get("abort_step")
    if abort is not None and (not isinstance(abort, int) or isinstance(abort, bool)):
        raise CaseFormatError(f"{where}.abort_step: expected an integer or null, got {abort!r}")
    in_step = r.get("abort_in_step", False)
    if not isinstance(in_step, bool):
        raise CaseFormatError(f"{where}.abort_in_step: expected true or false, got {in_step!r}")
    return RequestSpec(tuple(int(t) for t in r["prompt_token_ids"]), int(r["max_tokens"]),
                       int(r.get("arrival_step", 0)), _salt(r.get("cache_salt")), sampling, abort, in_step)


def _check_sampling(where: str, r: RequestSpec, cfg: EngineConfig) -> None:
    """What the engine's add_request would refuse, as one line before any rank starts."""
    p = r.sampling
    if not isinstance(p, SamplingParams):
        raise CaseFormatError(f"{where}: expected SamplingParams, got {type(p).__name__}")
    if p.max_tokens is not None and p.max_tokens != r.max_tokens:
        raise CaseFormatError(f"{where}.max_tokens: {p.max_tokens} contradicts the request's max_tokens "
                              f"{r.max_tokens} (leave it out)")
    if p.min_tokens > r.max_tokens:
        raise CaseFormatError(f"{where}.min_tokens: {p.min_tokens} > max_tokens {r.max_tokens}")
    bad = sorted(t for t in p.token_ids() if t >= cfg.vocab_size)
    if bad:
        raise CaseFormatError(f"{where}: token id {bad[0]} outside vocab of {cfg.vocab_size}")
    if not p.is_greedy and cfg.speculative_method != "none":
        raise CaseFormatError(f"{where}.temperature: {p.temperature} (random sampling) needs speculative_method "
                              f"none, not {cfg.speculative_method} (verification is greedy)")


def steps_to_finish(r: RequestSpec, cfg: EngineConfig) -> int:
    """About the driver steps from `r`'s arrival to its end when it runs alone: its prefill
    chunks and decodes, each a microbatch that comes back pp steps later."""
    chunks = -(-len(r.prompt_token_ids) // cfg.max_num_batched_tokens)
    return cfg.pipeline_parallel_size * (chunks + r.max_tokens) + 1


def reference_config(cfg: EngineConfig) -> EngineConfig:
    """The reference run's config: same model, cache and budget; tp1pp1, eager, in-process,
    plain decoding (never speculative: a speculative Case is compared with plain greedy
    decoding), no prefix caching (a Case with caching is compared with caching off),
    synchronous scheduling (an async Case is compared with the engine waiting for each step), float32
    on the test run's weights (a bf16 run's weights rounded to bf16), with the reference
    attention backend (real kernels take half precision only)."""
    half = cfg.dtype not in ("float32", "float64")
    return cfg.replace(tensor_parallel_size=1, pipeline_parallel_size=1, sequence_parallel=False,
                       enable_prefix_caching=False, async_scheduling=False,
                       broadcast_pp_output=False, cudagraph_mode="NONE", capture_sizes=(), world="inproc",
                       speculative_method="none", num_speculative_tokens=0,
                       dtype="float32" if half else cfg.dtype,
                       weights_dtype=cfg.weights_dtype or (cfg.dtype if half else None),
                       attention_backend="reference")
