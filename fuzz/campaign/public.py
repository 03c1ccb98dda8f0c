"""What `llmfuzz.check` and `llmfuzz.replay` do (the public package re-exports them).

`check(target, case)`: `target` is a runner of the black-box protocol (fuzz.targets.blackbox;
an `llmfuzz.Target` is one), a BlackBoxChecker, or a campaign Target (fuzz.targets.base). A
runner gets a checker of its own, kept on it, sharing one reference engine per process (the
reference's runs are cached by Case, so many targets and Hypothesis' repeats cost one run).
A failure raises the Violation, which Hypothesis shrinks; on the failure it reports (its
final replay of the smallest Case), or outside Hypothesis, the reproducer is written first
(atomically: fuzz.campaign.reproduce.write_reproducer) under $LLMFUZZ_REPRODUCERS (default
./reproducers), and its path is on the Violation (`reproducer`) and in the test's report.
"""
from __future__ import annotations

import os

from fuzz.campaign.reproduce import load_reproducer, replay_on, replay_report, write_reproducer
from fuzz.errors import BadInput
from fuzz.targets.base import Target as CampaignTarget
from fuzz.targets.blackbox import BlackBoxChecker
from fuzz.verdict.properties import Violation

_SHARED: dict = {}  # the process's ReferenceRunner and transformers oracle, shared by every runner's checker
_ATTR = "_llmfuzz_checker"


def shared_reference():
    if "reference" not in _SHARED:
        from fuzz.targets.reference import ReferenceRunner

        _SHARED["reference"] = ReferenceRunner()
    return _SHARED["reference"]


def shared_transformers():
    """None where transformers is not installed (the checker then skips that oracle)."""
    if "hf" not in _SHARED:
        from fuzz.verdict.oracles.hf import TransformersOracle

        _SHARED["hf"] = TransformersOracle() if TransformersOracle.available() else None
    return _SHARED["hf"]


def checker_for(target, **kw):
    """The object whose `check(case)` runs every property on `target` (see the module docstring)."""
    if isinstance(target, (BlackBoxChecker, CampaignTarget)):
        return target
    chk = getattr(target, _ATTR, None)
    if chk is None:
        if not all(callable(getattr(target, m, None)) for m in ("run", "engine_key", "close")):
            raise BadInput(f"{type(target).__name__}: not a target (implement llmfuzz.Target.generate, or "
                           "run/engine_key/close: docs/targets.md)")
        chk = BlackBoxChecker(target, getattr(target, "name", "target"), reference=shared_reference(),
                              hf=shared_transformers(), **kw)
        chk.close = target.close  # the shared reference stays open for the process
        setattr(target, _ATTR, chk)
    return chk


def reproducer_dir() -> str:
    return os.environ.get("LLMFUZZ_REPRODUCERS") or "reproducers"


def _final() -> bool:
    """Outside Hypothesis, or in its final replay of the failure it reports."""
    try:
        from hypothesis.control import _current_build_context

        ctx = _current_build_context.value
    except ImportError:  # another Hypothesis layout: write every failure
        return True
    return ctx is None or bool(getattr(ctx, "is_final", True))


def check(target, case, out_dir: str | None = None):
    """Run `case` on `target` through every applicable property: its Verdict, or raise the
    Violation (with the reproducer written where it is final: see the module docstring)."""
    chk = checker_for(target)
    try:
        return chk.check(case)
    except Violation as v:
        if _final():
            write_for(chk, v, out_dir or reproducer_dir())
        raise


def write_for(chk, v: Violation, out_dir: str) -> str:
    """Write `v`'s reproducer; its path goes on `v.reproducer` and into the test's report."""
    meta = chk.reproducer_meta(v.case, v) if isinstance(chk, CampaignTarget) else {"blackbox_target": chk.name}
    if getattr(v, "signature", None):
        meta["signature"] = v.signature
    v.reproducer = write_reproducer(out_dir, v.case, v.property, v.message, v.error_ratio, v.oracle,
                                    v.second_opinion, meta)
    if hasattr(v, "add_note"):
        v.add_note(f"llmfuzz reproducer: {v.reproducer}")
    return v.reproducer


class Replay:
    """A reproducer run again: `verdict` ('passes', 'reproduces', 'differs'), the Violation
    raised (None when it passed), the reproducer, and `report`, cargo-fuzz style text."""

    def __init__(self, repro, verdict: str, violation) -> None:
        self.reproducer, self.verdict, self.violation = repro, verdict, violation
        self.report = replay_report(repro, violation)


def replay(path: str, target=None, engine_for=None) -> Replay:
    """Run the reproducer at `path` again: on `target` if given (an adapter's reproducer needs
    its target), else on `engine_for(reproducer)`, the engine it names (ours, or vLLM: the
    CLI's choice, which `llmfuzz.replay` passes in), closed after. A reproducer with a
    `history` (fuzz.campaign.history) runs those Cases first on the same target: give it one
    that has served nothing yet, as the fresh engine the history was found to need."""
    repro = load_reproducer(path)
    own = target is None
    if own:
        recorded = (repro.meta or {}).get("blackbox_target")
        if recorded or engine_for is None:
            raise BadInput(f"{path}: recorded on target {recorded or '?'!r}; pass it: llmfuzz.replay(path, target=...)")
        target = engine_for(repro)
    chk = checker_for(target)
    try:
        verdict, violation = replay_on(chk, repro)
    finally:
        if own:
            chk.close()
    return Replay(repro, verdict, violation)
