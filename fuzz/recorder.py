"""A campaign's reproducers on disk: `Recorder` is the one writer (fuzz.campaign,
fuzz.shrink_phase). Each failure is on disk the moment it is seen; each smaller version
replaces the one before (written atomically first, the old file removed after); a failure
that cannot be written goes to stderr in full instead, and is counted for the exit code.
Every reproducer records when its failure was found and whether it is minimal.
"""
from __future__ import annotations

import os
import sys

from fuzz.findings import case_size
from fuzz.reproduce import write_reproducer


class Recorder:
    def __init__(self, out_dir: str, target, summary, progress: bool) -> None:
        self.out_dir, self.target, self.summary, self.progress = out_dir, target, summary, progress
        self.unfinished_path: str | None = None  # the file an unfinished failure is on disk as

    def write(self, v, extra: dict) -> str | None:
        """Write a reproducer (with `extra` top-level fields: when it was found, whether it is
        minimal); when the disk is full or the directory unwritable, print the Case in full
        instead, so the failure is not lost, and remember it for the exit code."""
        try:
            return write_reproducer(self.out_dir, v.case, v.property, v.message, v.error_ratio,
                                    v.oracle, v.second_opinion, {**self.target.reproducer_meta(v.case, v), **extra})
        except OSError as e:
            self.summary.write_errors += 1
            sys.stderr.write(f"\nllmfuzz: cannot write reproducer to {self.out_dir} ({e.strerror or e}); "
                             f"the failing Case follows as JSON:\n{v.case.to_json()}\n")
            sys.stderr.flush()
            return None

    def persist(self, v, *, final: bool, found: tuple[float, int], minimal: bool = False) -> str | None:
        """Write `v` atomically, then remove the file of the unfinished failure it supersedes
        (never one already recorded). `final`: `v` is finished and its file stays; otherwise
        the next `persist` replaces it. `found`: (seconds to find, examples before it)."""
        path = self.write(v, {"minimal": minimal, "seconds_to_find": round(found[0], 2), "examples_before": found[1]})
        old, self.unfinished_path = self.unfinished_path, None if final else path
        self.drop(old, path)
        return path

    def drop(self, old: str | None, new: str | None) -> None:
        """Remove `old`, superseded by `new`, unless a recorded failure is on disk as it."""
        if old and old != new and os.path.exists(old) and all(f.path != old for f in self.summary.failures):
            os.unlink(old)

    def rewrite(self, p, r, seconds: float) -> None:
        """The shrink phase's result `r` (fuzz.shrink_phase.Shrunk) for pending failure `p`:
        written over its earlier version (which stays when the write fails), its summary
        record (fuzz.target.Failure) updated."""
        f, v = p.failure, r.violation
        f.shrink_seconds = round(f.shrink_seconds + seconds, 2)
        f.meta["shrink_checks"] = f.meta.get("shrink_checks", 0) + r.checks
        path = self.write(v, {"minimal": r.minimal, "seconds_to_find": f.seconds_to_find,
                              "examples_before": f.examples_before})
        if path is None:
            return
        old, p.violation, f.minimal = f.path, v, r.minimal
        f.path, f.message, f.case_desc, f.error_ratio = path, v.message, v.case.describe(), v.error_ratio
        f.oracle, f.second_opinion, f.size = v.oracle, v.second_opinion, case_size(v.case)
        f.meta["row"] = self.target.stats_key(v.case)[0]
        self.drop(old, path)
        if self.progress:
            sys.stderr.write(f"\nSHRUNK {f.property} ({'minimal' if r.minimal else 'not minimal yet'}, "
                             f"{r.checks} checks, {seconds:.1f}s): {f.case_desc}\n  -> {path}\n")
            sys.stderr.flush()
