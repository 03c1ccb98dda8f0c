"""Any engine as a black box: the runner protocol it implements, and `BlackBoxChecker`, which
runs a Case on it and checks every property a black box allows (docs/targets.md).

The runner protocol
-------------------
- `run(case, items=None, prompt_logprobs=False) -> TargetRun` (fuzz.targets.runs): run the
  Case's workload (`engine_items(case)`), or `items` ((request id, RequestSpec) pairs: a solo
  run is one of them), on the engine for the Case's config; per request id the generated token
  ids and the top-k *raw* logprobs (log-softmax of the model's logits) at each position, the
  sampled token among them; with `prompt_logprobs`, top-k prompt logprobs too. A crash or a
  hang raises `TargetFailure`.
- `engine_key(case) -> str`: equal for Cases that run on the same engine (solo runs are cached by it).
- `close()`.
Optional attributes (absent: False): `supports_sampling` (it honours `RequestSpec.sampling`;
else a Case whose requests have sampling params is refused), `supports_prompt_logprobs` and
`supports_aborts` (it aborts a request before driver step `abort_step` and names it in
`TargetRun.aborted`; an aborted request's output is left unchecked, every other request is
checked as usual, and the KV pool's free blocks, where the run reports
them, must be the same after the run as before).

Properties, named `<target>_<kind>` (e.g. `vllm_crash`), each a kind of fuzz.verdict.properties'
Violations, so shrinking and reproducers work: `crash` / `hang`; `fa_invariants` (a
TargetFailure of that kind: the FA guard refused an attention call in the engine); `greedy` (a greedy request's
token is the top-1 of its own logprobs); `vs_reference` (our engine, tp1pp1 eager fp32, on the
same weights: `fuzz.verdict.compare.compare_runs`; a request whose sampling params process the
logits is compared teacher-forced on the target's own tokens); `sampling` (such a request's
tokens are what its params allow: the independent sampler, fuzz.verdict.oracles.sampling, on
the reference's raw logits); `vs_transformers` (teacher-forced, fuzz.verdict.compare.
check_teacher_forced; with prompt logprobs); `batch_invariance` (each greedy request alone vs in
the batch).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from fuzz.cases.case import Case, RequestSpec
from fuzz.errors import BadInput
from fuzz.verdict.compare import (CompareReport, RunMismatch, TeacherForcedReport, check_greedy, check_teacher_forced,
                                  compare_runs)
from fuzz.verdict.harness import Verdict
from fuzz.verdict.oracles.hf import TransformersOracle
from fuzz.verdict.properties import (CrashViolation, EngineViolation, FAViolation, LivenessViolation, LogitsMismatch,
                                     LogitsReport, SamplingViolation)
from fuzz.verdict.tolerance import BLACKBOX_HALF_RULES, logits_tolerance
from fuzz.targets.checkpoint import checkpoint_dir
from fuzz.targets.reference import ReferenceRunner
from fuzz.targets.runs import RequestResult, TargetFailure, TargetRun, TargetUnavailable


# -- properties ---------------------------------------------------------------------------------

class TargetCrash(CrashViolation):
    """The target raised or died (`signature`: exception type and innermost frame)."""

    property = "target_crash"

    def __init__(self, failure: TargetFailure, case: Case | None = None) -> None:
        super().__init__(f"{failure.signature} | {failure.kind}: {failure.detail}", case)
        self.signature, self.kind, self.log_path = failure.signature, failure.kind, failure.log_path


class TargetHang(TargetCrash, LivenessViolation):
    property = "target_hang"


class TargetFAInvariants(FAViolation):
    """The FA guard (fuzz.guard, mode "raise") refused an attention call inside the target."""

    property = "target_fa_invariants"

    def __init__(self, failure: TargetFailure, case: Case | None = None) -> None:
        super().__init__(failure.detail, case)


class TargetGreedy(EngineViolation):
    property = "target_greedy"


class TargetVsReference(LogitsMismatch):
    property = "target_vs_reference"


class TargetBatchInvariance(LogitsMismatch):
    property = "target_batch_invariance"


class TargetVsTransformers(LogitsMismatch):
    property = "target_vs_transformers"


class TargetSampling(SamplingViolation):
    property = "target_sampling"


class TargetBlocks(EngineViolation):
    """KV blocks lost: fewer free blocks in the target's pool after a run than before it."""

    property = "target_blocks"


KINDS = {"crash": TargetCrash, "hang": TargetHang, "fa_invariants": TargetFAInvariants, "greedy": TargetGreedy, "vs_reference": TargetVsReference,
         "batch_invariance": TargetBatchInvariance, "vs_transformers": TargetVsTransformers,
         "sampling": TargetSampling, "blocks": TargetBlocks}


