"""Our reference engine as a target, two ways.

`HarnessTarget`: the white-box Harness (fuzz.verdict.harness) that a campaign fuzzes; it sees
FA call records, faults and the Schedule. `ReferenceRunner`: the same engine as a black box
(tp1pp1, eager, fp32, no faults) returning a TargetRun, the oracle a real engine's outputs are
compared against.
"""
from __future__ import annotations

from fuzz.cases.case import Case
from fuzz.cases.limits import limits_reached, mix_counts
from fuzz.targets.base import Cell, Target
from fuzz.targets.runs import RequestResult, TargetRun


def tally(case: Case, num_preemptions: int = 0) -> dict[str, int]:
    """One Case's counts for its row's notes: itself, its requests' sampling mix, whether it
    aborts a request or was preempted, and "limit: <name>" per limit it reaches."""
    mix = mix_counts(case.workload.requests)
    out = {"cases": 1, "cases_with_abort": int(mix.pop("requests_aborted") > 0),
           "cases_preempted": int(num_preemptions > 0), **mix}
    out.update({f"limit: {name}": 1 for name in limits_reached(case.config, case.workload.requests)})
    return out


class HarnessTarget(Target):
    """Our engine through the white-box Harness (fuzz.verdict.harness), which it leaves as it is."""

    def __init__(self, harness, layouts=(), modes=("eager",), faults=(), base=None, max_requests: int = 10) -> None:
        self.harness = harness
        self.layouts, self.modes, self.faults = tuple(layouts), tuple(modes), tuple(faults)
        self.base, self.max_requests = base, max_requests

    def cells(self) -> list[Cell]:
        from fuzz.cases.strategies import cases

        # The database key is the (layout, modes, faults) cell's repr: the nightly example
        # database holds its saved failures under it, so it must not change.
        return [Cell(repr((lay, self.modes, self.faults)),
                     cases((lay,), self.modes, self.faults, self.base, self.max_requests), lay)
                for lay in self.layouts]

    def check(self, case):
        return self.harness.check(case)

    def record(self, stats, verdict) -> None:
        """What a row's Cases reached (numbers only: --jobs adds them up; the summary turns them
        into shares, fuzz.campaign.summary.reach_row): prefix caching (Cases run with it, and
        prompt tokens looked up and found cached), async scheduling (Cases run with it, their
        steps run ahead of all steps), the sampling mix of their requests, aborts, preemptions
        and the config limits each reached (fuzz.cases.limits)."""
        n = stats.notes
        case = getattr(verdict, "case", None)  # None: a verdict without one (test doubles)
        if case is not None:
            for key, v in tally(case, getattr(verdict, "num_preemptions", 0)).items():
                n[key] = n.get(key, 0) + v
        queried = getattr(verdict, "prefix_queried_tokens", 0)  # 0: caching off (or a verdict without it)
        if queried:
            n["prefix_caching_cases"] = n.get("prefix_caching_cases", 0) + 1
            n["prefix_queried_tokens"] = n.get("prefix_queried_tokens", 0) + queried
            n["prefix_hit_tokens"] = n.get("prefix_hit_tokens", 0) + verdict.prefix_hit_tokens
        if case is not None and case.config.async_scheduling:  # async overlap: steps run ahead, of all steps
            n["async_cases"] = n.get("async_cases", 0) + 1
            n["async_steps"] = n.get("async_steps", 0) + getattr(verdict, "async_steps", 0)
            n["async_all_steps"] = n.get("async_all_steps", 0) + getattr(verdict, "num_steps", 0)

    def describe(self) -> str:
        return f"{len(self.layouts)} layout(s), modes {','.join(self.modes)}"

    def close(self) -> None:
        self.harness.close()


class ReferenceRunner:
    """Our reference engine (tp1pp1, eager, fp32, no faults), through the harness's cached
    reference runs; per position the top-k of the log-softmax of the logits row (fp64)."""

    def __init__(self, top_k: int = 20, harness=None) -> None:
        from fuzz.verdict.harness import Harness

        self.top_k = top_k
        self.harness = harness or Harness()
        self._own = harness is None

    def run(self, case: Case, forced: dict[str, list[int]] | None = None) -> TargetRun:
        """`forced`: requests teacher-forced on these tokens (their logprobs at a target's
        own sampled tokens); the others as the reference generates them."""
        import time

        import torch

        t0 = time.perf_counter()
        trace = self.trace(case, forced)
        out: dict[str, RequestResult] = {}
        for rid, recs in trace.tokens.items():
            toks, pos = [], []
            for rec in recs:
                lp = torch.log_softmax(rec.logits.double(), -1)
                vals, idx = lp.topk(min(self.top_k, lp.numel()))
                top = dict(zip(idx.tolist(), vals.tolist()))
                top.setdefault(rec.token, float(lp[rec.token]))
                toks.append(rec.token)
                pos.append(tuple(sorted(top.items(), key=lambda p: -p[1])))
            out[rid] = RequestResult(tuple(toks), tuple(pos))
        return TargetRun(out, time.perf_counter() - t0, trace.num_steps)

    def trace(self, case: Case, forced: dict[str, list[int]] | None = None):
        """The reference run's engine Trace (raw logits rows, for the sampling oracle)."""
        return self.harness.reference(case, forced)

    def logit_absmax(self, case: Case) -> float:
        trace = self.harness.reference(case)
        return max((float(r.logits.abs().max()) for recs in trace.tokens.values() for r in recs), default=1.0)

    def half_noise(self, case: Case) -> float:
        """Low-precision noise of `case` in logprobs (fuzz.verdict.tolerance.BLACKBOX_HALF_RULES):
        our engine solo in the Case's dtype against float32, teacher-forced on the reference's
        tokens."""
        from fuzz.cases.case import reference_config
        from fuzz.verdict.tolerance import Tolerance

        forced = self.harness.reference(case).output_token_ids()
        solo = self.harness.solo
        return Tolerance.measure_logprobs(solo.trace(case.config, case.workload, forced),
                                          solo.trace(reference_config(case.config), case.workload, forced))

    def close(self) -> None:
        if self._own:
            self.harness.close()
