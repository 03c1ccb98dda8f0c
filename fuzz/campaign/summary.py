"""What a campaign reports: per-cell statistics, failures, the summary, and the example
database as one cell sees it. Targets add their measurements (Target.record, cell_done)."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from hypothesis.database import ExampleDatabase

from fuzz.cases.limits import LIMITS
from fuzz.report.svg import DECADE_KEYS, decade_key, ratio_text


@dataclass
class CellStats:
    """One cell's row of the summary: what ran, for how long, what failed and why it stopped."""

    examples: int = 0  # Cases checked while finding (a shrink's candidates are `shrink_checks`)
    seconds: float = 0.0
    engine_seconds: float = 0.0
    failures: int = 0
    stopped: str = ""  # why the cell ended early (a crash, a known failure, an engine that refused it)
    unsupported: str = ""  # the engine refused the cell's config by design
    known: list = field(default_factory=list)  # signatures of known failures met
    repeats: int = 0  # failures of a property the cell had already reported (not written again)
    notes: dict = field(default_factory=dict)  # what the target measured (Target.record, cell_done)
    # Per example that passed (`note_example`): the dtype it ran in, its error/tolerance as a
    # count per decade (fuzz.report.svg.DECADE_KEYS: a long run's ratios in a few numbers) and
    # the largest, and the case classes its strategy labelled with event().
    dtype: str = ""
    ratio_hist: dict = field(default_factory=dict)
    ratio_max: float | None = None
    events: dict = field(default_factory=dict)
    # Checks run to shrink the row's failures (Hypothesis' shrink, the minimizer, the shrink
    # phase), and their seconds: apart from `examples`, so a crash's shrink does not read as depth.
    shrink_checks: int = 0
    shrink_seconds: float = 0.0

    def add_shrink(self, checks: int, seconds: float) -> None:
        self.shrink_checks += checks
        self.shrink_seconds += seconds

    def visited(self) -> bool:
        """Whether the row checked an example: a config started or refused with none is not visited."""
        return self.examples > 0


def row_name(key: tuple) -> str:
    """A summary row's key as the tables print it: "layout/mode", or a config's name alone."""
    return "/".join(k for k in key if k)


def visited(cells: dict) -> list[str]:
    """The cells (a row key's first part: a layout, a config) with a row that checked an example."""
    return sorted({k[0] for k, c in cells.items() if c.visited()})


def not_visited(cells: dict, planned=()) -> list[str]:
    """The rows with no example checked (refused, failed to start, out of time), by `row_name`,
    then the `planned` cells with no row at all (never reached)."""
    rows = [row_name(k) for k, c in cells.items() if not c.visited()]
    return rows + [n for n in planned if n not in {k[0] for k in cells}]


def prefix_caching_row(c: CellStats) -> dict:
    """A row's prefix-caching reach (HarnessTarget.record's notes), where it ran a Case with
    caching on: how many, and the share of looked-up prompt tokens found cached."""
    n = c.notes
    if not n.get("prefix_caching_cases"):
        return {}
    q, h = n.get("prefix_queried_tokens", 0), n.get("prefix_hit_tokens", 0)
    return {"prefix_caching_cases": n["prefix_caching_cases"], "prefix_hit_rate": round(h / q, 3) if q else None}


def async_overlap_row(c: CellStats) -> dict:
    """A row's async-scheduling overlap (HarnessTarget.record's notes), where it ran a Case
    with async scheduling: how many, and the share of their steps run ahead of a step in flight."""
    n = c.notes
    if not n.get("async_cases"):
        return {}
    total = n.get("async_all_steps", 0)
    return {"async_cases": n["async_cases"],
            "async_overlap": round(n.get("async_steps", 0) / total, 3) if total else None}


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 3) if whole else None


