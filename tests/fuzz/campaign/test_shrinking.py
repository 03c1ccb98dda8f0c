"""Acceptance: a planted bug is found by Hypothesis and shrunk to its minimal Case.

The bug is planted from the test, not through the fault registry: `GPUModelRunner.execute`
is wrapped so that, with pp >= 2, a microbatch holding a request whose prompt crosses a KV
block boundary (prompt length > block_size) gets one logits row nudged by +1.0. The
in-process world runs ranks as threads of this process, so patching the class reaches
every rank. The minimal failing Case is then known exactly: one request of block_size + 1
prompt tokens on tp1pp2 (the simplest layout with pp >= 2), default schedule, no sequence
parallelism, no PP output broadcast.
"""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, find, settings

from engine.model_runner import GPUModelRunner
from engine.schedule import Schedule
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import LogitsMismatch, Violation
from fuzz.targets.simpler import candidates
from fuzz.campaign.shrink import minimize
from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, cases

BLOCK = FUZZ_MODEL.block_size


@pytest.fixture
def planted_bug(monkeypatch):
    """Corrupt one logits row when pp >= 2 and the batch holds a block-crossing prompt."""
    orig_prepare, orig_execute, orig_reset = GPUModelRunner.prepare, GPUModelRunner.execute, GPUModelRunner.reset

    def reset(self, *args, **kwargs):  # whatever the runner's reset takes (its poison mode)
        self._planted_prompt_len = {}
        self._planted_crossing = {}
        return orig_reset(self, *args, **kwargs)

    def prepare(self, so):
        lens = self.__dict__.setdefault("_planted_prompt_len", {})
        for nr in so.scheduled_new_reqs:
            # The first time a request is seen its token ids are its prompt (a preempted
            # request comes back with its outputs appended: keep the first length).
            lens.setdefault(nr.req_id, len(nr.token_ids))
        crossing = any(lens.get(rid, 0) > self.cfg.block_size for rid in so.num_scheduled_tokens)
        self.__dict__.setdefault("_planted_crossing", {})[so.microbatch] = crossing
        return orig_prepare(self, so)

    def execute(self, pb):
        out = orig_execute(self, pb)
        crossing = self.__dict__.get("_planted_crossing", {}).pop(pb.microbatch, False)
        if out is not None and self.cfg.pp >= 2 and crossing and len(out.req_ids):
            out.logits[0] += 1.0  # deterministic: always the first sampled row
        return out

    monkeypatch.setattr(GPUModelRunner, "reset", reset)
    monkeypatch.setattr(GPUModelRunner, "prepare", prepare)
    monkeypatch.setattr(GPUModelRunner, "execute", execute)


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _fails(h: Harness, case: Case) -> bool:
    try:
        h.check(case)
    except LogitsMismatch:
        return True
    return False


def _assert_minimal(case: Case) -> None:
    assert len(case.workload.requests) == 1, case.describe()
    (req,) = case.workload.requests
    assert len(req.prompt_token_ids) == BLOCK + 1, case.describe()
    assert case.layout == "tp1pp2", case.describe()
    assert case.schedule.is_default, case.describe()
    assert not case.config.sequence_parallel and not case.config.broadcast_pp_output, case.describe()
    assert case.config.speculative_method == "none" and case.mode == "eager", case.describe()
    assert case.faults == ()


def test_planted_bug_is_planted(planted_bug, harness) -> None:
    """The plant fires exactly where it should (and the engine is otherwise correct)."""
    def one(layout: str, n: int) -> Case:
        return Case(FUZZ_MODEL.replace(layout=layout), Workload((RequestSpec(tuple(range(1, n + 1)), 1),)))

    assert _fails(harness, one("tp1pp2", BLOCK + 1))
    assert not _fails(harness, one("tp1pp2", BLOCK))
    assert not _fails(harness, one("tp1pp1", BLOCK + 1))
    assert not _fails(harness, one("tp2pp1", 3 * BLOCK))


