"""The sampling oracle: an independent reference sampler, written from the definitions.

Given a generated position's raw logits row (recorded in the Trace), the request's sampling
parameters and its token history (prompt + the tokens appended before), it computes in
float64 numpy, one row at a time, the distribution the engine must have sampled from:

  logit bias; min_tokens (stop ids at -inf while fewer than min_tokens outputs);
  repetition penalty r over prompt and output tokens (x > 0: x / r, else x * r);
  frequency f and presence p over output tokens (x - f * count - p * [count > 0]);
  greedy rows stop here. Random rows: divide by the temperature; min_p (drop tokens with
  probability below min_p times the largest); top_k (keep logits reaching the k-th largest,
  ties kept); top_p (over what is left, drop the least likely tokens while their total
  probability is at most 1 - p, the most likely always kept).

and checks the engine's recorded processed logprobs against it, then the sampled token:
greedy, the argmax; random, the winner of the exponential race argmax p / noise over the
recorded noise. It imports nothing from engine/sample: params are read as plain attributes.

A keep/drop decision within rounding of its threshold (fp32 in the engine) is borderline:
either outcome passes, and values are compared over the engine's own support.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

TRANSFORMS = ("logit_bias", "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty",
              "temperature", "min_p", "top_k", "top_p")
ATOL, RTOL = 1e-4, 1e-5  # logprobs: fp32 arithmetic on logits of a few units
BORDER = 1e-5  # keep/drop thresholds (relative to the threshold, or absolute on a cumulative probability)


@dataclass
class Expected:
    z: np.ndarray  # float64 logits after every value transform (before the masks)
    keep: np.ndarray  # bool: the support
    borderline: np.ndarray  # bool: tokens whose keep/drop is within rounding
    masked_by: dict[int, str]  # token -> the transform that dropped it
    greedy: bool

    def logprobs(self, support: np.ndarray | None = None) -> np.ndarray:
        s = self.keep if support is None else support
        out = np.full_like(self.z, -np.inf)
        zs = self.z[s]
        m = zs.max()
        out[s] = zs - m - np.log(np.exp(zs - m).sum())
        return out


def expected_distribution(raw: np.ndarray, params, prompt: list[int], output: list[int],
                          skip: tuple[str, ...] = ()) -> Expected:
    """The processed distribution of one row; `skip` leaves transforms out (diagnosis)."""
    z = np.asarray(raw, dtype=np.float64).copy()
    V = z.size
    keep, border, masked_by = np.ones(V, bool), np.zeros(V, bool), {}
    on = lambda name: name not in skip  # noqa: E731
    if on("logit_bias"):
        for t, b in params.logit_bias:
            z[t] += b
    if on("min_tokens") and len(output) < params.min_tokens:
        for t in params.stop_token_ids:
            keep[t] = False
            masked_by[t] = "min_tokens"
    _penalties(z, params, prompt, output, on)
    greedy = params.temperature == 0
    if not greedy:
        if on("temperature"):
            z /= params.temperature
        for name, mask in (("min_p", _min_p), ("top_k", _top_k), ("top_p", _top_p)):
            if on(name):
                drop, near = mask(z, keep, params)
                for t in np.flatnonzero(drop & keep):
                    masked_by[int(t)] = name
                keep &= ~drop
                border |= near
    return Expected(z, keep, border, masked_by, greedy)


def _penalties(z: np.ndarray, params, prompt: list[int], output: list[int], on) -> None:
    counts = Counter(output)
    r = params.repetition_penalty
    if on("repetition_penalty") and r != 1:
        for t in set(prompt) | set(counts):
            if np.isfinite(z[t]):
                z[t] = z[t] / r if z[t] > 0 else z[t] * r
    for t, c in counts.items():
        if on("frequency_penalty"):
            z[t] -= params.frequency_penalty * c
        if on("presence_penalty"):
            z[t] -= params.presence_penalty


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _probs(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    p = np.zeros_like(z)
    m = z[keep].max()
    p[keep] = np.exp(z[keep] - m)
    return p / p.sum()


def _min_p(z, keep, params):
    if params.min_p <= 0:
        return np.zeros_like(keep), np.zeros_like(keep)
    p = _probs(z, keep)
    thr = params.min_p * p.max()
    return p < thr, keep & (np.abs(p - thr) <= BORDER * thr)


def _top_k(z, keep, params):
    k = params.top_k
    if k <= 0 or k >= z.size:
        return np.zeros_like(keep), np.zeros_like(keep)
    live = np.where(keep, z, -np.inf)
    kth = np.sort(live)[::-1][k - 1]
    if not np.isfinite(kth):  # fewer than k tokens left: top_k drops nothing
        return np.zeros_like(keep), np.zeros_like(keep)
    return live < kth, keep & (np.abs(live - kth) <= BORDER * max(1.0, abs(kth)))


def _top_p(z, keep, params):
    if params.top_p >= 1:
        return np.zeros_like(keep), np.zeros_like(keep)
    p = _probs(z, keep)
    order = np.argsort(p, kind="stable")
    cum = np.cumsum(p[order])
    drop_sorted = cum <= 1 - params.top_p
    drop_sorted[-1] = False
    drop, near = np.zeros_like(keep), np.zeros_like(keep)
    drop[order] = drop_sorted
    near_sorted = np.abs(cum - (1 - params.top_p)) <= BORDER
    # Equal probabilities (frequent with low-precision logits: bf16 rounds many to one value)
    # sort in any order, so where the border falls inside a run of them, which of the run are
    # dropped is the sort's choice: every token of that run is borderline.
    ps = p[order]
    starts = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], ps.size]):
        if b - a > 1 and drop_sorted[a:b].any() and not drop_sorted[a:b].all():
            near_sorted[a:b] = True
    near[order] = near_sorted
    return drop, near & keep


def check_row(raw, recorded_logprobs, sampled: int, noise, params, prompt: list[int],
              output: list[int]) -> str | None:
    """None when the engine's row and token agree with the definitions; else what differs."""
    e = expected_distribution(raw, params, prompt, output)
    got = np.asarray(recorded_logprobs, dtype=np.float64)
    support = np.isfinite(got)
    wrong = (support != e.keep) & ~e.borderline
    if wrong.any():
        t = int(np.flatnonzero(wrong)[0])
        how = f"drops token {t}" if e.keep[t] else f"keeps token {t}, which {e.masked_by.get(t, '?')} drops"
        return f"support: the engine {how}{_explain(raw, got, params, prompt, output)}"
    want = e.logprobs(support)
    err = np.abs(got[support] - want[support])
    if (err > ATOL + RTOL * np.abs(want[support])).any():
        t = int(np.flatnonzero(support)[int(err.argmax())])
        return (f"logprob of token {t}: engine {got[t]:.6g}, expected {want[t]:.6g}"
                f"{_explain(raw, got, params, prompt, output)}")
    return _check_token(e, want, support, sampled, noise)