@dataclass(frozen=True)
class Properties:
    """A target's Violation classes, one per kind, each named `<target>_<kind>`."""

    crash: type
    hang: type
    fa_invariants: type
    greedy: type
    vs_reference: type
    batch_invariance: type
    vs_transformers: type
    sampling: type
    blocks: type

    def failure(self, f: TargetFailure, case: Case):
        return {"hang": self.hang, "fa_invariants": self.fa_invariants}.get(f.kind, self.crash)(f, case)


_NAMED: dict[str, Properties] = {}


def properties_for(name: str, **own: type) -> Properties:
    """`name`'s Properties: the classes given in `own` (vLLM keeps its own, which committed
    reproducers name: given, they replace any made before), the others made here once per name
    (a hang is also a crash of its target)."""
    if name not in _NAMED or own:
        title = "".join(p.title() for p in name.replace("-", "_").split("_"))
        made: dict[str, type] = {}
        for kind, base in KINDS.items():
            if kind in own:
                made[kind] = own[kind]
                continue
            bases = (made["crash"], base) if kind == "hang" else (base,)
            made[kind] = type(f"{title}{base.__name__[len('Target'):]}", bases,
                              {"property": f"{name}_{kind}", "__module__": __name__})
        _NAMED[name] = Properties(**made)
    return _NAMED[name]


def logprob_tolerance(cfg: EngineConfig, absmax: float) -> float:
    """4 x the dtype-derived logits bound: a logprob is a logit minus a logsumexp (twice the
    error), and another factor 2 covers another engine's GEMM and attention kernels. In half
    precision this bound is tens of nats (it scales with the dtype's epsilon): the checker uses
    the measured-noise rule there instead (`BlackBoxChecker.tolerance`)."""
    return 4.0 * logits_tolerance(cfg.torch_dtype(), cfg.hidden_size, absmax)


def engine_items(case: Case) -> list[tuple[str, RequestSpec]]:
    """What a black box runs, by the reference engine's request ids: r0, r1, ...; a request with
    sampling n > 1 as its n children ("{k}_r{i}", n = 1 each, seed + k when seeded)."""
    return [(rid, spec if params is None else replace(spec, sampling=params))
            for rid, _, spec, params in case.workload.engine_requests()]


def is_plain(spec: RequestSpec) -> bool:
    """Greedy on the raw logits, without stops: its tokens are comparable with the reference's
    (with a stop, a near-tie divergence may end the request elsewhere: a length the reference
    teacher-forced on the target's own tokens decides, fuzz.targets.sampled)."""
    p = spec.sampling
    return p is None or not (p.processes_logits or p.stop_token_ids or p.stop_sequences)


def seeded(spec: RequestSpec, case: Case) -> bool:
    """A random request with its own seed, in float32, without stops: its tokens are the same
    alone as in any batch (its generator draws for its own rows only), where the logits agree
    to far below the gaps of its draws. Float32 only: in half precision batch and solo logits
    differ by ~1e-2, enough to flip a close draw. Stop ids are left to the support check: a
    flipped draw there also moves the end."""
    p = spec.sampling
    return (p is not None and p.temperature > 0 and p.seed is not None and case.config.dtype == "float32"
            and not p.stop_token_ids and not p.stop_sequences)


class BlackBoxVerdict(Verdict):
    """fuzz.verdict.harness.Verdict of a black-box run: `logits` is the comparison with the
    reference (max |delta logprob| against the tolerance), `oracles` every comparison by name
    (reference, reference-forced, <target>-solo, transformers)."""

    __slots__ = ()

    @property
    def vs_reference(self) -> CompareReport:
        return self.oracles["reference"]

    @property
    def batch(self) -> CompareReport | None:
        return next((v for k, v in self.oracles.items() if k.endswith("-solo")), None)

    @property
    def vs_transformers(self) -> TeacherForcedReport | None:
        return self.oracles.get("transformers")

    @property
    def lp_tol(self) -> float:
        return self.logits.tolerance