def test_hypothesis_shrinks_planted_bug_to_minimal_case(planted_bug, harness) -> None:
    # The budget is CPU time of this process (all rank threads): wall time on a shared
    # 2-core machine says more about the neighbours than about this test (about 20 s idle).
    t0 = time.process_time()
    found = find(
        cases(layouts=DEFAULT_LAYOUTS, max_requests=6),
        lambda c: _fails(harness, c),
        settings=settings(max_examples=300, database=None, derandomize=True, deadline=None,
                          suppress_health_check=list(HealthCheck)))
    # What Hypothesis alone reaches: the simplest layout with pp >= 2, default schedule, no
    # SP, no broadcast, the budget and KV pool at their defaults, one-token outputs. Measured with Hypothesis 6.155 and derandomize=True, its shrinker stops at three
    # requests, prompt lens [1, 1, 5] (since plain decoding is drawn two times in five; before,
    # at [1, 8] with n-gram drafting on). With drafting on, the request that crosses the block is a
    # self-drafting one (fuzz.cases.drafting: a stored 8-token prompt, joining n-gram Cases
    # only), so switching drafting off drops it, and Hypothesis would have to lengthen a drawn
    # prompt in the same step; nor does it delete a leading trivial request (a whole list
    # element). So the rest is asserted on fuzz.campaign.shrink.minimize's result below, which
    # the campaign applies after Hypothesis too (`_assert_minimal`: one request of block_size
    # + 1 tokens, no speculation).
    assert found.layout == "tp1pp2" and found.schedule.is_default, found.describe()
    assert not found.config.sequence_parallel and not found.config.broadcast_pp_output
    assert found.config.max_num_batched_tokens == FUZZ_MODEL.max_num_batched_tokens
    assert found.config.num_gpu_blocks == FUZZ_MODEL.num_gpu_blocks
    assert all(r.max_tokens == 1 for r in found.workload.requests), found.workload  # (a self-drafting one arrives at step 1)
    assert len(found.workload.requests) <= 3, found.describe()

    small, _ = minimize(found, lambda c: _fails(harness, c))
    _assert_minimal(small)
    assert small.workload.requests[0].max_tokens == 1
    # A bound against a runaway search, not a speed target (idle: about 30 s of CPU time with
    # the prefix-caching, sampling and abort dimensions drawn).
    assert time.process_time() - t0 < 120


def test_minimize_reaches_minimal_case_from_a_big_failure(planted_bug, harness) -> None:
    """The Case-level minimizer (for reproducers from elsewhere) reaches the same minimum."""
    big = Case(FUZZ_MODEL.replace(layout="tp2pp2", sequence_parallel=True, broadcast_pp_output=True,
                                  max_num_batched_tokens=9, num_gpu_blocks=24),
               Workload(tuple(RequestSpec(tuple(range(1, n + 1)), 2, arrival_step=a)
                              for n, a in ((3, 0), (10, 0), (2, 1)))),
               Schedule(seed=5, rank_order="random", copy_delay=0.5, prepare_ahead=0.5))
    assert _fails(harness, big)
    small, checks = minimize(big, lambda c: _fails(harness, c))
    _assert_minimal(small)
    assert small.config.max_num_batched_tokens == 64 and small.config.num_gpu_blocks == 96
    assert small.workload.requests[0].max_tokens == 1
    assert checks < 400


# -- fuzz.campaign.shrink.minimize with a cheap predicate (no engine) ------------------------------------

def _case(*prompt_lens: int, layout: str = "tp2pp4", **cfg) -> Case:
    reqs = tuple(RequestSpec(tuple(range(1, n + 1)), 2, arrival_step=i) for i, n in enumerate(prompt_lens))
    return Case(FUZZ_MODEL.replace(layout=layout, **cfg), Workload(reqs),
                Schedule(seed=9, rank_order="random", copy_delay=0.9, prepare_ahead=1.0))


