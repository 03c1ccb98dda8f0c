"""A covering-array plan of vLLM configs: every pair of dimension values in the first few
configs, then as many triples as the budget affords, cheapest configs first.

Why a covering array: an engine start costs 10-60 s on 2 cores, so a 15-minute campaign
affords about a dozen configs. A dozen random draws can leave whole values unvisited
(block size 32 in every config of a 900 s campaign: measured); bugs that need two knobs at once
(pp2 with eager, speculation with a small token budget) need every PAIR of values seen.

Construction is greedy (AETG-like, exhaustive over the few thousand valid rows): each next
config is the valid row covering the most pairs not yet covered, ties broken by start-up
cost, then by a seeded shuffle (so seeds give different plans). Once every pair is covered,
those configs are re-ordered cheapest first (the pairs stay covered within them, whatever
their order) and further rows are chosen by new TRIPLES covered, cheapest first on ties.

Dimension values: index 0 is vLLM's/our default, so a config is named by what differs.
Invalid combinations are never generated (`valid`)."""
from __future__ import annotations

import functools
import itertools
import random

# name -> values (first: the default). Three values at most per dimension: a pair covering of
# 3x3-valued dimensions needs >= 9 rows; 4 values would need >= 16, more than 900 s affords.
DIMENSIONS: dict[str, tuple] = {
    "layout": ("tp1pp1", "tp2pp1", "tp1pp2"),
    "mode": ("eager", "compiled"),            # enforce_eager / torch.compile (inductor on CPU)
    "spec": (0, 1, 3),                        # n-gram speculation: k draft tokens (0: off)
    "budget": (128, 48, 16),                  # max_num_batched_tokens (chunked prefill), >= max_num_seqs (8)
    "block": (32, 64, 128),                   # CPU attention: block sizes are multiples of 32
    "prefix": (False, True),                  # enable_prefix_caching
    "async": (False, True),                   # async_scheduling (inert on CPU: vLLM turns it off)
    "dtype": ("float32", "bfloat16"),
    "max_len": (128, 256),                    # max_model_len
    "kv": ("large", "small"),                 # small: a KV cache of ~1 request, forcing preemption
    "core": ("inproc", "process"),            # the engine core in the client's process or its own
}


def valid(row: dict, excluded=()) -> bool:
    """What vLLM 0.32 refuses by design is not planned: async scheduling with n-gram drafts
    ("async scheduling is only supported with EAGLE/MTP/Draft Model/NGram GPU"); nor prefix
    caching with a block as long as max_model_len, which can never hit (a hit is a whole block
    and leaves a prompt's last token to compute: prefix caching would be on in name only); nor
    a row that one of `excluded` (fuzz.targets.vllm.known.KnownCrash) kills."""
    if row.get("async") and row.get("spec"):
        return False
    if row.get("prefix") and row.get("block", 0) >= row.get("max_len", 1 << 30):
        return False
    return not any(k.kills(row) for k in excluded)


def startup_cost(row: dict) -> float:
    """Estimated seconds to start this config's engine with a pre-imported worker and the
    engine core in-process, measured on the 2-core machine (docs/vllm.md): eager tp1 4-11 s;
    torch.compile +25 s (tp1 compiled: 28 s); two workers (tp2/pp2): vLLM's CPU platform
    spawns them and each imports vLLM again, +15 s on a quiet machine (tp2 eager: 18 s; 53 s
    with other work running); the engine core in its own process spawns one more process,
    which imports vLLM too (+10 s). The plan's order and how many configs fit use it."""
    s = 6.0
    if row["mode"] == "compiled":
        s += 25.0
    if row["layout"] != "tp1pp1":
        s += 15.0
    if row.get("core") == "process":
        s += 10.0
    return s


def _all_rows(dims: dict, excluded=()) -> list[dict]:
    """Every valid row; when the dimensions given leave only excluded rows (e.g. the user
    asked for pp2 eager alone), those."""
    names = list(dims)
    rows = [dict(zip(names, vals)) for vals in itertools.product(*dims.values())]
    return [r for r in rows if valid(r, excluded)] or [r for r in rows if valid(r)]


def _tuples(row: dict, names: list[str], t: int) -> set:
    return {tuple((n, row[n]) for n in combo) for combo in itertools.combinations(names, t)}


def required(dims: dict, t: int) -> set:
    """Every t-tuple of values that some row valid by design has (what vLLM refuses is not
    required; what a known crash kills is, and counts as not covered)."""
    return set(_required(tuple((n, tuple(v)) for n, v in dims.items()), t))


@functools.lru_cache(maxsize=32)
def _required(dims: tuple, t: int) -> frozenset:
    # A plan's report asks for the same dimensions' tuples once per coverage figure.
    dims_d, out = dict(dims), set()
    names = list(dims_d)
    for r in _all_rows(dims_d):
        out |= _tuples(r, names, t)
    return frozenset(out)


