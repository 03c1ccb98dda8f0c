"""Targets: engines the harness drives as black boxes, and how their outputs compare.

A target runs a Case's workload (prompt token ids, max_tokens, arrivals where it can) with
greedy sampling and returns, per request, the generated token ids with the top-k logprobs
at every generated position (`TargetRun`), or fails with a `TargetFailure` (a crash or a
hang, keyed by its signature). Our reference engine is one target (`ReferenceTarget`, whose
internals the white-box harness in fuzz.harness also sees); vLLM is another
(`fuzz.targets.vllm_target.VLLMTarget`).

`compare_runs` is the oracle comparison, in the manner of vLLM's `check_logprobs_close`:
greedy tokens equal until the first divergence; a divergence is allowed only at a near-tie
(the oracle's margin between its token and the test's token is within `margin_tol`, and
each side's token is in the other's top-k), after which that request is not compared
further (the sequences differ); wherever tokens agree, the logprobs of every token in both
top-k lists agree within `lp_tol`.

`TransformersOracle` is the third oracle: `transformers`' LlamaForCausalLM on the same
checkpoint directory, teacher-forced (one forward pass over prompt + the target's own
generated tokens), so it checks every generated position's top-k logprobs and the greedy
choice, and the target's prompt logprobs where it returned them (`check_teacher_forced`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package stays light to import (the CLI imports it for --help)
    from fuzz.case import Case, RequestSpec

Position = tuple[tuple[int, float], ...]  # top-k (token id, logprob), best first


@dataclass(frozen=True, slots=True)
class RequestResult:
    token_ids: tuple[int, ...]
    logprobs: tuple[Position, ...]  # one per generated token
    # Teacher-forced prompt logprobs where the target returned them: one Position per prompt
    # token from the second on (the logprob of prompt token j given tokens [:j], with that
    # token included even outside the top-k); () when not asked for.
    prompt_logprobs: tuple[Position, ...] = ()

    def top(self, i: int) -> dict[int, float]:
        return dict(self.logprobs[i])


@dataclass(slots=True)
class TargetRun:
    results: dict[str, RequestResult]
    seconds: float = 0.0
    steps: int = 0


class TargetFailure(Exception):
    """The target crashed, hung or failed to start. `signature` keys it: exception type and
    innermost frame inside the target's package (no line numbers, so it survives small
    upstream edits), or `hang@<phase>`."""

    def __init__(self, kind: str, signature: str, detail: str = "", log_path: str | None = None) -> None:
        super().__init__(f"{kind}: {signature}" + (f" ({detail})" if detail else ""))
        self.kind, self.signature, self.detail, self.log_path = kind, signature, detail, log_path


class TargetUnavailable(RuntimeError):
    """The target's engine is not installed or cannot be found."""


def request_items(case: Case) -> list[tuple[str, RequestSpec]]:
    """Request ids as the reference engine names them (r0, r1, ...)."""
    return [(f"r{i}", r) for i, r in enumerate(case.workload.requests)]


# -- signatures -------------------------------------------------------------------------------

_LOG_PREFIX = re.compile(r"^(?:\((?P<proc>[^)]*?) pid=\d+\) )?(?:(?P<level>INFO|WARNING|ERROR|DEBUG|CRITICAL) "
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?)?")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Failure|Dead\w*)"
                  r"|AssertionError|KeyError|IndexError)(?::\s?(?P<msg>.*))?$")


def package_path(path: str, package: str) -> str | None:
    """'.../site-packages/vllm/v1/worker/x.py' -> 'vllm/v1/worker/x.py' (None if outside)."""
    parts = path.replace("\\", "/").split("/")
    if package not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index(package)
    return "/".join(parts[i:])


def signature(exc_type: str, frames: list[dict], package: str) -> str:
    """'AssertionError@vllm/v1/worker/gpu_model_runner.py:sync_and_gather_intermediate_tensors'."""
    for f in reversed(frames):
        p = package_path(f["file"], package)
        if p is not None:
            return f"{exc_type}@{p}:{f['func']}"
    return f"{exc_type}@<outside {package}>"


