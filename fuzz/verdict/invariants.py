"""FlashAttention varlen argument invariants (docs/bug_classes.md#fa_invariants): the public name.

The contract itself lives in `engine.attention.fa_contract`, a leaf module, so the engine
checks its own calls without importing the harness; this module keeps the documented
`from fuzz.verdict.invariants import check_varlen_args, FAInvariantError` working.
"""
from __future__ import annotations

from engine.attention.fa_contract import FAInvariantError, VarlenReport, check_varlen_args, check_varlen_shapes

__all__ = ["FAInvariantError", "VarlenReport", "check_varlen_args", "check_varlen_shapes"]
