"""transformers continuous batching as a campaign target (`llmfuzz run --target
transformers-cb`): the generic black-box checker (fuzz.targets.blackbox) on a CBRunner, one
cell per planned config (fuzz.targets.transformers_cb.plan), visited in order, one worker
each; Hypothesis draws workloads (`fuzz.cases.strategies.workloads`: chunked prefill, arrivals
while others run, shared prefixes) as Cases with target "transformers-cb" and the config's
options.

Properties, named `transformers_cb_<kind>` (fuzz.targets.blackbox.properties_for): `crash`
(a leak, or returned tokens that are not the sampled ones, are crashes of their own kind
and signature) / `hang`, one reproducer per signature; `greedy`; `vs_reference` (our
engine, tp1pp1 eager fp32, on the same checkpoint); `vs_transformers` (the model's own
forward, teacher-forced on the run's tokens; the library returns no prompt logprobs);
`batch_invariance` (each request alone vs in the batch). A config the library refuses is
unsupported, with its message.
"""
from __future__ import annotations

from dataclasses import replace

from fuzz.cases.case import Workload
from fuzz.targets.base import Cell
from fuzz.targets.blackbox import BlackBoxChecker, properties_for
from fuzz.targets.blackbox_target import BlackBoxTarget, config_cells
from fuzz.targets.transformers_cb.configs import TARGET, CBOptions, cell_name

PROPERTIES = properties_for("transformers_cb")


class CBChecker(BlackBoxChecker):
    """BlackBoxChecker on a CBRunner (made here when not given), under the target's property
    names; `batch_extras`: what the worker measured in the last batch run (its evictions),
    kept before the solo runs replace the runner's `last_run`."""

    def __init__(self, runner=None, **kw) -> None:
        if runner is None:
            from fuzz.targets.transformers_cb.runner import CBRunner

            runner = CBRunner()
        super().__init__(runner, "transformers_cb", label="transformers CB", props=PROPERTIES, **kw)
        self.batch_extras: dict = {}

    def prepare(self, case):
        return super().prepare(case if case.target == TARGET else CBOptions.of(case).on(case))

    def extra_checks(self, case, test) -> None:
        self.batch_extras = dict(getattr(self.runner, "last_run", {}) or {})


