"""The glue behind `llmfuzz`'s functions: argument checks and defaults; the work is in fuzz/."""
from __future__ import annotations

from typing import Iterable

from fuzz.errors import BadInput


def _names(v: str | Iterable[str] | None, what: str, allowed: Iterable[str]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in (v.split(",") if isinstance(v, str) else v) if n.strip())
    bad = [n for n in names if n not in tuple(allowed)]
    if not names or bad:
        raise BadInput(f"{what}: {bad[0] if bad else 'none given'!r} is not one of {', '.join(allowed)}")
    return names


def cases(layouts="tp1pp1", modes="eager", max_requests: int = 8, sampling: bool = False, dtype: str | None = None,
          base=None):
    """A Hypothesis strategy of Cases a black-box target can run (the CLI's knobs: `layouts`
    and `modes` as lists or comma strings, e.g. "tp1pp1,tp2pp1" and "eager,graph";
    `max_requests` per workload; `sampling`: requests may carry SamplingParams; `dtype` of the
    model: float32 (default), bfloat16, float16; `base`: the EngineConfig drawn around)."""
    from fuzz.cases.strategies import DEFAULT_LAYOUTS, FUZZ_MODEL, MODES
    from fuzz.targets.blackbox_target import blackbox_cases

    if not isinstance(max_requests, int) or max_requests < 1:
        raise BadInput(f"max_requests: {max_requests!r} is not a positive integer")
    base = base or FUZZ_MODEL
    if dtype is not None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise BadInput(f"dtype: {dtype!r} is not one of float32, bfloat16, float16")
        base = base.replace(dtype=dtype)
    return blackbox_cases(_names(layouts, "layouts", DEFAULT_LAYOUTS), _names(modes, "modes", MODES), base,
                          max_requests, sampling)


def check(target, case, out_dir: str | None = None):
    """Run `case` on `target` (an llmfuzz.Target, any runner of the protocol in docs/targets.md,
    or a campaign target) through every applicable property. Returns the verdict, or raises the
    Violation, which Hypothesis shrinks; the failure Hypothesis reports is written as a JSON
    reproducer under `out_dir` (default $LLMFUZZ_REPRODUCERS, else ./reproducers)."""
    from fuzz.campaign.public import check as _check

    return _check(target, case, out_dir)


def check_protocol(target, case=None) -> None:
    """Check that `target` keeps the runner protocol on `case` (default: a two-request greedy
    Case on tp1pp1); raises AssertionError naming the first problem."""
    from fuzz.cases.case import Case, RequestSpec, Workload
    from fuzz.cases.strategies import FUZZ_MODEL
    from fuzz.targets.protocol import check_protocol as _check

    if case is None:
        case = Case(FUZZ_MODEL, Workload((RequestSpec((1, 2, 3, 4, 5), 3), RequestSpec((7, 8), 2))))
    checker = getattr(target, "checker", target)  # a campaign target's checker, or a checker itself
    _check(getattr(checker, "runner", target), case)


def replay(path: str, target=None):
    """Run a reproducer again: on `target` (needed for an adapter's reproducer), else on the
    engine it names (ours, or vLLM). Returns an object with `verdict` ('passes', 'reproduces',
    'differs'), `violation` and `report`."""
    from fuzz.campaign.public import replay as _replay

    def engine_for(repro):
        from types import SimpleNamespace

        from fuzz.cli.replay import replay_target

        return replay_target(repro, SimpleNamespace(isolate="auto", oracle=None))

    return _replay(path, target, engine_for)
