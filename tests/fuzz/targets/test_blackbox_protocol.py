"""The black-box runner protocol (fuzz.targets.blackbox): the reference engine's adapter
(docs/targets.md), the vLLM runner (through its fake worker here, through vLLM itself where
it is installed) and the transformers continuous-batching runner (a real worker, where
transformers is installed) pass the same protocol tests; a runner that breaks the protocol is
named; the generic checker names a target's properties after it; the generic campaign target
fuzzes an adapter with the normal campaign."""
from __future__ import annotations

import inspect
import json

import pytest

pytest.importorskip("torch")

import llmfuzz  # noqa: E402
from fuzz.cases.case import Case, RequestSpec, Workload  # noqa: E402
from fuzz.cases.strategies import FUZZ_MODEL  # noqa: E402
from fuzz.targets.blackbox import BlackBoxChecker, properties_for  # noqa: E402
from fuzz.targets.protocol import ProtocolError, check_protocol, check_structure  # noqa: E402
from fuzz.targets.runs import RequestResult, TargetRun  # noqa: E402

from .test_targets_doc import doc_example  # noqa: E402

CASE = Case(FUZZ_MODEL, Workload((RequestSpec((1, 2, 3, 4, 5), 3), RequestSpec((7, 8), 2))))


def _vllm_case():
    from fuzz.targets.vllm.checker import vllm_case

    return vllm_case([([1, 2, 3, 4, 5], 3), ([7, 8], 2)])


def _cb_case():
    from fuzz.targets.transformers_cb.configs import CB_MODEL, CBOptions

    return CBOptions().on(Case(CB_MODEL.replace(max_num_batched_tokens=16), Workload((
        RequestSpec(tuple(range(1, 21)), 3), RequestSpec((7, 8), 2, arrival_step=1)))))


@pytest.fixture
def runner(request, tmp_path):
    """(runner, a Case for it): the docs' adapter of our engine, vLLM's runner on its fake
    worker, or on vLLM itself (skipped where vLLM is not installed), or the transformers
    continuous-batching runner (skipped where transformers is not installed)."""
    kind = request.param
    if kind == "reference":
        r = doc_example().ReferenceEngineTarget()
        case = CASE
    elif kind == "transformers-cb":
        pytest.importorskip("transformers")
        from fuzz.targets.transformers_cb.runner import CBRunner

        r, case = CBRunner(log_dir=str(tmp_path / "logs")), _cb_case()
    elif kind == "vllm-fake":
        r, case = request.getfixturevalue("fake")("ok", spare=False), _vllm_case()
    else:
        from fuzz.targets.runs import TargetUnavailable
        from fuzz.targets.vllm.runner import VLLMRunner

        try:
            r = VLLMRunner(spare=False, log_dir=str(tmp_path / "logs"))
        except TargetUnavailable as e:
            pytest.skip(str(e))
        case = _vllm_case()
    yield r, case
    r.close()


RUNNERS = ["reference", "vllm-fake", pytest.param("vllm", marks=pytest.mark.vllm),
           pytest.param("transformers-cb", marks=pytest.mark.slow)]


@pytest.mark.parametrize("runner", RUNNERS, indirect=True)
def test_the_runner_keeps_the_protocol(runner) -> None:
    r, case = runner
    check_protocol(r, case)
    assert r.engine_key(case) == r.engine_key(case)


def test_the_vllm_runner_has_the_protocol_s_shape_without_vllm() -> None:
    """Structural: the methods and their parameters, with nothing started."""
    from fuzz.targets.vllm.runner import VLLMRunner

    check_structure(VLLMRunner)
    assert list(inspect.signature(VLLMRunner.run).parameters)[:4] == ["self", "case", "items", "prompt_logprobs"]
    assert list(inspect.signature(VLLMRunner.engine_key).parameters) == ["self", "case"]
    assert VLLMRunner.supports_sampling is True and VLLMRunner.supports_prompt_logprobs is True


def test_the_transformers_cb_runner_has_the_protocol_s_shape_without_a_worker() -> None:
    """Structural, with nothing started: greedy only, no prompt logprobs (the library has none)."""
    from fuzz.targets.transformers_cb.runner import CBRunner

    check_structure(CBRunner)
    assert list(inspect.signature(CBRunner.run).parameters)[:4] == ["self", "case", "items", "prompt_logprobs"]
    assert CBRunner.engine_key(_cb_case()) == CBRunner.engine_key(_cb_case())
    assert CBRunner.supports_sampling is False and CBRunner.supports_prompt_logprobs is False


