"""`llmfuzz bench [--json] [--quick]`: the fuzzer's own speed, measured on this machine.

Figures (each a median of several runs where it is cheap enough):
- examples/s per layout x mode (in-process ranks, one gloo world, the GPU when there is one;
  the campaign's own accounting);
- efficiency per in-process cell: a raw forward's time for every forward the examples ran
  over their whole time, and where the rest went (bench.efficiency);
- harness overhead: wall time per fuzz example divided by the engine work of the same Cases
  run bare (engine steps only: no reference run, no properties, no Hypothesis);
- `pytest -n 2` speed-up over `-n 1` on the property tests (tests/fuzz/verdict/test_properties.py);
- time to first detection and total time (incl. shrinking) for a few faults;
- the logits check's margin in bf16 and fp16: clean runs' largest error/tolerance beside the
  ratio of each fault's minimal reproducer (`bench.margin`);
- graph mode's capture cost: make_fx traces run and reused (engine/cpu_graph.py) in each
  graph cell, from an empty trace cache;
- peak resident memory of this process and of its children.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from bench import emit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (layout, mode, where): "inproc" ranks are threads of this process, "gloo" ranks are
# torch.distributed processes, "cuda" runs on the GPU (bf16, torch_flash) when there is one.
CELLS = (("tp1pp1", "eager", "inproc"), ("tp1pp1", "graph", "inproc"), ("tp2pp4", "eager", "inproc"),
         ("tp2pp4", "graph", "inproc"), ("tp1pp8", "eager", "inproc"), ("tp1pp8", "graph", "inproc"),
         ("tp8pp1", "eager", "inproc"), ("tp1pp2", "eager", "gloo"))
CUDA_CELLS = (("tp1pp1", "eager", "cuda"), ("tp1pp1", "graph", "cuda"), ("tp2pp4", "eager", "cuda"),
              ("tp1pp8", "graph", "cuda"))


def _base(where: str):
    from fuzz.cases.strategies import FUZZ_MODEL

    if where == "gloo":
        return FUZZ_MODEL.replace(world="torch")
    if where == "cuda":
        return FUZZ_MODEL.replace(device="cuda", dtype="bfloat16", attention_backend="torch_flash")
    return FUZZ_MODEL
BENCH_FAULTS = ("pp_stale_new_token_ids", "graph_stale_max_seqlen", "intermediate_copy_unsynced")


def _examples_per_s(layout: str, mode: str, where: str, budget: float, harness,
                    measure: bool = False) -> tuple[dict, list]:
    from bench.efficiency import Meter
    from fuzz.campaign.loop import Campaign

    seen = []
    camp = Campaign(layouts=(layout,), modes=(mode,), budget_s=budget, progress=False, harness=harness,
                    base=_base(where), out_dir=os.path.join("bench-out", "reproducers"))
    orig = camp._body

    def body(case):
        n0 = camp.summary.examples
        try:
            return orig(case)
        finally:
            if camp.summary.examples > n0:  # examples skipped past the deadline do not count
                seen.append(case)
    camp._body = body
    meter = Meter().install() if measure else None
    try:
        s = camp.run()
    finally:
        if meter is not None:
            meter.remove()
    cell = {"layout": layout, "mode": mode, "world": where, "examples": s.examples, "seconds": round(s.seconds, 2),
            "examples_per_s": round(s.examples / s.seconds, 3) if s.seconds else None,
            "failures": len(s.failures)}
    if meter is not None and where == "inproc":  # other worlds' ranks run outside this process
        cell.update(meter.report(_base(where), s.examples, s.seconds))
    return cell, seen


def _bare_seconds(cases: list, harness) -> float:
    """Engine steps only, on the same warm engines: the denominator of the overhead."""
    from fuzz.verdict.runner import drive

    t0 = time.perf_counter()
    for case in cases:
        drive(harness.pool.get(case.config), case, case.schedule, case.faults, None)
    return time.perf_counter() - t0


def _pytest_speedup() -> dict:
    # Each pytest start (imports, xdist workers) costs ~7-8 s whatever the -n: the slice must
    # hold a minute or more of test work for the speed-up to measure parallelism at all. The
    # whole file, quick or not: without its tp8 tests (~10 s of work) `-n 2` ended no sooner,
    # one worker idle at the end (measured idle: 69 s / 41 s = 1.68 without, 79 s / 44 s = 1.80 with).
    out = {}
    for n in (1, 2):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(n), "--dist", "worksteal",
               os.path.join(REPO, "tests", "fuzz", "verdict", "test_properties.py")]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, LLMFUZZ_PROFILE="ci"))
        out[f"n{n}_seconds"] = round(time.perf_counter() - t0, 2)
        out[f"n{n}_ok"] = r.returncode == 0
    out["speedup"] = round(out["n1_seconds"] / out["n2_seconds"], 2) if out["n2_seconds"] else None
    out["selection"] = "tests/fuzz/verdict/test_properties.py"
    return out


def run_bench(quick: bool = False, progress: bool = True) -> dict:
    from fuzz import profiles
    from fuzz.verdict.harness import Harness
    from fuzz.campaign.selftest import run_selftest

    import torch

    profiles.load("dev")
    budget = 6.0 if quick else 20.0
    t_all = time.perf_counter()
    harness = Harness()
    try:
        cells, overhead = _speed_cells(harness, CELLS + (CUDA_CELLS if torch.cuda.is_available() else ()),
                                       budget, progress)
    finally:
        harness.close()
    # Quick: each fault is found in under 5 s (idle 2 cores); the budget and grace cap the
    # shrink that follows at 20 s (a shrink of intermediate_copy_unsynced ran to 54 s with
    # 30 + 20), so quick shrink times are lower bounds; the full bench lets shrinks finish.
    faults = run_selftest(list(BENCH_FAULTS), budget_per_fault=15.0 if quick else 60.0,
                          out_dir=os.path.join("bench-out", "faults"), progress=False,
                          shrink_grace_s=5.0 if quick else None)
    margins = _precision_margins(quick, progress)
    speed = _pytest_speedup()
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "examples_per_s": cells,
        "harness_overhead_median": statistics.median(overhead) if overhead else None,
        "detection": [{"fault": r.name, "detected": r.detected, "seconds_to_first_failure": r.seconds,
                       "examples": r.examples, "seconds_incl_shrink": r.total_seconds,
                       "shrunk_requests": r.requests, "shrunk_tokens": r.tokens, "layout": r.layout}
                      for r in faults],
        "precision_margin": margins,
        "pytest_parallel": speed,
        "peak_rss_mb": {"self": round(me, 1), "children": round(kids, 1)},
        "seconds": round(time.perf_counter() - t_all, 1),
    }


def _speed_cells(harness, cells_to_run: tuple, budget: float, progress: bool) -> tuple[list, list]:
    """examples/s per (layout, mode, where), and each cell's harness overhead; returns
    (cells, the in-process cells' overheads)."""
    from engine import cpu_graph

    cells, overhead = [], []
    for layout, mode, where in cells_to_run:
        # Warm-up pass (engine start-up, graph capture: its first example always runs in
        # full), then the measured pass. Traces start from an empty cache in each cell; a
        # graph cell's warm-up is as long as its measured pass, since a campaign pays each
        # trace once and then replays it (`graph_capture`: the traces of each pass).
        cpu_graph.clear_templates()
        before = dict(cpu_graph.STATS)
        graph = mode == "graph" and where != "cuda"
        _examples_per_s(layout, mode, where, budget if graph else 1.0, harness)
        warm = dict(cpu_graph.STATS)
        cell, cases = _examples_per_s(layout, mode, where, budget, harness, measure=True)
        if graph:
            cell["graph_capture"] = {"warm_up": {k: round(warm[k] - before[k], 3) for k in before},
                                     "measured": {k: round(cpu_graph.STATS[k] - warm[k], 3) for k in before}}
        cells.append(cell)
        bare = _bare_seconds(cases, harness) if cases else 0.0
        if bare > 0:
            per_example = cell["seconds"] / len(cases)
            cell["bare_engine_s_per_example"] = round(bare / len(cases), 4)
            cell["harness_overhead"] = round(per_example / (bare / len(cases)), 2)
            if where == "inproc":  # the target is about the CPU in-process harness
                overhead.append(cell["harness_overhead"])
        if progress:
            print(json.dumps(cell), file=sys.stderr)
    return cells, overhead


def _precision_margins(quick: bool, progress: bool) -> list[dict]:
    """The logits check's margin per half dtype: clean runs' largest error/tolerance beside
    each fault's (its committed minimal reproducer replayed in that dtype)."""
    from bench.margin import measure_margin
    from fuzz.cases.strategies import FUZZ_MODEL

    margins = [measure_margin(FUZZ_MODEL.replace(dtype=d), examples=2 if quick else 6)
               for d in ("bfloat16", "float16")]
    if progress:
        for m in margins:
            print(json.dumps({k: m[k] for k in ("dtype", "clean_max_ratio", "smallest_logits_fault_ratio")}),
                  file=sys.stderr)
    return margins


def cmd_bench(args) -> int:
    return emit(run_bench(quick=args.quick, progress=not args.json), args.out)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure examples/s, harness overhead, detection times (JSON)")
    b.add_argument("--json", action="store_true", help="no progress lines, JSON only")
    b.add_argument("--quick", action="store_true", help="shorter budgets (under 5 minutes on 2 idle cores)")
    b.add_argument("--out", default="", help="also write the JSON here")
    b.set_defaults(fn=cmd_bench)