class CBTarget(BlackBoxTarget):
    """`configs`: the (EngineConfig, CBOptions) to visit; `checker`: a CBChecker (default:
    one of this target's, closed with it)."""

    sequential = True
    hypothesis_shrinks = False  # a crash costs a worker restart per shrink step: the minimizer shrinks instead
    confirm_before_shrink = True
    max_shrink_checks = 40
    unit = "configs"
    chunk = 10
    min_cell_s = 10.0

    def __init__(self, configs, *, checker: CBChecker | None = None, max_requests: int = 8) -> None:
        super().__init__(checker or CBChecker(), max_requests=max_requests, own=checker is None)
        self.name, self.configs = TARGET, list(configs)

    @property
    def runner(self):
        return self.checker.runner

    def cells(self) -> list[Cell]:
        return config_cells(self.configs, cell_name, self.max_requests)

    def start(self, cell: Cell) -> None:
        """Unsupported (the library's message) for a config it refuses."""
        from fuzz.targets.runs import TargetFailure

        try:
            self.runner.check_supported(cell.data)
        except TargetFailure as f:
            raise PROPERTIES.failure(f, cell.data) from None

    def fresh_check(self, case, history=()):
        """`history` then `case` on a brand-new engine: the worker is shut down, and the next
        run starts another process (CBRunner.ensure)."""
        from fuzz.targets.fresh import RESTARTED, run_sequence

        self.fresh = RESTARTED
        self.runner.shutdown()
        return run_sequence(self.check, history, case)

    def simpler(self, case):
        """One request at a time cut to one token, then the reference engine's candidates on
        the same config (a config change is a worker restart)."""
        from fuzz.targets.simpler import candidates

        for r in case.workload.requests:
            yield replace(case, workload=Workload((replace(r, prompt_token_ids=r.prompt_token_ids[:1], max_tokens=1,
                                                           arrival_step=0),)))
        yield from (c for c in candidates(case) if c is not None and c.config == case.config)

    def reproducer_meta(self, case, violation) -> dict:
        meta = {"target": TARGET, "transformers_version": self.runner.version,
                "transformers_cb_options": CBOptions.of(case).to_dict()}
        if getattr(violation, "signature", None):
            meta["signature"] = violation.signature
        return meta

    def stats_key(self, case) -> tuple:
        return cell_name(case.config, CBOptions.of(case)), ""

    def triage(self, violation, earlier: list) -> str:
        """One reproducer per crash signature; another property is written once per cell."""
        if getattr(violation, "signature", None) is None and any(f.property == violation.property for f in earlier):
            return "repeat"
        return super().triage(violation, earlier)

    def ends_cell(self, violation) -> bool:
        return isinstance(violation, PROPERTIES.crash)

    def record(self, stats, verdict) -> None:
        super().record(stats, verdict)
        n = stats.notes
        n["max_error_over_tolerance"] = max(n.get("max_error_over_tolerance", 0.0), verdict.logits.ratio)
        for key, rep in (("transformers", verdict.vs_transformers), ("batch", verdict.batch)):
            if rep is not None:
                k = f"max_lp_error_vs_{key}"
                n[k] = max(n.get(k, 0.0), rep.max_lp_error)
                n[f"max_ratio_vs_{key}"] = max(n.get(f"max_ratio_vs_{key}", 0.0), rep.max_lp_error / verdict.lp_tol)
        n["batches"] = n.get("batches", 0) + verdict.num_steps
        offloads = self.checker.batch_extras.get("offloads", 0)  # the batch run this verdict checked
        n["cases_with_eviction"] = n.get("cases_with_eviction", 0) + (offloads > 0)
        n["evictions"] = n.get("evictions", 0) + offloads

    def cell_done(self, cell: Cell, stats) -> None:
        starts = [s for s in self.runner.starts if s["cell"] == cell.name]
        stats.notes["worker_starts"] = len(starts)
        stats.notes["startup_s"] = round(sum(s["seconds"] for s in starts), 1)

    def describe(self) -> str:
        return f"transformers continuous batching, {len(self.configs)} config(s)"

    def summary_json(self, summary) -> dict:
        """The campaign's summary with, per config, what this target measured (max error over
        tolerance, worker starts) and why it stopped (a refused config: the library's message)."""
        per = {name: {"examples": c.examples, "failures": c.failures,
                      "examples_per_s": round(c.examples / c.seconds, 2) if c.seconds else None,
                      "unsupported": c.unsupported or None, "stopped": c.stopped or None, **c.notes}
               for (name, _), c in summary.cells.items()}
        return {"target": TARGET, "examples": summary.examples, "failures": len(summary.failures),
                "seconds": round(summary.seconds, 2), "per_config": per,
                "failure_details": [{k: v for k, v in f.__dict__.items() if k != "cell"} for f in summary.failures],
                "reproducers": [f.path for f in summary.failures], "interrupted": summary.interrupted,
                "write_errors": summary.write_errors, "duplicates_skipped": summary.duplicates}

    def summary_table(self, summary) -> str:
        """Per config: examples, examples/s, failures, max error/tolerance vs the reference,
        and why it stopped (the library's message for a refused config)."""
        rows = [f"{'config':<52}{'examples':>9}{'ex/s':>7}{'failures':>9}{'err/tol':>9}  stopped"]
        for (name, _), c in summary.cells.items():
            rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
            ratio = c.notes.get("max_error_over_tolerance")
            rows.append(f"{name:<52}{c.examples:>9}{rate:>7}{c.failures:>9}"
                        f"{'-' if ratio is None else f'{ratio:.3g}':>9}  {c.stopped[:120]}")
        rows.append(f"{'total':<52}{summary.examples:>9}{summary.examples / max(summary.seconds, 1e-9):>7.2f}"
                    f"{len(summary.failures):>9}")
        return "\n".join(rows)
