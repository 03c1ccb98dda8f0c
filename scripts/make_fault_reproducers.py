"""Write one minimal reproducer per registry fault to reproducers/faults/<fault>.json.

Each seed Case below is a hand-made small Case where the fault is reachable; it is then
minimized with `fuzz.campaign.shrink.minimize` against "still fails with the same property", and
checked to pass with the fault off. Run: `python scripts/make_fault_reproducers.py`.

The prefix-caching, abort and sampling faults have no seed here: their files are the minimal
reproducers an fp32 `llmfuzz selftest` wrote, each checked to fail with the property it
recorded and to pass with the fault off.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.schedule import Schedule  # noqa: E402
from fuzz.cases.case import Case, RequestSpec, Workload  # noqa: E402
from fuzz.verdict.harness import Harness  # noqa: E402
from fuzz.verdict.properties import Violation  # noqa: E402
from fuzz.campaign.reproduce import write_reproducer  # noqa: E402
from fuzz.campaign.shrink import minimize  # noqa: E402
from fuzz.cases.strategies import FUZZ_MODEL  # noqa: E402


def R(n: int, max_tokens: int = 2, arrival: int = 0, tok: int = 1) -> RequestSpec:
    return RequestSpec(tuple((tok + i) % 128 for i in range(n)), max_tokens, arrival)


G = dict(cudagraph_mode="FULL", capture_sizes=(4, 8, 16, 32))
SEEDS = {
    "graph_stale_max_seqlen": Case(FUZZ_MODEL.replace(**G), Workload((R(1, 2),))),
    "pp_shared_staging_buffer": Case(FUZZ_MODEL.replace(layout="tp1pp2", max_num_batched_tokens=5),
                                     Workload((R(3), R(9), R(2))),
                                     Schedule(seed=1, copy_delay=0.9, prepare_ahead=1.0)),
    "stale_query_start_loc_tail": Case(FUZZ_MODEL.replace(**G), Workload((R(1),))),
    "sp_residual_copy_len": Case(FUZZ_MODEL.replace(layout="tp2pp2", sequence_parallel=True), Workload((R(2),))),
    # A race since in-compute copies land at once unless the Schedule delays them.
    "intermediate_copy_unsynced": Case(FUZZ_MODEL.replace(layout="tp1pp3"), Workload((R(1),)),
                                       Schedule(copy_delay=0.5)),
    "pp_uneven_partition": Case(FUZZ_MODEL.replace(layout="tp1pp3"), Workload((R(1),))),
    "pp_allgather_non_replicated": Case(FUZZ_MODEL.replace(layout="tp2pp2", sequence_parallel=True),
                                        Workload((R(2),))),
    "pp_logits_not_broadcast": Case(FUZZ_MODEL.replace(layout="tp1pp2", broadcast_pp_output=True),
                                    Workload((R(1),))),
    "reorder_partial_swap": Case(FUZZ_MODEL.replace(max_num_batched_tokens=16, **G),
                                 Workload((RequestSpec(tuple(range(1, 22)), 1, 0), R(1, 1)))),
    "pp_stale_new_token_ids": Case(FUZZ_MODEL.replace(layout="tp1pp2"), Workload((R(1),))),
    "capture_metadata_baked": Case(FUZZ_MODEL.replace(**G), Workload((R(1, 3), R(2, 2, 1)))),
    "spec_rollback_missing": Case(FUZZ_MODEL.replace(speculative_method="ngram", num_speculative_tokens=1),
                                  Workload((RequestSpec(tuple(range(40)), 4, 0),))),
    # A 2-token prompt admitted with a 1-token one: reorder_batch swaps them (one-token rows
    # first), then the first decodes ahead and reads the row the second sampled in.
    "async_placeholder_not_replaced": Case(FUZZ_MODEL.replace(async_scheduling=True),
                                           Workload((R(2, 2), R(1, 1, 0, 98)))),
    # Caught by the determinism oracle's re-run under another rank order (every short tp >= 3 Case).
    "allreduce_arrival_order": Case(FUZZ_MODEL.replace(layout="tp4pp1"), Workload((R(1),))),
    "split_k_by_batch_size": Case(FUZZ_MODEL, Workload((R(1),))),
    # pp2 alternates r0+r1 and the extra r2 in two microbatches: outputs stay bit-identical.
    "sched_max_num_seqs_off_by_one": Case(FUZZ_MODEL.replace(layout="tp1pp2", max_num_seqs=2,
                                                             max_num_batched_tokens=8),
                                          Workload((R(4, 4), R(4, 4, tok=9), R(3, 4, tok=17)))),
    # Budget 3: the first decode takes 1 token, the second (its prompt repeats: drafts) the rest.
    # Every step schedules ahead (the default Schedule): the depth check names the first one.
    "async_queue_depth_ignored": Case(FUZZ_MODEL.replace(async_scheduling=True), Workload((R(1, 2),))),
    "sched_drafts_over_budget": Case(FUZZ_MODEL.replace(speculative_method="ngram", num_speculative_tokens=2,
                                                        max_num_batched_tokens=3),
                                     Workload((RequestSpec((5,), 12, 0), RequestSpec((1, 2, 1, 2, 1, 2), 12, 0)))),
}


def main() -> int:
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reproducers", "faults")
    h = Harness()
    ok = True
    try:
        for fault, seed in SEEDS.items():
            if fault not in sys.argv[1:] and len(sys.argv) > 1:
                continue
            case = replace(seed, faults=(fault,))
            try:
                h.check(case)
                print(f"{fault}: seed case does not fail", flush=True)
                ok = False
                continue
            except Violation as v:
                prop = v.property
            last = {}

            def still_fails(c) -> bool:
                try:
                    h.check(c)
                    return False
                except Violation as w:
                    if w.property == prop:
                        last["v"] = w
                        return True
                    return False

            small, checks = minimize(case, still_fails, max_checks=1000)
            still_fails(small)
            h.check(replace(small, faults=()))  # passes with the fault off
            v = last["v"]
            path = write_reproducer(out, small, v.property, v.message, v.error_ratio)
            final = os.path.join(out, f"{fault}.json")
            os.replace(path, final)
            os.rmdir(os.path.dirname(path)) if not os.listdir(os.path.dirname(path)) else None
            print(json.dumps({"fault": fault, "checks": checks, "case": small.describe(), "property": v.property}),
                  flush=True)
    finally:
        h.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
