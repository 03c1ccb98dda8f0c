"""Replay the CPU fault reproducers on CUDA with real kernels (torch_flash, bf16), each in
the isolated harness, with the fault on and off: does each still show, and how."""
import dataclasses, json, sys, time

from fuzz.verdict.isolated import IsolatedHarness
from fuzz.verdict.properties import Violation
from fuzz.campaign.reproduce import load_reproducer

FAULTS = sys.argv[1:] or ["graph_stale_max_seqlen", "pp_shared_staging_buffer",
                          "stale_query_start_loc_tail", "intermediate_copy_unsynced"]
h = IsolatedHarness()
rows = []
for name in FAULTS:
    case = load_reproducer(f"reproducers/faults/{name}.json").case
    for backend, dtype in (("reference", "float32"), ("torch_flash", "bfloat16")):
        cfg = case.config.replace(device="cuda", attention_backend=backend, dtype=dtype)
        for faults in (case.faults, ()):
            c = dataclasses.replace(case, config=cfg, faults=faults)
            t0 = time.perf_counter()
            try:
                v = h.check(c)
                res = {"verdict": "pass", "ratio": v.logits.ratio}
            except Violation as e:
                res = {"verdict": e.property, "message": e.message[:200]}
            res.update(fault=name, on=bool(faults), backend=backend, seconds=round(time.perf_counter() - t0, 2),
                       starts=h.starts)
            print(json.dumps(res), flush=True)
            rows.append(res)
h.close()
