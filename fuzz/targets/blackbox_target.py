"""Any black-box engine as a campaign target (fuzz.targets.base.Target): a runner of the
protocol in fuzz.targets.blackbox, checked by `BlackBoxChecker`, fuzzed by the normal campaign
(`fuzz.campaign.loop.Campaign(target=BlackBoxTarget(...))`).

- cells: one per layout, as our engine's (`blackbox_cases`: config and workload drawn by
  fuzz.cases.strategies, with sampling params where the runner takes them; no faults, aborts or
  harness schedules, which only our white-box harness can drive);
- check: the checker's verdict; simpler: fuzz.targets.simpler's candidates;
- a crash writes one reproducer per signature (found again in another cell: counted);
- reproducers name the target (`blackbox_target`): `llmfuzz.replay(path, target=...)` runs
  them again on it;
- state: the runner's `keeps_state` (absent: True); a failure is replayed on a brand-new
  instance of the runner in a new process (`fresh_check`, fuzz.targets.fresh), or in this one
  where its class cannot be imported from another (recorded as `in-process`).
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, aborts, engine_configs, workloads
from fuzz.targets.base import Cell, Target


@st.composite
def blackbox_cases(draw, layouts=DEFAULT_LAYOUTS, modes=("eager",), base=FUZZ_MODEL, max_requests: int = 8,
                   sampling: bool = False) -> Case:
    """Cases a black box can run: our engine's configs and workloads (fuzz.cases.strategies), with
    sampling params when `sampling`; shrinks as they do."""
    cfg = draw(engine_configs(tuple(layouts), tuple(modes), base))
    return Case(cfg, draw(workloads(cfg, max_requests, sampling=sampling)))


def _on(template: Case):
    """Workload -> the template Case with it (a function per cell: Hypothesis maps draws with it)."""
    return lambda wl: replace(template, workload=wl)


def config_cells(configs, name, max_requests: int = 8, sampling: bool = False, adapt=None,
                 with_aborts: bool = False) -> list[Cell]:
    """One cell per planned config (`configs`: (EngineConfig, options) pairs, the options'
    `on(case)` making the Case the target's; `name(cfg, opts)`: the cell's name): Hypothesis
    draws workloads on that config (fuzz.cases.strategies.workloads, with sampling params when
    `sampling`, an abort when `with_aborts` (fuzz.cases.strategies.aborts), then through
    `adapt(cfg, workload)` if given: what the target cannot take, taken out); `data` is the template Case (the config and options the engine starts with)."""
    out = []
    for cfg, opts in configs:
        template = opts.on(Case(cfg, Workload((RequestSpec((1,), 1),))))
        # Drawn for the config as the target runs it: prompts share prefixes mostly where it caches them.
        dcfg = opts.drawn_config(cfg)
        drawn = workloads(dcfg, max_requests, sampling=sampling)
        if with_aborts:  # one request aborted a few driver steps after it arrives, in some Cases
            drawn = drawn.flatmap(lambda wl, cfg=dcfg: aborts(cfg, wl))
        if adapt is not None:
            drawn = drawn.map(lambda wl, cfg=cfg: adapt(cfg, wl))
        out.append(Cell(name(cfg, opts), drawn.map(_on(template)), template))
    return out


class BlackBoxTarget(Target):
    """`checker`: a fuzz.targets.blackbox.BlackBoxChecker, or a runner of the protocol (an
    llmfuzz.Target) to make one for, named by its `name`; closed with this target when `own`.
    `sampling` (default: what the runner supports): requests may have sampling params."""

    unit = "layouts"

    def __init__(self, checker, layouts=("tp1pp1",), modes=("eager",), base=FUZZ_MODEL, max_requests: int = 8,
                 sampling: bool | None = None, own: bool = True) -> None:
        from fuzz.targets.blackbox import BlackBoxChecker

        if not isinstance(checker, BlackBoxChecker):
            checker = BlackBoxChecker(checker, getattr(checker, "name", "target"))
        self.checker, self.name, self.own = checker, checker.name, own
        self.layouts, self.modes, self.base, self.max_requests = tuple(layouts), tuple(modes), base, max_requests
        self.sampling = getattr(checker.runner, "supports_sampling", False) if sampling is None else sampling
        self.written: dict[str, str] = {}  # crash signature -> the cell that first reported it

    def cells(self) -> list[Cell]:
        return [Cell(f"{self.name}:{lay}", blackbox_cases((lay,), self.modes, self.base, self.max_requests,
                                                          self.sampling), lay) for lay in self.layouts]

    def check(self, case):
        return self.checker.check(case)

    @property
    def keeps_state(self) -> bool:
        return bool(getattr(self.checker.runner, "keeps_state", True))

    def fresh_check(self, case, history=()):
        """`history` then `case` on a new instance of the runner: in a new process where its
        class is importable by name and the checker is the generic one, else in this process."""
        from fuzz.targets.fresh import IN_PROCESS, PROCESS, checker_options, importable_ref, run_in_child, \
            run_in_process
        from fuzz.targets.blackbox import BlackBoxChecker

        runner = self.checker.runner
        ref = importable_ref(runner)
        if ref is not None and type(self.checker) is BlackBoxChecker:
            self.fresh = PROCESS
            init = runner.fresh_init() if callable(getattr(runner, "fresh_init", None)) else {}
            return run_in_child(ref, checker_options(self.checker), history, case, init)
        self.fresh = IN_PROCESS
        return run_in_process(runner, self.checker, history, case)

    def reproducer_meta(self, case, violation) -> dict:
        from fuzz.targets.fresh import importable_ref

        meta = {"blackbox_target": self.name}
        ref = importable_ref(self.checker.runner)
        if ref is not None:  # what a replay in Python makes its target from
            meta["adapter"] = ref
        if getattr(violation, "signature", None):
            meta["signature"] = violation.signature
        return meta

    def triage(self, violation, earlier: list) -> str:
        sig = getattr(violation, "signature", None)
        if sig is None or violation.case is None:
            return "new"
        here = self.stats_key(violation.case)[0]  # the cell's row: a layout, or a target's config
        return "new" if self.written.setdefault(sig, here) == here else "known"

    def record(self, stats, verdict) -> None:
        n = stats.notes
        n["max_lp_error_vs_reference"] = max(n.get("max_lp_error_vs_reference", 0.0), verdict.vs_reference.max_lp_error)

    def describe(self) -> str:
        return f"{self.name}, {len(self.layouts)} layout(s), modes {','.join(self.modes)}"

    def close(self) -> None:
        if self.own:
            self.checker.close()
