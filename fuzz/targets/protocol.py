"""Conformance of a runner to the black-box protocol (fuzz.targets.blackbox): what the checker
relies on, checked on one Case before any property is (`llmfuzz.check_protocol`). A runner that
fails it would make every property's verdict meaningless, so each problem is named plainly.
"""
from __future__ import annotations

from fuzz.cases.case import Case
from fuzz.targets.runs import RequestResult, TargetRun


class ProtocolError(AssertionError):
    """The runner does not keep the protocol; the message says where."""


def check_structure(runner) -> None:
    """The methods and attributes, without running anything."""
    for name in ("run", "engine_key", "close"):
        if not callable(getattr(runner, name, None)):
            raise ProtocolError(f"{type(runner).__name__}: no method {name}()")
    for name in ("supports_sampling", "supports_prompt_logprobs"):
        if not isinstance(getattr(runner, name, False), bool):
            raise ProtocolError(f"{type(runner).__name__}.{name}: expected a bool")


def check_result(rid: str, r: RequestResult, max_tokens: int, prompt_len: int, prompt_logprobs: bool) -> None:
    """One request's output: at most max_tokens tokens, one position each, every position's
    logprobs best first, none above 0, the generated token among them."""
    if not isinstance(r, RequestResult):
        raise ProtocolError(f"request {rid}: expected a RequestResult, got {type(r).__name__}")
    if not 1 <= len(r.token_ids) <= max_tokens:
        raise ProtocolError(f"request {rid}: {len(r.token_ids)} tokens for max_tokens={max_tokens}")
    if len(r.logprobs) != len(r.token_ids):
        raise ProtocolError(f"request {rid}: {len(r.token_ids)} tokens but {len(r.logprobs)} logprob positions")
    for i, (tok, pos) in enumerate(zip(r.token_ids, r.logprobs)):
        vals = [v for _, v in pos]
        if tok not in dict(pos):
            raise ProtocolError(f"request {rid} position {i}: the generated token {tok} is not in its logprobs")
        if vals != sorted(vals, reverse=True) or max(vals) > 1e-6:
            raise ProtocolError(f"request {rid} position {i}: logprobs not best first, or above 0: {pos[:3]}")
    if prompt_logprobs and len(r.prompt_logprobs) != prompt_len - 1:
        raise ProtocolError(f"request {rid}: {len(r.prompt_logprobs)} prompt logprob positions for a prompt of "
                            f"{prompt_len} tokens (one per token from the second)")


def check_protocol(runner, case: Case) -> None:
    """Run `case` (greedy requests) in a batch and its first request alone, and check what
    came back: a TargetRun with every request id and nothing else, each output well formed;
    `engine_key` a string, the same for the same Case."""
    from fuzz.targets.blackbox import engine_items

    check_structure(runner)
    key = runner.engine_key(case)
    if not isinstance(key, str) or key != runner.engine_key(case):
        raise ProtocolError(f"engine_key: expected the same string for the same Case, got {key!r}")
    items = engine_items(case)
    plp = bool(getattr(runner, "supports_prompt_logprobs", False))
    for run_items, what in ((None, "the batch"), (items[:1], "one request alone")):
        run = runner.run(case, run_items, prompt_logprobs=plp)
        if not isinstance(run, TargetRun):
            raise ProtocolError(f"run ({what}): expected a TargetRun, got {type(run).__name__}")
        want = dict(items if run_items is None else run_items)
        if set(run.results) != set(want):
            raise ProtocolError(f"run ({what}): request ids {sorted(run.results)}, expected {sorted(want)}")
        for rid, spec in want.items():
            check_result(rid, run.results[rid], spec.max_tokens, len(spec.prompt_token_ids), plp)
