"""The worker's side of `llmfuzz run --jobs N` (fuzz.campaign.jobs is the parent's): its plan, its
share of the campaign, its report, and how the parent merges the reports into one Summary.

A worker is `python -m fuzz.cli run --worker-plan PLAN.json`: the plan holds the parent's
`run` arguments (so a worker fuzzes exactly what `--jobs 1` would, on its layouts) and its
share (`Share`): the whole campaign's cell count (chunk sizes and the first round are the
campaign's, so a cell draws the same Cases in any worker), which chunks of its cell it runs
when it shares one, the claims on the shared reproducer directory, and the file whose
existence ends every worker at its next chunk (stop-on-failure across workers). The report
is its Summary in full, written atomically when its campaign ends, interrupted or not.
Merged, two workers' failures with one reproducer file are one failure and a repeat.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from fuzz.campaign.recorder import Claims
from fuzz.campaign.summary import summary_doc

# Parent arguments a worker does not take as they are: it runs in-process on its own share.
NOT_PASSED = ("fn", "jobs", "worker_plan", "layouts", "json", "quiet", "shard", "cluster", "contention")


@dataclass
class Share:
    cells_total: int  # the whole campaign's cells
    stream: int = 0  # this worker runs chunks stream, stream + streams, ... of each of its cells
    streams: int = 1
    end_file: str | None = None
    claims: Claims | None = None
    report_path: str | None = None
    positions: dict | None = None  # a sequential target's cells: name -> place in the whole campaign

    def ended(self) -> bool:
        return self.end_file is not None and os.path.exists(self.end_file)

    def end_all(self) -> None:
        if self.end_file is not None:
            with open(self.end_file, "a"):
                pass

    def report(self, summary, shrink_report: dict | None) -> None:
        doc = summary_doc(summary, shrink_report)
        tmp = f"{self.report_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.report_path)  # the parent never reads half a report


def plan_args(args) -> dict:
    """The parent's `run` arguments a plan carries (JSON values only)."""
    return {k: v for k, v in vars(args).items()
            if k not in NOT_PASSED and isinstance(v, (str, int, float, bool, list, type(None)))}


def worker_args(args) -> tuple[argparse.Namespace, Share | None]:
    """`run --worker-plan FILE`: the arguments and share the plan gives this worker; any other
    `run`: the arguments as they are, no share."""
    if not getattr(args, "worker_plan", None):
        return args, None
    with open(args.worker_plan) as f:
        plan = json.load(f)
    _die_with(plan["parent_pid"])
    ns = argparse.Namespace(**{**vars(args), **plan["args"]})
    ns.layouts, ns.jobs, ns.worker_plan = ",".join(plan["layouts"]), "1", args.worker_plan
    # Its stdout is not read (the report is); its progress and FOUND lines go to the parent.
    ns.json = ns.quiet = not plan["progress"]
    run_dir = plan["run_dir"]
    share = Share(plan["cells_total"], plan["stream"], plan["streams"], os.path.join(run_dir, "end"),
                  Claims(run_dir, f"w{plan['worker']}"), os.path.join(run_dir, f"w{plan['worker']}.json"))
    return ns, share


def read_report(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _die_with(parent_pid: int) -> None:
    """A SIGTERM (a stop: the report is written) when the parent dies, even by SIGKILL: no
    orphan fuzzes on. Linux only; elsewhere workers end at their budget."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the prctl took hold
        os.kill(os.getpid(), signal.SIGTERM)


def merge_reports(reports: list, *, budget_s: float, seed: int, target=None):
    """The parent's Summary of its workers' reports ((index, part, report or None) each) and
    the shrink phases' report together. Counts are sums; a failure whose file another worker
    also reports is one failure and a repeat (the first found is kept)."""
    from fuzz.campaign.summary import CellStats, Failure, Summary

    s = Summary(planned=[lay for _, part, _ in reports for lay in part["layouts"]], budget_s=budget_s, seed=seed,
                target=target, jobs=len(reports))
    failures, phases = [], []
    for index, part, r in reports:
        s.workers.append({"worker": index, "layouts": part["layouts"], "stream": f"{part['stream']}/{part['streams']}",
                          "status": "ok" if r is not None else "no report",
                          "examples": r["examples"] if r else 0, "seconds": round(r["seconds"], 2) if r else None})
        if r is None:
            continue
        s.examples += r["examples"]
        s.duplicates += r["duplicates"]
        s.write_errors += r["write_errors"]
        s.repeats += r["repeats"]
        s.interrupted = s.interrupted or r["interrupted"]
        if r["first_failure_s"] is not None and (s.first_failure_s is None or r["first_failure_s"] < s.first_failure_s):
            s.first_failure_s, s.first_failure_examples = r["first_failure_s"], r["first_failure_examples"]
        for key, row in r["cells"]:
            _add_row(s.cells.setdefault(tuple(key), CellStats()), row)
        failures += [Failure(**f) for f in r["failures"]]
        if r["shrink_phase"]:
            phases.append(r["shrink_phase"])
    for f in sorted(failures, key=lambda f: (f.seconds_to_find is None, f.seconds_to_find or 0.0)):
        if any(g.path == f.path for g in s.failures if f.path is not None):
            s.repeats += 1
            row = s.cells.get(tuple(f.meta.get("counted_in") or ()))
            if row is not None and row.failures > 0:
                row.failures -= 1
        else:
            s.failures.append(f)
    shrink = None
    if phases:
        shrink = {"budget_s": max(p["budget_s"] for p in phases), "seconds": max(p["seconds"] for p in phases),
                  "failures": sum(p["failures"] for p in phases), "minimal": sum(p["minimal"] for p in phases),
                  "interrupted": any(p["interrupted"] for p in phases)}
    return s, shrink


def _add_row(into, row: dict) -> None:
    from fuzz.campaign.summary import add_measured

    for k in ("examples", "seconds", "engine_seconds", "failures", "repeats"):
        setattr(into, k, getattr(into, k) + row[k])
    into.stopped = into.stopped or row["stopped"]
    into.unsupported = into.unsupported or row["unsupported"]
    into.known += row["known"]
    add_measured(into, row)  # error/tolerance by decade, its maximum, dtype, case classes
    for k, v in row["notes"].items():  # a target's measurements: numbers add up, the rest is the first's
        if isinstance(v, (int, float)) and isinstance(into.notes.get(k, 0), (int, float)):
            into.notes[k] = into.notes.get(k, 0) + v
        else:
            into.notes.setdefault(k, v)
