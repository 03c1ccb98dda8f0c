"""`llmfuzz run --target vllm` (alias `llmfuzz vllm run`): a time-budgeted campaign against
vLLM, a minimizer, replay.

A vLLM config (layout, eager/compiled, token budget, max_num_seqs, block size, n-gram
speculation, prefix caching, async scheduling) is drawn by the Hypothesis strategy
`fuzz.targets.vllm_configs.vllm_configs` (shrinks open: tp1pp1 eager, defaults). Starting an
engine costs ~40-100 s here, so a campaign draws a handful of configs up front with its
seed (`plan_configs`: plain tp1pp1 eager first, every layout x mode, simplest first) and
visits them in order with one engine each (a *cell*); within a cell Hypothesis draws
workloads (`fuzz.strategies.workloads` on the cell's config: prompts around the block
edges and the token budget, repetitive prompts, arrivals while others run). Every example
is checked by `VLLMChecker` (crash/hang, greedy, vs reference, vs transformers with prompt
logprobs, batch invariance). Hypothesis's own shrinker is off (a crash costs an engine
restart per shrink step): a failure is shrunk by `minimize_vllm` (time-bounded: jump to one
request with a one-token prompt, then fuzz.shrink's greedy candidates on the same config,
then the config itself toward the defaults, one knob per engine start), written with
fuzz.reproduce.write_reproducer under `<out>/<property>/<id>.json` plus the vLLM version,
options, LLM kwargs and signature, and the campaign goes on. A crash or hang ends its cell
(every further example would restart the engine to hit the same thing); a crash whose
signature is listed in the known-failures file (`--known`, one signature per line, `#`
comments) is counted as known, and no reproducer is written. A config vLLM refuses at
start-up with a ValueError or NotImplementedError from its config checks is counted as
*unsupported* (listed, not a failure).

The commands (`llmfuzz vllm run|replay|cells`) are in `fuzz.targets.vllm_cli`. Nothing here
imports torch or vLLM at import time.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


SECONDS_PER_CONFIG = 150.0  # an engine start (~40-100 s here) plus a useful stretch of examples
MAX_CONFIGS = 12


class BadArgs(ValueError):
    """A command-line value that names no config; reported as one line, exit 2."""


def auto_config_count(budget_s: float) -> int:
    return max(1, min(MAX_CONFIGS, round(budget_s / SECONDS_PER_CONFIG)))


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def parse_modes(text: str | None) -> tuple[str, ...]:
    """'eager,graph' -> ('eager', 'compiled'): `graph` (the reference engine's word) and
    `compiled` both mean vLLM without enforce_eager (torch.compile on CPU)."""
    out = []
    for m in _split(text):
        m = {"graph": "compiled"}.get(m, m)
        if m not in ("eager", "compiled"):
            raise BadArgs(f"--modes: {m!r} is not one of eager, compiled (or graph)")
        if m not in out:
            out.append(m)
    return tuple(out)


def parse_layouts(text: str | None) -> tuple[str, ...]:
    from engine.config import ConfigError, layout_name, parse_layout
    from fuzz.targets.vllm_target import VLLM_MODEL

    out = []
    for item in _split(text):
        try:
            tp, pp = parse_layout(item)
            VLLM_MODEL.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        except ConfigError as e:
            raise BadArgs(f"--layouts: {e}") from None
        if layout_name(tp, pp) not in out:
            out.append(layout_name(tp, pp))
    return tuple(out)


def campaign_configs(*, budget_s: float, seed: int = 0, count: int | None = None, layouts: str | None = None,
                     modes: str | None = None, cells: str | None = None, exclude: str | None = None) -> list:
    """The (EngineConfig, VLLMOptions) a campaign visits, in order: the named `cells`, else
    `count` (default: one per ~150 s of budget) drawn by `plan_configs` over the layouts and
    modes given; minus names starting with an `exclude` prefix."""
    from fuzz.targets.vllm_configs import VLLM_LAYOUTS, VLLM_MODES, plan_configs
    from fuzz.targets.vllm_target import parse_cell_name

    if cells:
        chosen = []
        for n in _split(cells):
            try:
                chosen.append(parse_cell_name(n))
            except ValueError as e:
                raise BadArgs(f"--cells: {e}") from None
    else:
        lay = parse_layouts(layouts) or VLLM_LAYOUTS
        mod = parse_modes(modes) or VLLM_MODES
        n = count if count is not None else auto_config_count(budget_s)
        if n < 1:
            raise BadArgs(f"--configs: {n} is not a positive number of configs")
        chosen = plan_configs(n, seed, lay, mod, exclude=tuple(_split(exclude)))
    if not chosen:
        raise BadArgs("no vLLM config left to visit (check --cells / --exclude)")
    return chosen


def load_known(path: str | None) -> set[str]:
    if not path:
        return set()
    with open(path) as f:
        return {ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()}


# -- reproducers ------------------------------------------------------------------------------

def write_vllm_reproducer(out_dir: str, violation, opts, target) -> str:
    """fuzz.reproduce.write_reproducer, then the vLLM facts added to the same file (atomic)."""
    import tempfile

    from fuzz.reproduce import write_reproducer
    from fuzz.targets.vllm_target import llm_kwargs, worker_env

    case = violation.case
    path = write_reproducer(out_dir, case, violation.property, violation.message, violation.error_ratio)
    with open(path) as f:
        doc = json.load(f)
    env = worker_env(case.config)
    doc.update({
        "target": "vllm", "vllm_version": target.vllm_version, "vllm_options": opts.to_dict(),
        "llm_kwargs": llm_kwargs(case.config, opts),
        "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND") if k in env},
        "replay": f"llmfuzz replay {path}",
    })
    if getattr(violation, "signature", None):
        doc["signature"] = violation.signature
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


UNSUPPORTED_TYPES = ("ValueError", "NotImplementedError")


def unsupported(f) -> bool:
    """A start-up refused by vLLM's own config checks (a ValueError / NotImplementedError raised
    in vllm/config, vllm/engine/arg_utils.py or vllm/platforms) is an unsupported
    configuration, not a crash."""
    if f.kind != "startup":
        return False
    typ, _, where = f.signature.partition("@")
    return typ in UNSUPPORTED_TYPES and where.startswith(("vllm/config/", "vllm/engine/arg_utils.py",
                                                          "vllm/platforms/"))


def same_failure(a, b) -> bool:
    if a.property != b.property:
        return False
    sa, sb = getattr(a, "signature", None), getattr(b, "signature", None)
    return sa == sb


# -- minimizing -------------------------------------------------------------------------------

def simpler_configs(cfg, opts):
    """One knob of (cfg, opts) back toward the default per candidate, cheapest-to-test first:
    options, speculation, block size, budget and sequences, then eager, then tp1pp1."""
    from fuzz.targets.vllm_target import VLLM_MODEL

    base = VLLM_MODEL
    out = []
    if opts.enable_prefix_caching:
        out.append((cfg, replace(opts, enable_prefix_caching=False)))
    if opts.async_scheduling:
        out.append((cfg, replace(opts, async_scheduling=False)))
    if cfg.speculative_method != "none":
        out.append((cfg.replace(speculative_method="none", num_speculative_tokens=0), opts))
    for f in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(cfg, f) != getattr(base, f):
            out.append((cfg.replace(**{f: getattr(base, f)}), opts))
    if cfg.cudagraph_mode != "NONE":
        out.append((cfg.replace(cudagraph_mode="NONE", capture_sizes=()), opts))
    if cfg.world_size > 1:
        out.append((cfg.replace(layout="tp1pp1"), opts))
    return out


def minimize_vllm(violation, checker, opts, deadline: float, max_checks: int = 60, configs: bool = True):
    """Greedy, bounded by `deadline`: first jump straight to one request with a one-token
    prompt and max_tokens=1 (each request in turn), then fuzz.shrink's candidates that keep
    the config, then (`configs`) the config one knob at a time toward the defaults
    (`simpler_configs`; each costs an engine start). A candidate is kept when it fails the
    same way (same property, same signature for crashes). Returns (smallest violation, its
    VLLMOptions, checks run)."""
    from engine.config import ConfigError
    from fuzz.case import CaseFormatError, Workload
    from fuzz.properties import Violation
    from fuzz.shrink import candidates

    best, best_opts, checks = violation, opts, 0

    def fails(case, o=None) -> bool:
        nonlocal best, best_opts, checks
        o = opts if o is None else o
        try:
            case.validate()
        except CaseFormatError:
            return False
        checks += 1
        try:
            checker.check(case, o)
        except Violation as v:
            if same_failure(v, violation):
                best, best_opts = v, o
                return True
        return False

    case = violation.case
    for r in case.workload.requests:
        if time.monotonic() > deadline:
            return best, best_opts, checks
        tiny = replace(case, workload=Workload((replace(r, prompt_token_ids=r.prompt_token_ids[:1], max_tokens=1,
                                                        arrival_step=0),)))
        if tiny != case and fails(tiny):
            case = tiny
            break
    progress = True
    while progress and checks < max_checks and time.monotonic() < deadline:
        progress = False
        for cand in candidates(case):
            if cand is None or cand.config != case.config:
                continue
            if time.monotonic() > deadline or checks >= max_checks:
                break
            if fails(cand):
                case, progress = cand, True
                break
    progress = configs
    while progress and checks < max_checks and time.monotonic() < deadline:
        progress = False
        for cfg, o in simpler_configs(case.config, best_opts):
            if time.monotonic() > deadline or checks >= max_checks:
                break
            try:
                cand = replace(case, config=cfg)
            except ConfigError:
                continue
            if fails(cand, o):
                case, progress = cand, True
                break
    return best, best_opts, checks


# -- campaign ---------------------------------------------------------------------------------

@dataclass
class CellSummary:
    name: str
    examples: int = 0
    seconds: float = 0.0
    starts: int = 0
    startup_s: float = 0.0
    failures: list = field(default_factory=list)
    known: list = field(default_factory=list)
    stopped: str = ""
    repeats: int = 0  # failures of a property this cell had already reported (not re-written)
    max_lp_error: float = 0.0
    divergences: int = 0
    max_lp_error_hf: float = 0.0
    prompt_positions: int = 0  # prompt logprob positions checked against transformers
    unsupported: str = ""
    llm_kwargs: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"examples": self.examples, "seconds": round(self.seconds, 2),
                "examples_per_s": round(self.examples / self.seconds, 3) if self.seconds else None,
                "engine_starts": self.starts, "startup_s": round(self.startup_s, 1),
                "failures": self.failures, "known": self.known, "unsupported": self.unsupported,
                "stopped": self.stopped, "repeats": self.repeats,
                "max_lp_error_vs_reference": self.max_lp_error, "near_tie_divergences": self.divergences,
                "max_lp_error_vs_transformers": self.max_lp_error_hf,
                "prompt_logprob_positions_checked": self.prompt_positions, "llm_kwargs": self.llm_kwargs}


@dataclass
class VLLMSummary:
    cells: list = field(default_factory=list)
    seconds: float = 0.0
    vllm_version: str | None = None
    interrupted: bool = False
    planned: list = field(default_factory=list)  # config names, in visiting order
    budget_s: float = 0.0
    seed: int = 0
    oracles: list = field(default_factory=list)

    @property
    def failures(self) -> list:
        return [f for c in self.cells for f in c.failures]

    def to_json(self) -> dict:
        return {"target": "vllm", "vllm_version": self.vllm_version, "budget_s": self.budget_s, "seed": self.seed,
                "seconds": round(self.seconds, 1), "oracles": self.oracles, "planned_configs": self.planned,
                "examples": sum(c.examples for c in self.cells), "failures": self.failures,
                "known": [k for c in self.cells for k in c.known],
                "unsupported": {c.name: c.unsupported for c in self.cells if c.unsupported},
                "per_cell": {c.name: c.to_json() for c in self.cells}, "interrupted": self.interrupted}

    def table(self) -> str:
        rows = [f"{'cell':<44}{'examples':>9}{'ex/s':>7}{'starts':>7}{'start s':>8}{'fail':>5}{'known':>6}  note"]
        for c in self.cells:
            rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
            rows.append(f"{c.name:<44}{c.examples:>9}{rate:>7}{c.starts:>7}{c.startup_s:>8.1f}"
                        f"{len(c.failures):>5}{len(c.known):>6}  {c.stopped}")
        return "\n".join(rows)


class VLLMCampaign:
    def __init__(self, cells, *, budget_s: float, out_dir: str = "reproducers/vllm", seed: int = 0,
                 known: set[str] | None = None, max_requests: int = 8, chunk: int = 10,
                 shrink_s: float = 300.0, min_cell_s: float = 60.0, progress: bool = True, checker=None,
                 shrink_configs: bool = True) -> None:
        self.cells = list(cells)
        self.shrink_configs = shrink_configs
        self.budget_s, self.out_dir, self.seed = budget_s, out_dir, seed
        self.known = known or set()
        self.max_requests, self.chunk, self.shrink_s, self.min_cell_s = max_requests, chunk, shrink_s, min_cell_s
        self.progress = progress
        self._checker = checker

    def _log(self, msg: str) -> None:
        if self.progress:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    def run(self) -> VLLMSummary:
        from hypothesis import HealthCheck, Phase, given, seed as hseed, settings

        from fuzz.case import Case, RequestSpec, Workload
        from fuzz.properties import Violation
        from fuzz.strategies import workloads
        from fuzz.targets import TargetFailure
        from fuzz.targets.vllm_target import cell_name, llm_kwargs
        from fuzz.targets.vllm_checker import VLLMChecker, violation_for

        checker = self._checker or VLLMChecker()
        target = checker.target
        summary = VLLMSummary(planned=[cell_name(c, o) for c, o in self.cells], budget_s=self.budget_s,
                              seed=self.seed,
                              oracles=["reference", "vllm-solo"] + (["transformers"] if checker.hf is not None else []))
        t_start = time.monotonic()
        end = t_start + self.budget_s
        try:
            for ci, (cfg, opts) in enumerate(self.cells):
                now = time.monotonic()
                if now >= end:
                    break
                name = cell_name(cfg, opts)
                cs = CellSummary(name, llm_kwargs=llm_kwargs(cfg, opts))
                summary.cells.append(cs)
                share = (end - now) / (len(self.cells) - ci)  # of the time left, start-up included
                st0 = target.stats.get(name)
                s0, ss0 = (st0.starts, st0.startup_s) if st0 else (0, 0.0)
                self._log(f"[vllm] cell {name}: starting engine")
                try:
                    target.ensure(cfg, opts)
                except TargetFailure as f:
                    if unsupported(f):
                        cs.unsupported = f"{f.signature}: {f.detail}"[:500]
                        cs.stopped = f"unsupported by vLLM ({f.signature})"
                        self._log(f"[vllm] {name}: vLLM refuses this config: {cs.unsupported[:300]}")
                    else:
                        v = violation_for(f, Case(cfg, Workload((RequestSpec((1,), 1),))))
                        self._on_failure(cs, v, checker, opts, minimize=False)
                        cs.stopped = f"engine did not start ({f.signature})"
                    self._account(cs, target, name, s0, ss0)
                    continue
                found: dict = {}
                t_cell = time.monotonic()
                # at least min(min_cell_s, budget) of examples once the engine is up
                cell_end = max(now + share, t_cell + min(self.min_cell_s, self.budget_s))
                body = self._body(checker, cfg, opts, cs, cell_end, found)
                i = 0
                while time.monotonic() < cell_end and not cs.stopped:
                    strat = workloads(cfg, self.max_requests)
                    test = settings(max_examples=self.chunk, deadline=None, database=None,
                                    phases=(Phase.explicit, Phase.generate),
                                    suppress_health_check=list(HealthCheck))(given(strat)(body))
                    test = hseed(self.seed * 100003 + ci * 1009 + i)(test)
                    i += 1
                    found.clear()
                    try:
                        test()
                    except Violation as v:
                        self._on_failure(cs, v, checker, opts)
                    except BaseExceptionGroup as g:
                        vs, rest = g.split(Violation)
                        if vs is None:
                            raise
                        self._on_failure(cs, found.get("v") or vs.exceptions[0], checker, opts)
                self._log(f"[vllm] cell {name}: {cs.examples} examples in {time.monotonic() - t_cell:.0f}s"
                          + (f" ({cs.stopped})" if cs.stopped else ""))
                self._account(cs, target, name, s0, ss0)
        except KeyboardInterrupt:
            summary.interrupted = True
        finally:
            summary.seconds = time.monotonic() - t_start
            summary.vllm_version = target.vllm_version
            if self._checker is None:
                checker.close()
        return summary

    def _body(self, checker, cfg, opts, cs: CellSummary, cell_end: float, found: dict):
        """The Hypothesis test body for one cell (a closure: @given takes no defaults)."""
        from fuzz.case import Case
        from fuzz.properties import Violation

        def body(wl) -> None:
            if "v" in found:  # Hypothesis replays the failing example: do not rerun it
                raise found["v"]
            if time.monotonic() > cell_end:
                return
            case = Case(cfg, wl)
            t0 = time.perf_counter()
            try:
                verdict = checker.check(case, opts)
                cs.max_lp_error = max(cs.max_lp_error, verdict.vs_reference.max_lp_error)
                cs.divergences += len(verdict.vs_reference.divergences)
                if verdict.vs_transformers is not None:
                    cs.max_lp_error_hf = max(cs.max_lp_error_hf, verdict.vs_transformers.max_lp_error)
                    cs.prompt_positions += verdict.vs_transformers.prompt_positions
            except Violation as v:
                found["v"] = v
                raise
            finally:
                cs.examples += 1
                cs.seconds += time.perf_counter() - t0
            if cs.examples % 25 == 0:
                self._log(f"[vllm] {cs.name}: {cs.examples} examples, {cs.examples / max(cs.seconds, 1e-9):.2f}/s")
        return body

    @staticmethod
    def _account(cs: CellSummary, target, name: str, s0: int, ss0: float) -> None:
        st = target.stats.get(name)
        if st is not None:
            cs.starts, cs.startup_s = st.starts - s0, st.startup_s - ss0

    def _on_failure(self, cs: CellSummary, v, checker, opts, minimize: bool = True) -> None:
        from fuzz.targets.vllm_target import cell_name
        from fuzz.targets.vllm_checker import VLLMCrash

        sig = getattr(v, "signature", None)
        crash = isinstance(v, VLLMCrash)
        if crash and sig in self.known:
            cs.known.append(sig)
            cs.stopped = f"known failure {sig}"
            self._log(f"[vllm] {cs.name}: known failure {sig}; cell stopped")
            return
        if not crash and any(f["property"] == v.property for f in cs.failures):
            cs.repeats += 1
            return
        self._log(f"[vllm] {cs.name}: FOUND {v.property}: {v.message[:300]}\n        case: {v.case.describe()}")
        first = write_vllm_reproducer(self.out_dir, v, opts, checker.target)
        checks, small_opts = 0, opts
        if minimize:
            t0 = time.monotonic()
            v, small_opts, checks = minimize_vllm(v, checker, opts, deadline=t0 + self.shrink_s,
                                                  configs=self.shrink_configs)
            self._log(f"[vllm] {cs.name}: shrunk in {checks} checks, {time.monotonic() - t0:.0f}s: "
                      f"{cell_name(v.case.config, small_opts)}: {v.case.describe()}")
        path = write_vllm_reproducer(self.out_dir, v, small_opts, checker.target)
        if first != path and os.path.exists(first):
            os.unlink(first)
        cs.failures.append({"property": v.property, "message": v.message[:500], "signature": sig,
                            "config": cell_name(v.case.config, small_opts), "case": v.case.describe(),
                            "path": path, "shrink_checks": checks})
        self._log(f"[vllm]   -> {path}\n         replay: llmfuzz replay {path}")
        if crash:
            cs.stopped = f"crashed ({v.property}: {sig})"


# -- replay -----------------------------------------------------------------------------------

def replay(path: str, checker=None):
    """Re-run a reproducer against the installed vLLM: (reproducer, violation or None, vLLM version)."""
    from fuzz.properties import Violation
    from fuzz.reproduce import load_reproducer
    from fuzz.targets.vllm_target import VLLMOptions
    from fuzz.targets.vllm_checker import VLLMChecker

    repro = load_reproducer(path)
    opts = VLLMOptions.from_dict((repro.meta or {}).get("vllm_options"))
    own = checker is None
    checker = checker or VLLMChecker()
    try:
        checker.check(repro.case, opts)
        return repro, None, checker.target.vllm_version
    except Violation as v:
        return repro, v, checker.target.vllm_version
    finally:
        if own:
            checker.close()