def _check_token(e: Expected, lp: np.ndarray, support: np.ndarray, sampled: int, noise) -> str | None:
    if not support[sampled]:
        return f"sampled token {sampled} lies outside the processed distribution's support"
    if e.greedy:
        if lp[sampled] < lp.max() - ATOL:
            return f"greedy: sampled {sampled} (logprob {lp[sampled]:.6g}), argmax {int(lp.argmax())} ({lp.max():.6g})"
        return None
    if noise is None:
        return "random sample without its recorded noise"
    q = np.asarray(noise, dtype=np.float64)
    score = np.where(support, np.exp(lp) / q, 0.0)
    if score[sampled] < score.max() * (1 - 1e-4):
        return f"random: sampled {sampled}, but the race p / noise is won by {int(score.argmax())}"
    return None


def _explain(raw, got: np.ndarray, params, prompt: list[int], output: list[int]) -> str:
    """Which single transform, left out, makes the definitions agree with the engine."""
    for name in TRANSFORMS:
        e = expected_distribution(raw, params, prompt, output, skip=(name,))
        support = np.isfinite(got)
        if ((support != e.keep) & ~e.borderline).any():
            continue
        want = e.logprobs(support)
        if np.allclose(got[support], want[support], atol=ATOL, rtol=RTOL):
            return f" (the engine's row matches the distribution without {name})"
    return " (no single transform left out explains it)"