def _masks(rows: list[dict], names: list[str], t: int) -> tuple[list[int], int]:
    """Each row's t-tuples as a bit mask over all required t-tuples (fast set algebra), and
    the mask of all of them."""
    index: dict = {}
    masks = []
    for r in rows:
        m = 0
        for tup in _tuples(r, names, t):
            m |= 1 << index.setdefault(tup, len(index))
        masks.append(m)
    return masks, (1 << len(index)) - 1


def _greedy_pairs(rows: list[dict], masks: list[int], need: int, max_rows: int) -> list[int]:
    plan: list[int] = []
    while need and len(plan) < max_rows:
        best = max(range(len(rows)), key=lambda i: ((masks[i] & need).bit_count(), -startup_cost(rows[i])))
        plan.append(best)
        need &= ~masks[best]
    return plan


def covering_plan(dims: dict = DIMENSIONS, seed: int = 0, max_rows: int = 40, tries: int = 6,
                  excluded=()) -> tuple[list[dict], int]:
    """(rows, k): the first k rows cover every pair of the rows not `excluded` (cheapest first
    among them); the rows after add triples. The pair phase is tried `tries` times with
    shuffled tie-breaks and the fewest rows (then the cheapest) kept. Deterministic for a seed."""
    rng = random.Random(seed)
    names, rows0 = list(dims), _all_rows(dims, excluded)
    masks0, need = _masks(rows0, names, 2)  # once: a try only reorders the rows
    order, best_plan = list(range(len(rows0))), None
    for _ in range(tries):
        rng.shuffle(order)  # the tie-break
        rows, masks = [rows0[i] for i in order], [masks0[i] for i in order]
        idx = _greedy_pairs(rows, masks, need, max_rows)
        cand = [rows[i] for i in idx]
        key = (len(cand), sum(map(startup_cost, cand)))
        if best_plan is None or key < best_plan[0]:
            best_plan = (key, cand)
    rows = [rows0[i] for i in order]
    plan = sorted(best_plan[1], key=startup_cost)  # any order of these rows covers the same pairs
    k = len(plan)
    tmasks, _ = _masks(plan + rows, names, 3)
    covered = 0
    for m in tmasks[:k]:
        covered |= m
    rest = tmasks[k:]
    while len(plan) < max_rows:
        best = max(range(len(rows)), key=lambda i: ((rest[i] & ~covered).bit_count(), -startup_cost(rows[i])))
        if not rest[best] & ~covered:
            break
        plan.append(rows[best])
        covered |= rest[best]
    return plan, k


def coverage(plan: list[dict], dims: dict = DIMENSIONS, t: int = 2) -> tuple[int, int]:
    """(t-tuples covered by `plan`, t-tuples required)."""
    need = required(dims, t)
    names = list(dims)
    got = set().union(*(_tuples(r, names, t) for r in plan)) if plan else set()
    return len(got & need), len(need)


def fit_budget(plan: list[dict], budget_s: float, min_fuzz_s: float = 20.0, reserve: float = 0.05,
               k: int | None = None, startup_share: float = 0.35) -> int:
    """How many of the plan's configs a budget affords: each its start-up plus `min_fuzz_s`
    of examples, `reserve` of the budget kept for shrinking and shut-downs. Past the first
    `k` (the pair-covering rows), a config is added only while the estimated start-ups stay
    under `startup_share` of the budget: more configs than that buy triples with start-up
    time rather than examples."""
    left, n, startup = budget_s * (1 - reserve), 0, 0.0
    for i, r in enumerate(plan):
        cost = startup_cost(r) + min_fuzz_s
        if cost > left or (k is not None and i >= k and startup + startup_cost(r) > startup_share * budget_s):
            break
        left -= cost
        startup += startup_cost(r)
        n += 1
    return max(1, n)


def budget_plan(plan: list[dict], k: int, budget_s: float, min_fuzz_s: float = 20.0,
                reserve: float = 0.05) -> list[dict]:
    """The configs a budget visits, in order. When it affords all k pair-covering configs:
    the plan's first `fit_budget` ones. Otherwise (a short budget) the cheapest-first prefix
    would cover few pairs (only tp1 eager configs, say), so pick among the k greedily by new
    pairs per second of (start-up + `min_fuzz_s`) while they fit, then visit them cheapest
    first."""
    n = fit_budget(plan, budget_s, min_fuzz_s, reserve, k=k)
    if n >= k:
        return plan[:n]
    names = list(plan[0]) if plan else []
    pairs = [_tuples(r, names, 2) for r in plan[:k]]
    left, chosen, got = budget_s * (1 - reserve), [], set()
    while True:
        fits = [i for i in range(k) if i not in chosen and startup_cost(plan[i]) + min_fuzz_s <= left]
        if not fits:
            break
        best = max(fits, key=lambda i: (len(pairs[i] - got) / (startup_cost(plan[i]) + min_fuzz_s), -i))
        if not pairs[best] - got:
            break
        chosen.append(best)
        got |= pairs[best]
        left -= startup_cost(plan[best]) + min_fuzz_s
    return sorted((plan[i] for i in chosen), key=startup_cost) or plan[:1]