def test_minimize_drops_requests_and_shortens_prompts() -> None:
    # "Fails" whenever some prompt is at least 10 tokens long.
    def pred(c: Case) -> bool:
        return any(len(r.prompt_token_ids) >= 10 for r in c.workload.requests)

    start = _case(3, 25, 7, 12, sequence_parallel=True, max_num_batched_tokens=9)
    small, checks = minimize(start, pred)
    assert pred(small)
    assert len(small.workload.requests) == 1
    (r,) = small.workload.requests
    assert len(r.prompt_token_ids) == 10
    assert r.max_tokens == 1 and r.arrival_step == 0 and set(r.prompt_token_ids) == {0}
    assert small.layout == "tp1pp1" and small.schedule == Schedule()
    assert not small.config.sequence_parallel and small.config.max_num_batched_tokens == 64
    assert 0 < checks < 400


def test_minimize_keeps_what_the_failure_needs() -> None:
    # "Fails" only with pp >= 2 and two requests of which one crosses a block.
    def pred(c: Case) -> bool:
        lens = [len(r.prompt_token_ids) for r in c.workload.requests]
        return c.config.pp >= 2 and len(lens) >= 2 and max(lens) > BLOCK

    small, _ = minimize(_case(3, 25, 7, 12), pred)
    assert small.config.pp == 2 and small.config.tp == 1
    assert sorted(len(r.prompt_token_ids) for r in small.workload.requests) == [1, BLOCK + 1]


def test_minimize_respects_check_budget_and_predicate_never_true() -> None:
    calls = []

    def pred(c: Case) -> bool:
        calls.append(c)
        return False

    start = _case(3, 25)
    small, checks = minimize(start, pred, max_checks=5)
    assert small == start and checks == 5 == len(calls)


def test_minimal_case_passes_without_the_plant(harness) -> None:
    """Without the plant the engine is correct on the minimal Case (guards the plant's
    meaning: it, not the engine, is what the search finds)."""
    case = Case(FUZZ_MODEL.replace(layout="tp1pp2"), Workload((RequestSpec(tuple(range(1, BLOCK + 2)), 1),)))
    try:
        harness.check(case)
    except Violation as v:  # pragma: no cover - a real engine bug
        pytest.fail(f"engine fails the minimal case without the plant: {v}")


# -- the shrink phase: what the campaign's budget cut short is finished after it ----------------

def test_failure_found_late_ends_minimal_within_the_shrink_budget(tmp_path, monkeypatch) -> None:
    """A registry fault (pp_uneven_partition: shows on any uneven pp split), found on the first
    example of a tp2pp3-only campaign whose budget leaves it no time to minimize (shrink_s=0:
    nothing is minimized during the campaign, as when the budget ends right after the
    finding). The shrink phase after the budget takes it to the minimal Case (tp1pp3, one
    request of one token), records `minimal: true` in the reproducer and the summary,
    replaces the unshrunk file, and stays within its budget. On a clock each check moves 0.5 s:
    the phase's 120 s are 240 checks, however loaded the machine."""
    from fuzz_testutil import FakeClock, campaigns_on

    campaigns_on(monkeypatch, FakeClock(), check_s=0.5)
    from fuzz.campaign.loop import Campaign
    from fuzz.campaign.reproduce import load_reproducer

    out = tmp_path / "out"
    camp = Campaign(layouts=("tp2pp3",), modes=("eager",), faults=("pp_uneven_partition",), budget_s=2,
                    shrink_s=0, shrink_budget_s=120, out_dir=str(out), stop_on_failure=True, progress=False)
    s = camp.run()
    assert len(s.failures) == 1 and not s.interrupted
    f = s.failures[0]
    # It left the campaign unshrunk (tp2pp3) and came out of the shrink phase minimal.
    assert camp.shrink_report["failures"] == 1 and camp.shrink_report["minimal"] == 1, camp.shrink_report
    assert camp.shrink_report["seconds"] <= 120
    assert f.minimal is True and f.size == {"requests": 1, "tokens": 1, "layout": "tp1pp3", "mode": "eager"}
    assert f.seconds_to_find is not None and f.examples_before == 0
    files = list(out.rglob("*.json"))
    assert [str(p) for p in files] == [f.path]  # the unshrunk version was replaced, not kept
    repro = load_reproducer(f.path)
    assert repro.meta["minimal"] is True and repro.case.layout == "tp1pp3"
    assert repro.meta["seconds_to_find"] == f.seconds_to_find and repro.meta["examples_before"] == 0


