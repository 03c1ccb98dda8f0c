"""Sensitivity of the logits check to a subtle bug: a decode token attends to one wrong KV row
(position 10 reads position 30's K/V, in every layer) in a 50-token context, in the test run
only. Prints the largest error/tolerance over the oracles per dtype and prompt seed (>1 is
caught). Not a registry fault: a measurement of the harness.

    python bench/wrong_kv_row.py > bench/results/wrong_kv_row_cpu.json
"""
import json

import engine.custom_ops as co
from fuzz.cases.case import Case, RequestSpec, Workload
from fuzz.verdict.harness import Harness
from fuzz.verdict.properties import LogitsMismatch, check_logits
from fuzz.cases.strategies import FUZZ_MODEL, tokens_from_seed

real = co.varlen_attention
ON = [False]  # the bug is on in the test run only


def wrong_row(q, k_cache, v_cache, cu, max_q, seq_lens, max_k, bt, scale, *a, **kw):
    if not ON[0] or q.shape[0] != 1 or int(seq_lens[0]) < 40:
        return real(q, k_cache, v_cache, cu, max_q, seq_lens, max_k, bt, scale, *a, **kw)
    bs = k_cache.shape[1]

    def slot(p):
        return int(bt[0, p // bs]) * bs + p % bs
    kf, vf = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    a_, b_ = slot(10), slot(30)
    saved = kf[a_].clone(), vf[a_].clone()
    kf[a_], vf[a_] = kf[b_], vf[b_]
    try:
        return real(q, k_cache, v_cache, cu, max_q, seq_lens, max_k, bt, scale, *a, **kw)
    finally:
        kf[a_], vf[a_] = saved


co.varlen_attention = wrong_row
out = {}
for dtype in ("float32", "bfloat16", "float16"):
    h = Harness(2)
    rs = []
    for seed in range(6):
        case = Case(FUZZ_MODEL.replace(dtype=dtype), Workload((RequestSpec(tokens_from_seed(seed, 50, 128), 3),)))
        ref = h.reference(case)  # before the bug goes on: the reference stays correct
        ON[0] = True
        try:
            test = h.run_case(case)
        finally:
            ON[0] = False
        traces, tol = h.oracle_traces(case, ref.output_token_ids())
        worst = 0.0
        for name, trace in {"reference": ref, **traces}.items():
            try:
                worst = max(worst, check_logits(case, trace, test, tol, name).ratio)
            except LogitsMismatch as e:
                worst = max(worst, e.error_ratio)
        rs.append(worst)
    out[dtype] = [round(r, 3) for r in rs]
    h.close()
print(json.dumps({"what": __doc__, "error_over_tolerance_per_seed": out}, indent=1))