class BlackBoxChecker:
    """Runs a Case on `runner` (the protocol above) and checks every property; raises the first
    Violation, else returns a BlackBoxVerdict.

    `name`: the target's, which names its properties (`props`: its Violation classes, default
    `properties_for(name)`); `label`: how messages name it. `transformers`: None uses the
    transformers oracle where `transformers` imports, True requires it, False skips it.
    `prompt_logprobs`: ask for them in the batch run (where the runner supports them and
    `wants_prompt_logprobs` agrees) and check them against transformers. `half_rule`: in
    bf16/fp16, bound logprob errors by the measured noise (`half_rules`, by dtype: the
    black-box rule, BLACKBOX_HALF_RULES, unless a target calibrated its own) rather than the
    dtype formula (False: the formula, tens of nats: greedy agreement and little more)."""

    half_rules = BLACKBOX_HALF_RULES

    def __init__(self, runner, name: str = "target", *, reference: ReferenceRunner | None = None,
                 batch_invariance: bool = True, solo_cache_size: int = 4096, transformers: bool | None = None,
                 prompt_logprobs: bool = True, label: str | None = None, props: Properties | None = None,
                 hf: TransformersOracle | None = None, half_rule: bool = True) -> None:
        self.runner, self.name, self.label = runner, name, label or name
        self.half_rule = half_rule
        self.props = props or properties_for(name)
        self.reference = reference or ReferenceRunner()
        self.batch_invariance = batch_invariance
        if transformers is None:
            transformers = TransformersOracle.available()
        elif transformers and not TransformersOracle.available():
            raise TargetUnavailable("package transformers is not installed (pip install transformers)")
        self.hf = (hf or TransformersOracle()) if transformers else None  # `hf`: one shared, with its model cache
        self.prompt_logprobs = prompt_logprobs
        self._solo: dict[str, RequestResult] = {}
        self._solo_cap = solo_cache_size

    # -- hooks a subclass may change ------------------------------------------------------------
    def prepare(self, case: Case) -> Case:
        """The Case as this target runs it; BadInput (one line) for what a black box cannot run."""
        case.validate()
        if case.faults:
            raise BadInput(f"{self.name}: faults are our engine's bug seams; a black-box target runs none "
                           f"(got {list(case.faults)})")
        if not getattr(self.runner, "supports_aborts", False) and any(
                r.abort_step is not None for r in case.workload.requests):
            raise BadInput(f"{self.name}: the target does not abort requests (supports_aborts is False); "
                           "draw Cases without aborts")
        if not getattr(self.runner, "supports_sampling", False) and any(
                r.sampling is not None for r in case.workload.requests):
            raise BadInput(f"{self.name}: the target does not take sampling params (supports_sampling is "
                           "False); draw Cases with sampling=False")
        return case

    def wants_prompt_logprobs(self, case: Case) -> bool:
        return self.hf is not None and self.prompt_logprobs and getattr(self.runner, "supports_prompt_logprobs",
                                                                        False)

    def extra_checks(self, case: Case, test: TargetRun) -> None:
        """A target's own properties on the batch run (vLLM: its n-gram drafts)."""

    def check_draws(self, case: Case, rid: str, spec: RequestSpec, rows: list, tokens: list[int], lp_tol: float) -> None:
        """A target's own random draw for request `rid` on the oracle's raw logits `rows`
        (vLLM on CPU: its seeded Gumbel-max); none known by default."""

    def solo_oracle(self) -> str:
        return f"{self.name}-solo"

    # -- the check ----------------------------------------------------------------------------
    def run(self, case: Case, items=None, prompt_logprobs: bool = False) -> TargetRun:
        try:
            return self.runner.run(case, items, prompt_logprobs=prompt_logprobs)
        except TargetFailure as f:
            if f.kind == "deadline":  # the campaign's time ran out: not the engine's failure
                raise
            raise self.props.failure(f, case) from None

    def check(self, case: Case) -> BlackBoxVerdict:
        case = self.prepare(case)
        t0 = time.perf_counter()
        # An aborted request is not compared: what it made before its abort is timing (the
        # reference aborts it at its own step; the others' outputs do not depend on it there).
        ref = self.reference.run(case)
        lp_tol = self.tolerance(case)
        test = self.run(case, prompt_logprobs=self.wants_prompt_logprobs(case))
        self._check_blocks(case, test)
        abort_ids = {rid for rid, spec in engine_items(case) if spec.abort_step is not None}
        items = [(rid, spec) for rid, spec in engine_items(case) if rid not in abort_ids]
        plain = {rid for rid, spec in items if is_plain(spec)}
        got = {rid: r for rid, r in test.results.items() if rid in plain}
        try:
            check_greedy(got, lp_tol, self.label)
        except RunMismatch as e:
            raise self.props.greedy(str(e), case) from None
        oracles = {"reference": self._compare({rid: ref.results[rid] for rid in plain}, test.results, lp_tol, case,
                                              "reference", self.props.vs_reference)}
        if len(plain) < len(items):
            from fuzz.targets.sampled import check_sampled

            oracles["reference-forced"] = check_sampled(self, case, items, plain, test, lp_tol)
        if self.hf is not None:
            oracles["transformers"] = self._transformers(case, test, plain, lp_tol)
        self.extra_checks(case, test)
        seconds = test.seconds
        solo = [(rid, spec) for rid, spec in items if rid in plain or seeded(spec, case)]
        if self.batch_invariance and len(items) > 1 and solo:
            oracles[self.solo_oracle()], solo_s = self._batch_invariance(case, solo, test, lp_tol)
            seconds += solo_s
        rep = oracles["reference"]
        return BlackBoxVerdict(case, LogitsReport("reference", rep.max_lp_error, lp_tol, rep.positions), oracles, 0,
                               test.steps, 0, len(case.workload.requests), time.perf_counter() - t0, seconds)

    def _check_blocks(self, case: Case, test: TargetRun) -> None:
        """Blocks come back: with every request finished or aborted, the KV pool has as many
        free blocks as before the run (a block an aborted or finished request kept is lost to
        every later request)."""
        before, after = test.free_blocks
        if before is not None and after is not None and after != before:
            raise self.props.blocks(f"the KV pool had {before} free blocks before the run and {after} after it "
                                    f"(aborted: {sorted(test.aborted) or 'none'})", case)

    def tolerance(self, case: Case) -> float:
        """The Case's logprob bound: in half precision k x the noise our engine makes in that
        dtype + atol, where the rule is on; else the dtype formula (logprob_tolerance)."""
        rule = self.half_rules.get(case.config.dtype) if self.half_rule else None
        if rule is None:
            return logprob_tolerance(case.config, self.reference.logit_absmax(case))
        return rule.k * self.reference.half_noise(case) + rule.atol

    def _compare(self, oracle: dict, test: dict, lp_tol: float, case: Case, oracle_name: str, kind: type,
                 label: str | None = None, test_name: str | None = None) -> CompareReport:
        try:
            return compare_runs(oracle, test, lp_tol=lp_tol, margin_tol=lp_tol, oracle_name=label or oracle_name,
                                test_name=test_name or self.label)
        except RunMismatch as e:
            raise kind(str(e), case, e.ratio, oracle_name) from None

    def _transformers(self, case: Case, test: TargetRun, plain: set[str], lp_tol: float) -> TeacherForcedReport:
        """Teacher-forced on the target's tokens: greedy requests whole; the others' prompt
        logprobs only (a sampled token need not be transformers' argmax)."""
        prompts = {rid: spec.prompt_token_ids for rid, spec in engine_items(case)}
        run = {rid: r if rid in plain else replace(r, token_ids=(), logprobs=())
               for rid, r in test.results.items() if rid in prompts}
        try:
            return check_teacher_forced(self.hf, checkpoint_dir(case.config), prompts, run, lp_tol=lp_tol,
                                        margin_tol=lp_tol, name=self.label)
        except RunMismatch as e:
            raise self.props.vs_transformers(str(e), case, e.ratio, "transformers") from None

    def _batch_invariance(self, case: Case, items: list, test: TargetRun, lp_tol: float):
        """Each greedy or seeded request alone (cached by engine and request) against the batch
        run: the comparison and the seconds the target spent on solo runs. A seeded request's
        tokens must be the same alone (`seeded`)."""
        solo: dict[str, RequestResult] = {}
        key0, seconds = self.runner.engine_key(case), 0.0
        for rid, r in items:
            k = key0 + json.dumps([r.prompt_token_ids, r.max_tokens, r.sampling and r.sampling.to_dict()])
            if k not in self._solo:
                run = self.run(case, [(rid, replace(r, arrival_step=0, cache_salt=None))])
                seconds += run.seconds
                if rid not in run.results:
                    raise self.props.batch_invariance(f"request {rid}: no output from {self.label} alone", case,
                                                      float("inf"), self.solo_oracle())
                if len(self._solo) >= self._solo_cap:
                    self._solo.pop(next(iter(self._solo)))
                self._solo[k] = run.results[rid]
            solo[rid] = self._solo[k]
        specs = dict(items)
        for rid, r in items:
            if not is_plain(r) and rid in test.results and solo[rid].token_ids != test.results[rid].token_ids:
                a, b = solo[rid].token_ids, test.results[rid].token_ids
                i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise self.props.batch_invariance(
                    f"request {rid} (seed {r.sampling.seed}, params {r.sampling.to_dict()}): {self.label} in the batch "
                    f"sampled {list(b)}, alone {list(a)}; they part at position {i}: a request's generator must "
                    "advance with its own draws only", case, float("inf"), self.solo_oracle())
        plain = {rid: v for rid, v in solo.items() if is_plain(specs[rid])}
        return self._compare(plain, test.results, lp_tol, case, self.solo_oracle(), self.props.batch_invariance,
                             f"{self.label} alone", f"{self.label} in the batch"), seconds

    def close(self) -> None:
        self.runner.close()
        self.reference.close()
