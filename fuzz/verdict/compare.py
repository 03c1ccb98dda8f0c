"""How a black-box target's outputs compare with an oracle's.

`compare_runs` is the oracle comparison, in the manner of vLLM's `check_logprobs_close`:
greedy tokens equal until the first divergence; a divergence is allowed only at a near-tie
(the oracle's margin between its token and the test's token is within `margin_tol`, and
each side's token is in the other's top-k), after which that request is not compared
further (the sequences differ); wherever tokens agree, the logprobs of every token in both
top-k lists agree within `lp_tol`.

`check_teacher_forced` is the third oracle's comparison: `transformers`' LlamaForCausalLM
(fuzz.verdict.oracles.hf.TransformersOracle) on the same checkpoint directory, teacher-forced
(one forward pass over prompt + the target's own generated tokens), so it checks every
generated position's top-k logprobs and the greedy choice, and the target's prompt logprobs
where it returned them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fuzz.targets.runs import RequestResult

if TYPE_CHECKING:  # torch and transformers load only when a comparison needs them
    from fuzz.verdict.oracles.hf import TransformersOracle


class RunMismatch(AssertionError):
    """compare_runs found a difference the tolerances do not allow."""

    def __init__(self, message: str, ratio: float = float("inf")) -> None:
        super().__init__(message)
        self.ratio = ratio


@dataclass(slots=True)
class CompareReport:
    positions: int = 0
    max_lp_error: float = 0.0
    divergences: list = field(default_factory=list)  # (rid, position, oracle tok, test tok, margin)


def compare_runs(oracle: dict[str, RequestResult], test: dict[str, RequestResult], *, lp_tol: float,
                 margin_tol: float, oracle_name: str = "oracle", test_name: str = "test") -> CompareReport:
    """See the module docstring; raises RunMismatch naming the request and position."""
    rep = CompareReport()
    for rid, o in oracle.items():
        t = test.get(rid)
        if t is None:
            raise RunMismatch(f"request {rid}: no output from {test_name}")
        if len(t.token_ids) != len(o.token_ids):
            raise RunMismatch(f"request {rid}: {test_name} generated {len(t.token_ids)} tokens, "
                              f"{oracle_name} {len(o.token_ids)}")
        for i, (ot, tt) in enumerate(zip(o.token_ids, t.token_ids)):
            otop, ttop = o.top(i), t.top(i)
            if ot == tt:
                for tok in otop.keys() & ttop.keys():
                    err = abs(otop[tok] - ttop[tok])
                    rep.max_lp_error = max(rep.max_lp_error, err)
                    if err > lp_tol:
                        raise RunMismatch(f"request {rid} position {i}: logprob of token {tok} is {ttop[tok]:.6f} "
                                          f"in {test_name}, {otop[tok]:.6f} in {oracle_name} (|diff| {err:.3g} > "
                                          f"tolerance {lp_tol:.3g})", err / lp_tol)
                rep.positions += 1
                continue
            if tt not in otop or ot not in ttop:
                raise RunMismatch(f"request {rid} position {i}: greedy token {tt} ({test_name}) != {ot} "
                                  f"({oracle_name}), and "
                                  + (f"{tt} is not in {oracle_name}'s top-{len(otop)}" if tt not in otop
                                     else f"{ot} is not in {test_name}'s top-{len(ttop)}"))
            margin = otop[ot] - otop[tt]
            if margin > margin_tol:
                raise RunMismatch(f"request {rid} position {i}: greedy token {tt} ({test_name}) != {ot} "
                                  f"({oracle_name}) where {oracle_name}'s margin is {margin:.3g} > "
                                  f"tolerance {margin_tol:.3g}", margin / margin_tol)
            rep.divergences.append((rid, i, ot, tt, margin))
            break  # a near-tie: the sequences differ from here on
    return rep


def check_greedy(run: dict[str, RequestResult], lp_tol: float, name: str = "target") -> None:
    """Greedy sampling picks a top-1 token: the sampled token's logprob is the top logprob
    (up to lp_tol: ties)."""
    for rid, r in run.items():
        if len(r.logprobs) != len(r.token_ids):
            raise RunMismatch(f"request {rid}: {len(r.token_ids)} tokens but {len(r.logprobs)} logprob positions")
        for i, tok in enumerate(r.token_ids):
            top = r.top(i)
            if tok not in top:
                raise RunMismatch(f"request {rid} position {i}: {name} sampled {tok}, absent from its own logprobs")
            best = max(top.values())
            if top[tok] < best - lp_tol:
                raise RunMismatch(f"request {rid} position {i}: greedy {name} sampled {tok} (logprob "
                                  f"{top[tok]:.6f}) but {max(top, key=top.get)} has {best:.6f}")


# -- transformers, teacher-forced --------------------------------------------------------------

@dataclass(slots=True)
class TeacherForcedReport:
    positions: int = 0  # generated positions checked
    prompt_positions: int = 0  # prompt positions checked
    max_lp_error: float = 0.0


def check_teacher_forced(oracle: TransformersOracle, path: str, prompts: dict[str, tuple[int, ...]],
                         run: dict[str, RequestResult], *, lp_tol: float, margin_tol: float,
                         name: str = "target") -> TeacherForcedReport:
    """Against `oracle` fed prompt + the target's own tokens: at every generated position the
    target's token is the oracle's argmax up to `margin_tol` (a near-tie), and every logprob
    in the target's top-k is the oracle's within `lp_tol`; the same for each prompt position
    the target returned logprobs for. Raises RunMismatch naming the request and position."""
    rep = TeacherForcedReport()
    for rid, r in run.items():
        prompt = tuple(prompts[rid])
        full = prompt + tuple(r.token_ids)
        if len(full) < 2:
            continue
        lp = oracle.logprobs(path, full[:-1])  # row i predicts full[i + 1]

        def close(row: int, pos, where: str) -> None:
            for tok, v in pos:
                want = float(lp[row, tok])
                err = abs(v - want)
                rep.max_lp_error = max(rep.max_lp_error, err)
                if err > lp_tol:
                    raise RunMismatch(f"request {rid} {where}: logprob of token {tok} is {v:.6f} in {name}, "
                                      f"{want:.6f} in transformers (|diff| {err:.3g} > tolerance {lp_tol:.3g})",
                                      err / lp_tol)

        for i, (tok, pos) in enumerate(zip(r.token_ids, r.logprobs)):
            row = len(prompt) - 1 + i
            best = int(lp[row].argmax())
            margin = float(lp[row, best] - lp[row, tok])
            if margin > margin_tol:
                raise RunMismatch(f"request {rid} position {i}: {name} generated {tok}, transformers' argmax is "
                                  f"{best} with a margin of {margin:.3g} > tolerance {margin_tol:.3g} "
                                  f"(teacher-forced on {name}'s tokens)", margin / margin_tol)
            close(row, pos, f"position {i}")
            rep.positions += 1
        for j, pos in enumerate(r.prompt_logprobs, start=1):  # logprob of prompt[j] given prompt[:j]
            if j >= len(prompt):
                break
            if pos and prompt[j] not in dict(pos):
                raise RunMismatch(f"request {rid} prompt position {j}: {name}'s prompt logprobs lack the "
                                  f"prompt token {prompt[j]}")
            close(j - 1, pos, f"prompt position {j}")
            rep.prompt_positions += 1
    return rep