@dataclass(slots=True)
class LoggedTraceback:
    process: str  # the log prefix's process name (EngineCore, Worker_PP1, ...), '' if none
    level: str  # the log record's level (ERROR, WARNING, ...), '' for a bare traceback
    exc_type: str
    message: str
    frames: list[dict] = field(default_factory=list)
    text: str = ""


def parse_tracebacks(log: str) -> list[LoggedTraceback]:
    """Every Python traceback in a log, in order (logger prefixes stripped per line)."""
    out: list[LoggedTraceback] = []
    cur: LoggedTraceback | None = None
    for raw in log.splitlines():
        m = _LOG_PREFIX.match(raw)
        proc = (m.group("proc") or "") if m else ""
        level = (m.group("level") or "") if m else ""
        line = raw[m.end():] if m else raw
        if line.startswith("Traceback (most recent call last):"):
            cur = LoggedTraceback(proc, level, "", "", [], line + "\n")
            continue
        if cur is None:
            continue
        cur.text += line + "\n"
        fm = _FRAME.match(line)
        if fm:
            cur.frames.append({"file": fm.group("file"), "line": int(fm.group("line")), "func": fm.group("func")})
            continue
        if line.startswith((" ", "\t")) or not line.strip():
            code = line.strip()
            if cur.frames and code and "code" not in cur.frames[-1] and set(code) - set("^~ "):
                cur.frames[-1]["code"] = code
            continue
        em = _EXC.match(line.strip())
        if em and cur.frames:
            cur.exc_type = em.group("type").rsplit(".", 1)[-1]
            cur.message = (em.group("msg") or "").strip()
            out.append(cur)
            cur = None
    return out


# -- comparison -------------------------------------------------------------------------------

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


class TransformersOracle:
    """`transformers`' LlamaForCausalLM (fp32, eager attention, eval) loaded from a Hugging Face
    directory, cached per directory. `logprobs(tokens)` is the fp64 log-softmax of the logits at
    every position of one causal forward pass over contiguous tokens (no paging, no chunking)."""

    def __init__(self) -> None:
        self._models: dict[str, object] = {}

    @staticmethod
    def available() -> bool:
        import importlib.util

        return importlib.util.find_spec("transformers") is not None

    def _model(self, path: str):
        m = self._models.get(path)
        if m is None:
            import torch
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").to(torch.float32)
            m.eval()
            if len(self._models) >= 2:
                self._models.pop(next(iter(self._models)))
            self._models[path] = m
        return m

    def logprobs(self, path: str, tokens: tuple[int, ...] | list[int]):
        import torch

        with torch.inference_mode():
            logits = self._model(path)(torch.tensor([list(tokens)], dtype=torch.long)).logits[0]
        return torch.log_softmax(logits.double(), -1)


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


# -- the reference engine as a target ---------------------------------------------------------

class ReferenceTarget:
    """Our reference engine (tp1pp1, eager, fp32, no faults), through the harness's cached
    reference runs; per position the top-k of the log-softmax of the logits row (fp64)."""

    def __init__(self, top_k: int = 20, harness=None) -> None:
        from fuzz.harness import Harness

        self.top_k = top_k
        self.harness = harness or Harness()
        self._own = harness is None

    def run(self, case: Case) -> TargetRun:
        import time

        import torch

        t0 = time.perf_counter()
        trace = self.harness.reference(case)
        out: dict[str, RequestResult] = {}
        for rid, recs in trace.tokens.items():
            toks, pos = [], []
            for rec in recs:
                lp = torch.log_softmax(rec.logits.double(), -1)
                vals, idx = lp.topk(min(self.top_k, lp.numel()))
                top = dict(zip(idx.tolist(), vals.tolist()))
                top.setdefault(rec.token, float(lp[rec.token]))
                toks.append(rec.token)
                pos.append(tuple(sorted(top.items(), key=lambda p: -p[1])))
            out[rid] = RequestResult(tuple(toks), tuple(pos))
        return TargetRun(out, time.perf_counter() - t0, trace.num_steps)

    def logit_absmax(self, case: Case) -> float:
        trace = self.harness.reference(case)
        return max((float(r.logits.abs().max()) for recs in trace.tokens.values() for r in recs), default=1.0)

    def close(self) -> None:
        if self._own:
            self.harness.close()