def reach_row(c: CellStats) -> dict:
    """What a row's passing Cases reached (HarnessTarget.record's notes; {} for a target that
    does not count them): the share of requests with sampling params, with random sampling
    and with penalties; the share of Cases with an abort and with a preemption; how many of
    the config limits (fuzz.cases.limits.LIMITS) some Case reached, and per limit the share of
    Cases that reached it."""
    n = c.notes
    cases, reqs = n.get("cases", 0), n.get("requests", 0)
    if not cases:
        return {}
    limits = {k.removeprefix("limit: "): _share(v, cases) for k, v in sorted(n.items()) if k.startswith("limit: ")}
    return {"sampling_share": _share(n.get("requests_sampling", 0), reqs),
            "random_sampling_share": _share(n.get("requests_random", 0), reqs),
            "penalties_share": _share(n.get("requests_penalties", 0), reqs),
            "abort_share": _share(n.get("cases_with_abort", 0), cases),
            "preemption_share": _share(n.get("cases_preempted", 0), cases),
            "limits_reached": len(limits), "limits": limits}


def all_cells(cells) -> CellStats:
    """The rows' numeric notes added up: the campaign's reach as one row."""
    total = CellStats()
    for c in cells:
        for k, v in c.notes.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total.notes[k] = total.notes.get(k, 0) + v
    return total


def drawn_events() -> list[str]:
    """The event() labels of the example Hypothesis is running (its build context; none outside
    a test). Hypothesis keeps them for its statistics only, hence the internal attribute."""
    try:
        from hypothesis.control import current_build_context

        return list(current_build_context().data.events)
    except Exception:  # outside a test, or a Hypothesis that keeps them elsewhere: no classes
        return []


# event() labels that are no case class: the cell itself (its key) and the config limits
# (counted apart, `reach_row`).
_NOT_CLASSES = ("layout=", "mode=", "limit: ")


def note_example(c: CellStats, ratio: float | None, dtype: str | None, events=()) -> None:
    """One example that passed, in its row: its error/tolerance, dtype and case classes."""
    key = decade_key(ratio)
    if key is not None:
        c.ratio_hist[key] = c.ratio_hist.get(key, 0) + 1
        c.ratio_max = ratio if c.ratio_max is None else max(c.ratio_max, ratio)
    if dtype and dtype not in c.dtype.split(","):
        c.dtype = ",".join(sorted(filter(None, c.dtype.split(",") + [dtype])))
    for e in events:
        if not e.startswith(_NOT_CLASSES):
            c.events[e] = c.events.get(e, 0) + 1


def add_measured(into: CellStats, row: dict) -> None:
    """`note_example`'s fields of `row` (a CellStats' fields as a dict) added to `into`: counts
    add up, the maximum is the larger. Rows written before these fields existed add nothing."""
    for name in ("ratio_hist", "events"):
        for k, n in (row.get(name) or {}).items():
            getattr(into, name)[k] = getattr(into, name).get(k, 0) + n
    m = row.get("ratio_max")
    if m is not None:
        into.ratio_max = m if into.ratio_max is None else max(into.ratio_max, m)
    for d in (row.get("dtype") or "").split(","):
        note_example(into, None, d)


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")


def measured_row(c: CellStats) -> dict:
    """A row's `note_example` fields for the summary JSON ({} where none was noted)."""
    if not (c.ratio_hist or c.events or c.dtype):
        return {}
    return {"dtype": c.dtype or None, "error_ratio_max": _sig(c.ratio_max),
            "error_ratio_hist": {k: c.ratio_hist[k] for k in DECADE_KEYS if c.ratio_hist.get(k)},
            "events": dict(sorted(c.events.items()))}


def _reach_cols(c: CellStats) -> str:
    p, a, r = prefix_caching_row(c), async_overlap_row(c), reach_row(c)
    limits = f"{r['limits_reached']}/{len(LIMITS)}" if r else "-"
    return (f"{_pct(p.get('prefix_hit_rate')):>6}{_pct(a.get('async_overlap')):>7}{_pct(r.get('sampling_share')):>6}"
            f"{_pct(r.get('random_sampling_share')):>6}{_pct(r.get('penalties_share')):>6}"
            f"{_pct(r.get('abort_share')):>6}{limits:>8}")


def _max_col(v: float | None) -> str:
    return f"{'-' if v is None else ratio_text(v):>9}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}"


