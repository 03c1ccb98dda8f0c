"""N shards of `--jobs J` at once against one `--jobs N*J` run of the same budget, on one host.

    python bench/shard_scaling.py [--shards 4] [--jobs 4] [--budget 120] [--seed 3]
                                  [--fault pp_uneven_partition] [--fault-budget 40] [--out DIR]

Prints one JSON object:
- `one`: examples of `llmfuzz run --jobs N*J`; `shards`: each shard's examples; `ratio`:
  sum over the shards / one run (what N machines of J cores give against one of N*J);
- `per_cell_equal`: whether `llmfuzz merge`'s per-cell totals equal the sum of the shards';
- `fault`: the same shards with a registered fault on: each shard's failures, and the
  reproducers the merge keeps (one bug: one reproducer).
The shards run as N processes at once on this host: what a CI matrix of N runners does,
less the machines.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

CLI = [sys.executable, "-m", "fuzz.cli"]


def _run(args: list[str], out: str) -> subprocess.Popen:
    log = open(out + ".log", "w")
    return subprocess.Popen(CLI + args + ["--json", "--out", out], stdout=subprocess.PIPE,
                            stderr=log, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[dict]:
    docs = []
    for p in procs:
        text, _ = p.communicate()
        docs.append(json.loads(text) if text.strip() else {"error": f"exit {p.returncode}"})
    return docs


def _shards(base: list[str], n: int, jobs: int, tmp: str, tag: str) -> tuple[list[dict], list[str], float]:
    t0 = time.time()
    paths = [os.path.join(tmp, f"{tag}{k}") for k in range(1, n + 1)]
    docs = _finish([_run(base + ["--jobs", str(jobs), "--shard", f"{k}/{n}"], p)
                    for k, p in zip(range(1, n + 1), paths)])
    files = []
    for p, doc in zip(paths, docs):
        with open(p + ".json", "w") as f:
            json.dump(doc, f)
        files.append(p + ".json")
    return docs, files, time.time() - t0


def _merge(files: list[str]) -> dict:
    out = subprocess.run(CLI + ["merge", *files, "--json"], capture_output=True, text=True)
    return json.loads(out.stdout) if out.stdout.strip() else {"error": out.stderr[-400:]}


def _cells_sum(docs: list[dict]) -> Counter:
    total = Counter()
    for d in docs:
        for cell, st in (d.get("per_cell") or {}).items():
            total[cell] += st.get("examples", 0)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--budget", type=int, default=120)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--shrink-budget", type=int, default=20)
    ap.add_argument("--fault", default="pp_uneven_partition")
    ap.add_argument("--fault-budget", type=int, default=40)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="shard-scaling-")
    base = ["run", "--budget", str(a.budget), "--seed", str(a.seed), "--shrink-budget", str(a.shrink_budget)]
    t0 = time.time()
    one = _finish([_run(base + ["--jobs", str(a.shards * a.jobs)], os.path.join(tmp, "one"))])[0]
    one_s = time.time() - t0
    docs, files, shards_s = _shards(base, a.shards, a.jobs, tmp, "shard")
    merged = _merge(files)
    fbase = ["run", "--budget", str(a.fault_budget), "--seed", str(a.seed), "--fault", a.fault,
             "--shrink-budget", str(a.shrink_budget)]
    fdocs, ffiles, _ = _shards(fbase, a.shards, a.jobs, tmp, "fault")
    fmerged = _merge(ffiles)
    shard_examples = [d.get("examples", 0) for d in docs]
    print(json.dumps({
        "command": "python bench/shard_scaling.py " + " ".join(sys.argv[1:]),
        "host_cores": os.cpu_count(), "shards": a.shards, "jobs_per_shard": a.jobs, "budget_s": a.budget,
        "one": {"jobs": a.shards * a.jobs, "examples": one.get("examples"), "failures": one.get("failures"),
                "wall_s": round(one_s, 1), "per_cell": {c: s.get("examples") for c, s in (one.get("per_cell") or {}).items()}},
        "shard_runs": {"examples": shard_examples, "failures": [d.get("failures") for d in docs],
                       "wall_s": round(shards_s, 1)},
        "ratio": round(sum(shard_examples) / one["examples"], 3) if one.get("examples") else None,
        "merged_examples": merged.get("examples"),
        "per_cell_equal": dict(_cells_sum([merged])) == dict(_cells_sum(docs)),
        "fault": {"name": a.fault, "budget_s": a.fault_budget,
                  "shard_failures": [d.get("failures") for d in fdocs],
                  "shard_reproducers": [len(d.get("reproducers") or []) for d in fdocs],
                  "merged_failures": fmerged.get("failures"),
                  "merged_reproducers": fmerged.get("reproducers")},
    }, indent=1))


if __name__ == "__main__":
    main()