class _Broken:
    """A runner that answers with what `mode` breaks."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def engine_key(self, case) -> str:
        return "k"

    def close(self) -> None:
        pass

    def run(self, case, items=None, prompt_logprobs=False) -> TargetRun:
        from fuzz.targets.blackbox import engine_items

        items = engine_items(case) if items is None else items
        out = {}
        for rid, spec in items:
            pos = ((3, -0.1), (4, -2.0)) if self.mode != "unsorted" else ((4, -2.0), (3, -0.1))
            tok = 9 if self.mode == "token_missing" else 3
            out[rid] = RequestResult((tok,) * spec.max_tokens, (pos,) * spec.max_tokens)
        if self.mode == "missing_request":
            out.pop(next(iter(out)))
        return TargetRun(out)


@pytest.mark.parametrize("mode,words", [("token_missing", "not in its logprobs"), ("unsorted", "best first"),
                                        ("missing_request", "request ids")])
def test_a_runner_that_breaks_the_protocol_is_named(mode: str, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        check_protocol(_Broken(mode), CASE)
    check_protocol(_Broken("ok"), CASE)  # the same runner, kept, passes
    with pytest.raises(ProtocolError, match="no method run"):
        check_structure(object())


def test_properties_are_named_after_the_target_and_kept_in_the_violation_tree() -> None:
    from fuzz.targets.vllm.checker import VLLMCrash, VLLMvsReference
    from fuzz.verdict.properties import CrashViolation, LivenessViolation, LogitsMismatch

    p = properties_for("mine")
    assert p.vs_reference.property == "mine_vs_reference" and issubclass(p.vs_reference, LogitsMismatch)
    assert p.hang.property == "mine_hang" and issubclass(p.hang, p.crash)
    assert issubclass(p.hang, LivenessViolation) and issubclass(p.crash, CrashViolation)
    assert properties_for("mine") is p  # one class per name: shrinking compares them
    vp = properties_for("vllm")
    assert vp.crash is VLLMCrash and vp.vs_reference is VLLMvsReference  # committed reproducers' names
    from fuzz.targets.transformers_cb.target import PROPERTIES as CB

    assert CB.crash.property == "transformers_cb_crash" and CB.hang.property == "transformers_cb_hang"
    assert CB.batch_invariance.property == "transformers_cb_batch_invariance"


def test_a_black_box_case_with_what_only_our_harness_drives_is_refused() -> None:
    from fuzz.errors import BadInput

    chk = BlackBoxChecker(_Broken("ok"), "mine", transformers=False)
    aborted = Case(FUZZ_MODEL, Workload((RequestSpec((1, 2), 2, abort_step=1),)))
    sampled = Case(FUZZ_MODEL, Workload((RequestSpec((1, 2), 2, sampling=llmfuzz.SamplingParams(temperature=1.0)),)))
    for case, words in ((aborted, "aborts"), (sampled, "sampling params"),
                        (Case(FUZZ_MODEL, CASE.workload, faults=("reorder_partial_swap",)), "faults")):
        with pytest.raises(BadInput, match=words):
            chk.check(case)
    chk.close()


def test_cases_take_the_cli_s_names_and_refuse_unknown_ones() -> None:
    from hypothesis import given, settings

    seen = set()

    @settings(max_examples=10, database=None, derandomize=True, deadline=None)
    @given(llmfuzz.cases(layouts="tp1pp1,tp2pp1", modes=["eager"], max_requests=2))
    def draw(case):
        assert len(case.workload.requests) <= 2 and case.mode == "eager" and not case.faults
        assert all(r.sampling is None and r.abort_step is None for r in case.workload.requests)
        seen.add(case.layout)

    draw()
    assert seen <= {"tp1pp1", "tp2pp1"}
    with pytest.raises(llmfuzz.BadInput, match="tp3pp7"):
        llmfuzz.cases(layouts="tp3pp7")
    with pytest.raises(llmfuzz.BadInput, match="modes"):
        llmfuzz.cases(modes="fast")


@pytest.mark.slow
def test_the_campaign_fuzzes_an_adapter_and_writes_its_reproducer(tmp_path) -> None:
    """The normal campaign loop over the generic target: the docs' adapter with a planted bug
    (a request with a 6-token-or-longer prompt loses its last generated token) is found, shrunk
    and written with its target's name."""
    from fuzz.campaign.loop import Campaign
    from fuzz.targets.blackbox_target import BlackBoxTarget

    ex = doc_example()

    class Short(ex.ReferenceEngineTarget):
        name = "short"

        def generate(self, config, requests):
            out = super().generate(config, requests)
            return [llmfuzz.Completion(c.token_ids[:-1], c.logprobs[:-1])
                    if len(r.prompt_token_ids) >= 6 and len(c.token_ids) > 1 else c for r, c in zip(requests, out)]

    from fuzz_testutil import FakeClock

    target = BlackBoxTarget(BlackBoxChecker(Short(), "short", transformers=False), layouts=("tp1pp1",))
    # On a clock each check moves 100 ms: the budgets are 400 examples and 200 shrink checks,
    # however loaded the machine.
    clock, check = FakeClock(), target.check

    def timed_check(case):
        clock.sleep(0.1)
        return check(case)

    target.check = timed_check
    summary = Campaign(target=target, budget_s=40, out_dir=str(tmp_path), progress=False, stop_on_failure=True,
                       shrink_budget_s=20, clock=clock).run()
    target.close()
    assert [f.property for f in summary.failures] == ["short_vs_reference"]
    doc = json.loads(open(summary.failures[0].path).read())
    assert doc["blackbox_target"] == "short"
    case = Case.from_dict(doc["case"])
    assert len(case.workload.requests) == 1 and case.workload.requests[0].max_tokens == 2
    assert len(case.workload.requests[0].prompt_token_ids) == 6


def test_the_cli_sends_an_adapters_reproducer_to_python(tmp_path, capsys) -> None:
    """`llmfuzz replay` cannot run an adapter's code: one line naming the target and the call."""
    from fuzz.campaign.reproduce import write_reproducer
    from fuzz.cli import main as cli

    path = write_reproducer(str(tmp_path), CASE, "mine_vs_reference", "request r0: ...", 2.0, "reference",
                            meta={"blackbox_target": "mine"})
    assert cli.main(["replay", path]) == 2
    err = capsys.readouterr().err
    assert "'mine'" in err and "llmfuzz.replay(path, target=" in err