def test_stop_during_the_shrink_phase_keeps_the_smallest_so_far(tmp_path) -> None:
    """Ctrl-C (the stop flag, as the signal handler sets it) in the middle of the shrink
    phase: the campaign reports itself interrupted, and the reproducer on disk is the
    smallest failing Case seen before the stop, marked not minimal."""
    from fuzz.campaign.loop import Campaign
    from fuzz.stop import request_stop
    from fuzz.verdict.harness import Harness
    from fuzz.campaign.reproduce import load_reproducer

    class StopAtTp1(Harness):
        """Stops the run (as the signal handler does) once the minimizer tries tp1pp1."""

        def check(self, case):
            if case.layout == "tp1pp1" and case.faults:
                request_stop()
            return super().check(case)

    h = StopAtTp1()
    out = tmp_path / "out"
    try:
        camp = Campaign(layouts=("tp2pp3",), modes=("eager",), faults=("pp_uneven_partition",), budget_s=2,
                        shrink_s=0, shrink_budget_s=120, out_dir=str(out), stop_on_failure=True, progress=False,
                        harness=h)
        s = camp.run()
    finally:
        h.close()
    assert s.interrupted and camp.shrink_report["interrupted"] and len(s.failures) == 1
    files = list(out.rglob("*.json"))
    assert [str(p) for p in files] == [s.failures[0].path]
    repro = load_reproducer(s.failures[0].path)
    assert repro.meta["minimal"] is False and s.failures[0].minimal is False
    assert repro.case.layout == "tp2pp3"  # tp1pp1 is the minimizer's first candidate: nothing smaller yet


def test_shrink_phase_takes_the_fastest_found_first_and_reports_minimal() -> None:
    """fuzz.campaign.shrink_phase.ShrinkPhase on a cheap target (no engine): failures are taken in the
    order they were found fastest, each result is handed to the writer with `minimal`, and a
    failure that does not happen again is left as it was (not minimal, not retried)."""
    from fuzz.verdict.properties import LogitsMismatch
    from fuzz.campaign.shrink_phase import Pending, ShrinkPhase
    from fuzz.campaign.summary import Failure

    class Cheap:
        confirm_before_shrink, order = True, []

        def check(self, case):
            self.order.append(case.config.seed)
            if case.config.seed != 3 and any(len(r.prompt_token_ids) >= 10 for r in case.workload.requests):
                raise LogitsMismatch("long prompt", case, 2.0, "reference")

        def simpler(self, case):
            return candidates(case)

    def pending(seed: int, found_s: float) -> Pending:
        case = _case(3, 25, 7, 12, seed=seed)
        return Pending(Failure("logits", "long prompt", case.describe(), None, 2.0, "reference",
                               seconds_to_find=found_s), LogitsMismatch("long prompt", case, 2.0, "reference"), False)

    target, written = Cheap(), {}
    todo = [pending(1, 30.0), pending(2, 5.0), pending(3, 10.0)]  # seed 3: does not fail again

    def rewrite(p, r, seconds):
        written[p.failure.seconds_to_find] = r

    phase = ShrinkPhase(target, 60.0, rewrite)
    assert phase.run(todo) is False
    firsts = [s for i, s in enumerate(target.order) if s not in target.order[:i]]
    assert firsts == [2, 3, 1]  # found after 5 s, 10 s, 30 s
    assert written[5.0].minimal and written[30.0].minimal
    (small,) = written[5.0].violation.case.workload.requests
    assert len(small.prompt_token_ids) == 10
    assert not written[10.0].minimal and not written[10.0].reproducible and target.order.count(3) == 1
    assert phase.report(todo)["failures"] == 3 and phase.seconds < 60