@dataclass
class Failure:
    property: str
    message: str
    case_desc: str
    path: str
    error_ratio: float | None
    oracle: str | None = None  # what the failing run was compared against
    second_opinion: str | None = None
    cell: str | None = None  # the cell it was found in
    meta: dict = field(default_factory=dict)  # the target's: signature, shrink checks
    # When and how small (fuzz.campaign.findings): seconds from the campaign's start and examples run
    # before the first failing example; the reproducer's size; whether the minimizer reached
    # a fixpoint; seconds spent minimizing it (in the campaign and the shrink phase).
    seconds_to_find: float | None = None
    examples_before: int | None = None
    size: dict | None = None
    minimal: bool | None = None
    shrink_seconds: float = 0.0
    # `llmfuzz merge`: the same failure (same_failure) found in other shards, their reproducers.
    others: list = field(default_factory=list)
    # A target that keeps state (fuzz.campaign.history): its fresh replay ("fails", "fails with
    # history of N", "passes", "not run"; None: the target keeps none) and the earlier Cases it needs.
    fresh_replay: str | None = None
    history: int = 0


@dataclass
class Summary:
    examples: int = 0
    seconds: float = 0.0
    cells: dict = field(default_factory=dict)  # (layout, mode) -> CellStats
    failures: list = field(default_factory=list)
    interrupted: bool = False
    first_failure_s: float | None = None  # time and examples until the first failure was seen
    first_failure_examples: int | None = None
    write_errors: int = 0  # failures that could not be written (their Case went to stderr)
    duplicates: int = 0  # Cases drawn again after they passed: skipped, not counted as examples
    planned: list = field(default_factory=list)  # the target's cells, in visiting order
    budget_s: float = 0.0
    seed: int = 0
    target: Any = field(default=None, repr=False)  # renders it where it has its own form (vLLM's)
    # `run --jobs N` (fuzz.campaign.jobs): the worker processes, and failures a worker found whose
    # reproducer another had already written (counted, not written twice). Per worker: its
    # cells, examples, exit and, for one that crashed, its error and the files it left.
    jobs: int = 1
    repeats: int = 0
    workers: list = field(default_factory=list)
    # `run --shard K/N` (fuzz.campaign.shard): which shard this is; `llmfuzz merge`: the shards merged.
    shard: Any = None
    shards: list = field(default_factory=list)

    def not_visited(self) -> list[str]:
        """The cells with no example checked; for a target visited config by config (its planned
        cells are its rows), the planned ones never reached too."""
        return not_visited(self.cells, self.planned if getattr(self.target, "sequential", False) else ())

    def to_json(self) -> dict:
        own = self.target.summary_json(self) if self.target is not None else None
        if own is not None:
            return {**own, "not_visited": self.not_visited(), **fresh_counts(self.failures, each=True)}
        total = all_cells(self.cells.values())
        for c in self.cells.values():
            add_measured(total, vars(c))
        measured = measured_row(total)
        return {
            "examples": self.examples, "failures": len(self.failures),
            "layouts": visited(self.cells), "modes": sorted({k[1] for k, c in self.cells.items() if c.visited()}),
            "not_visited": self.not_visited(),
            "seconds": round(self.seconds, 2), "reproducers": [f.path for f in self.failures],
            "failure_details": [{k: v for k, v in f.__dict__.items()
                                 if k not in ("cell", "meta") and (v or k != "others")} for f in self.failures],
            "per_cell": {f"{k[0]}/{k[1]}": {"examples": c.examples, "failures": c.failures,
                                             "examples_per_s": round(c.examples / c.seconds, 2) if c.seconds else None,
                                             "shrink_checks": c.shrink_checks,
                                             "shrink_seconds": round(c.shrink_seconds, 2),
                                             **measured_row(c), **prefix_caching_row(c), **async_overlap_row(c),
                                             **reach_row(c)}
                         for k, c in sorted(self.cells.items())},
            # The campaign's error/tolerance and case classes: every row's added up.
            **{k: measured[k] for k in ("error_ratio_max", "error_ratio_hist", "events") if k in measured},
            "reach": {**prefix_caching_row(total), **async_overlap_row(total), **reach_row(total)},
            "interrupted": self.interrupted, "write_errors": self.write_errors,
            "duplicates_skipped": self.duplicates, "jobs": self.jobs, "repeats": self.repeats,
            **fresh_counts(self.failures),
            **({"workers": self.workers} if self.workers else {}),
            **({"shard": str(self.shard)} if self.shard is not None else {}),
            **({"shards": self.shards} if self.shards else {}),
        }

    def table(self) -> str:
        own = self.target.summary_table(self) if self.target is not None else None
        if own is not None:
            return own
        # Reach per row, in percent: prefix-cache hit rate (of looked-up prompt tokens, in Cases
        # with caching on); requests with sampling params, random sampling, penalties; Cases
        # with an abort; and how many config limits some Case reached (`reach_row`).
        # `max e/t`: the largest error/tolerance of a row's passing examples (1 would violate).
        rows = [f"{'layout':<10}{'mode':<7}{'examples':>9}{'ex/s':>8}{'failures':>10}{'max e/t':>9}"
                f"{'hit%':>6}{'ahead%':>7}{'smp%':>6}{'rnd%':>6}{'pen%':>6}{'abrt%':>6}{'limits':>8}"]
        for (lay, mode), c in sorted(self.cells.items()):
            rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
            rows.append(f"{lay:<10}{mode:<7}{c.examples:>9}{rate:>8}{c.failures:>10}{_max_col(c.ratio_max)}"
                        f"{_reach_cols(c)}")
        worst = max((c.ratio_max for c in self.cells.values() if c.ratio_max is not None), default=None)
        rows.append(f"{'total':<17}{self.examples:>9}{self.examples / max(self.seconds, 1e-9):>8.2f}"
                    f"{len(self.failures):>10}{_max_col(worst)}{_reach_cols(all_cells(self.cells.values()))}")
        rows += [f"not visited: {n} (no example checked)" for n in self.not_visited()]
        return "\n".join(rows)


