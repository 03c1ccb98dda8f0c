"""Fresh replay: a Case, after the Cases an engine served before it (its history), run again
on a brand-new engine, to tell a failure of the Case from a failure of the engine's state.

A long-lived engine (vLLM, transformers continuous batching, most adapters) serves many Cases
in a row; a bug may need what an earlier one left behind (a stale row of a reused batch, a
cache entry). A reproducer is only worth writing as such when it fails on an engine nobody
used before. Three ways to get one, whichever the target can give (`Target.fresh_check`):

- an adapter (`llmfuzz.Target`) importable by `module:qualname`: a new Python process that
  imports it, makes a new instance and checks the Cases there (`run_in_child`; this module's
  `main` is that process's entry point, `python -m fuzz.targets.fresh`);
- an adapter that cannot be imported from a new process (defined in `__main__` or inside a
  function): a new instance in this process (`run_in_process`), recorded as `in-process`;
- vLLM and transformers continuous batching: their engine is already a worker process; the
  live one is shut down and the next run starts another (the target's own `fresh_check`).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Callable, Iterable

from fuzz.cases.case import Case
from fuzz.targets.base import FreshUnavailable
from fuzz.verdict.properties import Violation

FRESH_TIMEOUT_S = 900.0  # one fresh process: imports, a new engine, the history and the Case
# How a fresh check ran (Target.fresh): recorded in the reproducer as `fresh`.
PROCESS, IN_PROCESS, RESTARTED = "process", "in-process", "engine restarted"


class FreshViolation(Violation):
    """A Violation a fresh process reported: its property, message, oracle and signature as
    that process's Violation had them (enough for fuzz.campaign.reproduce.replay_verdict and
    fuzz.verdict.properties.same_failure)."""

    def __init__(self, doc: dict, case: Case) -> None:
        super().__init__(doc.get("message", ""), case, doc.get("error_ratio"), doc.get("oracle"))
        self.property = doc.get("property", "violation")
        self.signature = doc.get("signature")


def run_history(check: Callable, history: Iterable[Case]) -> None:
    """Run each history Case through `check`, so the engine gets the state the Case after it
    needs. A history Case's own failure is not the one a replay asks about: it is passed over."""
    for h in history:
        try:
            check(h)
        except Violation:
            continue  # not the recorded failure; the engine's state after it is what counts


def run_sequence(check: Callable, history: Iterable[Case], case: Case, checked: Callable | None = None):
    """`history` then `case` through `check` (one engine, in that order): the Violation `case`
    raises, else None. `checked(verdict)` False (a Case the target did not run) makes it
    FreshUnavailable."""
    run_history(check, history)
    try:
        verdict = check(case)
    except Violation as v:
        return v
    if checked is not None and not checked(verdict):
        raise FreshUnavailable("the target did not run the Case (out of time)")
    return None


def importable_ref(obj) -> str | None:
    """`module:qualname` of `obj`'s class where a new process can import it by that name (not
    `__main__`, not defined inside a function), else None."""
    cls = obj if isinstance(obj, type) else type(obj)
    mod, qual = cls.__module__, cls.__qualname__
    if mod == "__main__" or "<locals>" in qual:
        return None
    try:
        found = importlib.import_module(mod)
        for part in qual.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{mod}:{qual}" if found is cls else None


def load_ref(ref: str):
    mod, _, qual = ref.partition(":")
    found = importlib.import_module(mod)
    for part in qual.split("."):
        found = getattr(found, part)
    return found


def checker_options(checker) -> dict:
    """What a BlackBoxChecker was made with, as JSON a fresh process makes the same one from."""
    return {"name": checker.name, "label": checker.label, "transformers": checker.hf is not None,
            "batch_invariance": checker.batch_invariance, "prompt_logprobs": checker.prompt_logprobs,
            "half_rule": checker.half_rule}


def run_in_child(ref: str, options: dict, history: Iterable[Case], case: Case, init: dict | None = None,
                 timeout_s: float = FRESH_TIMEOUT_S) -> Violation | None:
    """`history` then `case` on a new instance of the adapter `ref` (`init`: its keyword
    arguments) in a new Python process, checked by a BlackBoxChecker made with `options`."""
    job = {"adapter": ref, "init": init or {}, "checker": options,
           "history": [h.to_dict() for h in history], "case": case.to_dict()}
    # The child imports what this process can (the adapter's module may live beside a test).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = subprocess.run([sys.executable, "-m", "fuzz.targets.fresh"], input=json.dumps(job), text=True,
                              capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise FreshUnavailable(f"the fresh process did not answer within {timeout_s:.0f}s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FreshUnavailable(f"the fresh process exited {proc.returncode}: {' | '.join(tail)}")
    out = json.loads(lines[-1])
    if out.get("error"):
        raise FreshUnavailable(out["error"])
    return FreshViolation(out["violation"], case) if out.get("violation") else None


def run_in_process(runner, checker, history: Iterable[Case], case: Case) -> Violation | None:
    """`history` then `case` on a new instance of `runner`'s class (no arguments), in this
    process, checked by a checker like `checker` (sharing its reference and transformers oracle)."""
    from fuzz.targets.blackbox import BlackBoxChecker

    try:
        new = type(runner)()
    except TypeError as e:
        raise FreshUnavailable(f"cannot make a new {type(runner).__name__}: {e}") from None
    chk = BlackBoxChecker(new, checker.name, reference=checker.reference, hf=checker.hf,
                          transformers=checker.hf is not None, batch_invariance=checker.batch_invariance,
                          prompt_logprobs=checker.prompt_logprobs, label=checker.label, props=checker.props,
                          half_rule=checker.half_rule)
    try:
        return run_sequence(chk.check, history, case)
    finally:
        new.close()


def main() -> int:
    """The fresh process: a job (JSON on stdin) in, one JSON line out."""
    job = json.loads(sys.stdin.read())
    from fuzz.targets.blackbox import BlackBoxChecker

    try:
        adapter = load_ref(job["adapter"])(**job.get("init", {}))
    except Exception as e:  # the adapter's own import or constructor: no fresh engine to judge by
        print(json.dumps({"error": f"cannot make {job['adapter']}: {type(e).__name__}: {e}"}))
        return 0
    opts = job["checker"]
    chk = BlackBoxChecker(adapter, opts["name"], label=opts.get("label"), transformers=opts.get("transformers"),
                          batch_invariance=opts.get("batch_invariance", True),
                          prompt_logprobs=opts.get("prompt_logprobs", True), half_rule=opts.get("half_rule", True))
    try:
        v = run_sequence(chk.check, [Case.from_dict(h) for h in job["history"]], Case.from_dict(job["case"]))
    finally:
        chk.close()
    doc = None if v is None else {"property": v.property, "message": v.message, "oracle": v.oracle,
                                  "error_ratio": v.error_ratio, "signature": getattr(v, "signature", None)}
    print(json.dumps({"violation": doc}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
