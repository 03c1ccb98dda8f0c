"""llmfuzz's public API: llmfuzz's Cases, oracles and properties in an engine's own test suite.

    import llmfuzz
    from hypothesis import given

    @given(llmfuzz.cases(layouts=["tp1pp1"]))
    def test_my_engine(case):
        llmfuzz.check(MY_TARGET, case)      # MY_TARGET: an llmfuzz.Target subclass's instance

What an engine implements, what each property needs and a complete adapter: docs/targets.md.

Versioning: this module's names and their documented arguments and behaviour (`cases`,
`check`, `check_protocol`, `replay`, `Target`, `Request`, `Completion`, `Case`,
`SamplingParams`, `Violation`, `TargetFailure`, `BadInput`, `__version__`), the reproducer
JSON they write, and the `llmfuzz` pytest plugin's options follow semantic versioning: a
release that breaks any of them bumps the major version (while it is 0, the minor one).
Everything under `fuzz/` and `engine/` is internal and may change in any release.
"""
from __future__ import annotations

from llmfuzz._api import cases, check, check_protocol, replay
from fuzz.cases.case import Case
from fuzz.errors import BadInput
from fuzz.targets.adapter import Completion, EngineTarget as Target, Request
from fuzz.targets.runs import TargetFailure
from fuzz.verdict.properties import Violation
from engine.sample.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["BadInput", "Case", "Completion", "Request", "SamplingParams", "Target", "TargetFailure", "Violation",
           "__version__", "cases", "check", "check_protocol", "replay"]
