"""`llmfuzz run --jobs 1` against `--jobs N`: examples/s, and the reproducers each finds.

    python bench/jobs_scaling.py --jobs 16 --budget 60 > jobs16.json

Two pairs of runs, the same seed and budget in each pair:
- clean (no fault): examples/s of each, and the ratio. `examples_per_s` is the summary's
  (examples over the campaign's seconds, start-up excluded, as `llmfuzz run` reports it);
  `examples_per_wall_s` divides by the whole command's wall time, start-ups included.
- with a registry fault on (`--fault`, `--keep-going`: both fuzz their whole budget): the
  reproducer files each wrote (name = property/Case-hash.json, and the hash of the Case
  inside), and whether the sets are the same. A cell's chunks draw the same Cases whatever
  N (fuzz.campaign.loop.chunk_seed), but N workers run about N times as many chunks per cell in
  the budget, so `--jobs N` can find more: `jobs1_within_jobsN` is the determinism check,
  `same` holds when the extra chunks found nothing new (or minimized onto the same files).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(jobs: int, a, out: str, fault: str | None) -> dict:
    cmd = [sys.executable, "-m", "fuzz.cli.main", "run", "--jobs", str(jobs), "--budget", f"{a.budget:g}", "--seed",
           str(a.seed), "--modes", a.modes, "--out", out, "--json", "--shrink-budget", f"{a.shrink_budget:g}"]
    if a.layouts:
        cmd += ["--layouts", a.layouts]
    if fault:
        cmd += ["--fault", fault, "--keep-going"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    wall = time.monotonic() - t0
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"jobs_scaling: `{' '.join(cmd[2:])}` exited {proc.returncode}")
    doc = json.loads(proc.stdout)
    return {"jobs": jobs, "examples": doc["examples"], "seconds": doc["seconds"],
            "examples_per_s": round(doc["examples"] / doc["seconds"], 3) if doc["seconds"] else None,
            "wall_s": round(wall, 1), "examples_per_wall_s": round(doc["examples"] / wall, 3),
            "failures": doc["failures"], "repeats": doc.get("repeats", 0), "cells": len(doc["per_cell"]),
            "workers": [{k: w.get(k) for k in ("layouts", "stream", "examples", "status")}
                        for w in doc.get("workers", [])]}


def reproducers(out: str) -> list[dict]:
    """Each file under `out`: its name and the hash of the Case it holds."""
    rows = []
    for root, _, files in os.walk(out):
        for name in sorted(files):
            if not name.endswith(".json") or name.startswith("."):
                continue
            path = os.path.join(root, name)
            with open(path) as f:
                doc = json.load(f)
            case = json.dumps(doc["case"], sort_keys=True, separators=(",", ":"))
            rows.append({"file": os.path.relpath(path, out),
                         "case_sha256": hashlib.sha256(case.encode()).hexdigest()[:16],
                         "minimal": doc.get("minimal"), "layout": "tp{tensor_parallel_size}pp{pipeline_parallel_size}"
                         .format(**doc["case"]["config"]),
                         "mode": "eager" if doc["case"]["config"].get("cudagraph_mode") == "NONE" else "graph"})
    return sorted(rows, key=lambda r: r["file"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="N (default: the cores available)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per run (default 60)")
    ap.add_argument("--shrink-budget", type=float, default=60.0, help="each run's shrink phase (default 60)")
    ap.add_argument("--layouts", default="", help="comma list (default: all)")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault", default="pp_uneven_partition", help="registry fault for the reproducer sets ('': skip)")
    ap.add_argument("--no-clean", action="store_true", help="skip the clean pair (throughput)")
    a = ap.parse_args()
    if a.jobs < 2:
        raise SystemExit("jobs_scaling: --jobs must be 2 or more (it is compared with --jobs 1)")
    res: dict = {"machine": {"cores": len(os.sched_getaffinity(0)), "loadavg_before": os.getloadavg()[0]},
                 "budget_s": a.budget, "seed": a.seed, "layouts": a.layouts or "all", "modes": a.modes}
    with tempfile.TemporaryDirectory(prefix="jobs-scaling-") as tmp:
        if not a.no_clean:
            one, many = (run(n, a, os.path.join(tmp, f"clean{n}"), None) for n in (1, a.jobs))
            res["clean"] = {"jobs_1": one, f"jobs_{a.jobs}": many,
                            "ratio_examples_per_s": round(many["examples_per_s"] / one["examples_per_s"], 2),
                            "ratio_examples_per_wall_s":
                                round(many["examples_per_wall_s"] / one["examples_per_wall_s"], 2)}
        if a.fault:
            found = {}
            for n in (1, a.jobs):
                out = os.path.join(tmp, f"fault{n}")
                found[n] = (run(n, a, out, a.fault), reproducers(out))
            ones = {(r["file"], r["case_sha256"]) for r in found[1][1]}
            manys = {(r["file"], r["case_sha256"]) for r in found[a.jobs][1]}
            res["fault"] = {"fault": a.fault, "jobs_1": {**found[1][0], "reproducers": found[1][1]},
                            f"jobs_{a.jobs}": {**found[a.jobs][0], "reproducers": found[a.jobs][1]},
                            "same": ones == manys, "jobs1_within_jobsN": ones <= manys,
                            "only_jobs_1": sorted(f for f, _ in ones - manys),
                            f"only_jobs_{a.jobs}": sorted(f for f, _ in manys - ones)}
    res["machine"]["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