def fresh_counts(failures, each: bool = False) -> dict:
    """How many findings needed an earlier Case's state to fail on a fresh engine, and how many
    did not fail on one at all (fuzz.campaign.history); {} where the target keeps no state.
    `each`: each finding's fresh replay too (a target's own summary may not list it)."""
    states = [f.fresh_replay for f in failures if f.fresh_replay is not None]
    if not states:
        return {}
    out = {"findings_needing_history": sum(s.startswith("fails with history") for s in states),
           "findings_passing_fresh": sum(s == "passes" for s in states)}
    if each:
        out["fresh_replays"] = [{"path": f.path, "fresh_replay": f.fresh_replay, "history": f.history}
                                for f in failures if f.fresh_replay is not None]
    return out


def summary_doc(summary, shrink_report: dict | None) -> dict:
    """A Summary with everything a merge needs: every cell row and failure field."""
    return {
        "examples": summary.examples, "seconds": summary.seconds, "interrupted": summary.interrupted,
        "first_failure_s": summary.first_failure_s, "first_failure_examples": summary.first_failure_examples,
        "write_errors": summary.write_errors, "duplicates": summary.duplicates, "repeats": summary.repeats,
        "cells": [[list(k), dataclasses.asdict(c)] for k, c in summary.cells.items()],
        "failures": [dataclasses.asdict(f) for f in summary.failures],
        "shrink_phase": shrink_report,
    }


class CellDatabase(ExampleDatabase):
    """The example database as one (layout, modes, faults) cell sees it. Hypothesis keys
    saved examples by the test function, the same for every cell; here every key also
    carries the cell's digest, so a saved failure is replayed only in its own cell, as the
    kind of Case it was drawn as. Any database works underneath (the nightly's directory)."""

    def __init__(self, db: ExampleDatabase, cell: bytes) -> None:
        super().__init__()
        self.db, self.prefix = db, hashlib.sha256(cell).hexdigest()[:20].encode() + b"/"

    def save(self, key: bytes, value: bytes) -> None:
        self.db.save(self.prefix + key, value)

    def fetch(self, key: bytes):
        return self.db.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.db.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.db.move(self.prefix + src, self.prefix + dest, value)