def check_trace(trace, prompts: dict[str, list[int]]) -> list[str]:
    """One line per request whose recorded sampling disagrees with the definitions (its first
    disagreeing position). `prompts`: request id -> prompt token ids (children of an n > 1
    request under their own ids)."""
    problems = []
    for rid, params in trace.sampling_params.items():
        out: list[int] = []
        for i, rec in enumerate(trace.tokens.get(rid, [])):
            raw = rec.logits.double().numpy()
            # No row recorded: the engine sampled from the raw distribution (a request whose
            # params only stop it); the definitions must agree that nothing applies.
            lp = _log_softmax(raw) if rec.logprobs is None else rec.logprobs.double().numpy()
            why = check_row(raw, lp, rec.sampled, None if rec.noise is None else rec.noise.double().numpy(),
                            params, prompts[rid], out)
            if why is None and params.logprobs is not None:
                why = _check_top_logprobs(rec.top_logprobs or {}, lp, params.logprobs, rec.sampled)
            if why is not None:
                problems.append(f"sampling: request {rid} output {i} (step {rec.step}): {why}")
                break
            out.append(rec.token)
    return problems


def _check_top_logprobs(top: dict[int, float], lp: np.ndarray, k: int, sampled: int) -> str | None:
    """The k most likely tokens of the recorded row, and the sampled one, with its values."""
    k = min(k, lp.size)
    if sampled not in top or not k <= len(top) <= k + 1:
        return f"top logprobs: {len(top)} entries for logprobs={k}, sampled token {'in' if sampled in top else 'missing'}"
    for t, v in top.items():
        if not (np.isclose(v, lp[t], atol=ATOL, rtol=RTOL) or (np.isneginf(v) and np.isneginf(lp[t]))):
            return f"top logprobs: token {t} has {v:.6g}, its row {lp[t]:.6g}"
    best = [t for t in top if t != sampled] if len(top) == k + 1 else list(top)
    if best and (lp > min(top[t] for t in best) + ATOL).sum() > len(best):
        return "top logprobs: a token more likely than the least likely reported one is missing"
    return None


def compare_noise(test, reference) -> list[str]:
    """Same seed, same draws: a request's noise at each output index must be bitwise equal
    between two runs (its generator draws once per token it samples, whatever it is batched
    with). Differing draws mean a generator out of step."""
    problems = []
    for rid, recs in test.tokens.items():
        for i, (a, b) in enumerate(zip(recs, reference.tokens.get(rid, []))):
            if a.noise is not None and b.noise is not None and not np.array_equal(a.noise.numpy(), b.noise.numpy()):
                problems.append(f"sampling: request {rid} output {i}: its random draw differs from the "
                                f"reference's (the generator is out of step)")
                break
    return problems


def check_prompt_logprobs(recorded: list, raw_rows: np.ndarray, prompt: list[int]) -> str | None:
    """recorded[i] (i >= 1): the logprob dict of prompt token i; raw_rows[i - 1]: the raw
    logits row that predicts it. Each reported value is log_softmax(row)[token]."""
    for i in range(1, len(prompt)):
        d = recorded[i] if i < len(recorded) else None
        if d is None or prompt[i] not in d:
            return f"prompt logprobs: token {i} missing"
        lp = _log_softmax(np.asarray(raw_rows[i - 1], dtype=np.float64))
        for t, v in d.items():
            if not np.isclose(v, lp[t], atol=ATOL, rtol=RTOL):
                return f"prompt logprobs: token {i}: {t} has {v:.6g}, expected {lp[t]:.6g}"
    return None
