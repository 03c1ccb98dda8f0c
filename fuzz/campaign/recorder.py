"""A campaign's reproducers on disk: `Recorder` is the one writer (fuzz.campaign.loop,
fuzz.campaign.shrink_phase). Each failure is on disk the moment it is seen; each smaller version
replaces the one before (written atomically first, the old file removed after); a failure
that cannot be written goes to stderr in full instead, and is counted for the exit code.
Every reproducer records when its failure was found and whether it is minimal.

Workers of `llmfuzz run --jobs N` share one directory (`Claims`): a file is named by its
Case's hash, so two workers that find the same failure meet at one path; the claims say
whose it is, so the second counts a repeat instead of overwriting the first's record, and
no worker removes a file another still holds.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from fuzz.campaign.findings import case_size
from fuzz.campaign.reproduce import case_id, write_reproducer
from fuzz.campaign.summary import CellStats


class Claims:
    """Who holds each reproducer file of a directory several worker processes write: a JSON
    registry {path: {worker: "final" | "unfinished"}}, read and written under an exclusive
    fcntl lock, so a check and the write or removal it allows are one step for all workers."""

    def __init__(self, run_dir: str, worker: str) -> None:
        self.lock_path, self.path, self.worker = (os.path.join(run_dir, "claims.lock"),
                                                  os.path.join(run_dir, "claims.json"), worker)

    @contextlib.contextmanager
    def held(self):
        import fcntl

        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            reg = self.read()
            try:
                yield reg
            finally:  # an interrupt after a write still records who holds the file
                tmp = f"{self.path}.{self.worker}.tmp"
                with open(tmp, "w") as f:
                    json.dump(reg, f)
                os.replace(tmp, self.path)
        finally:
            os.close(fd)  # releases the lock

    def read(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def others(self, reg: dict, path: str, kind: str | None = None) -> bool:
        return any(w != self.worker and (kind is None or k == kind) for w, k in reg.get(path, {}).items())


class Recorder:
    def __init__(self, out_dir: str, target, summary, progress: bool, claims: Claims | None = None) -> None:
        self.out_dir, self.target, self.summary, self.progress = out_dir, target, summary, progress
        self.unfinished_path: str | None = None  # the file an unfinished failure is on disk as
        self.claims = claims  # None: this process is the directory's only writer
        self.elsewhere = False  # the last `persist`: another worker had recorded this reproducer
        # Whether the last failure written is minimal, as its file says: the one decision the
        # summary and stderr repeat (a shrink that skipped candidates for time is not minimal).
        self.minimal: bool | None = None

    def write(self, v, extra: dict) -> str | None:
        """Write a reproducer (with `extra` top-level fields: when it was found, whether it is
        minimal); when the disk is full or the directory unwritable, print the Case in full
        instead, so the failure is not lost, and remember it for the exit code."""
        meta = {**self.target.reproducer_meta(v.case, v), **extra}
        if meta.get("shrink_candidates_skipped_for_time"):  # a shrink cut short is not minimal
            meta["minimal"] = False
        self.minimal = meta.get("minimal")
        try:
            return write_reproducer(self.out_dir, v.case, v.property, v.message, v.error_ratio,
                                    v.oracle, v.second_opinion, meta)
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
        extra = {"minimal": minimal, "seconds_to_find": round(found[0], 2), "examples_before": found[1]}
        with self._shared() as reg:
            path = self._write_claimed(v, extra, reg, "final" if final else "unfinished")
            old, self.unfinished_path = self.unfinished_path, None if final else path
            self._drop(old, path, reg)
        return path

    @contextlib.contextmanager
    def _shared(self):
        if self.claims is None:
            yield None
        else:
            with self.claims.held() as reg:
                yield reg

    def _write_claimed(self, v, extra: dict, reg: dict | None, kind: str) -> str | None:
        """Write `v` and hold its file as `kind`; when another worker holds it as final (its
        recorded failure, the same Case and property), leave its file and say so (`elsewhere`)."""
        self.elsewhere, self.minimal = False, extra.get("minimal")
        if reg is None:
            return self.write(v, extra)
        path = os.path.join(self.out_dir, v.property, f"{case_id(v.case)}.json")  # as write_reproducer names it
        if self.claims.others(reg, os.path.abspath(path), "final"):
            self.elsewhere = True
            return path
        written = self.write(v, extra)
        if written is not None:
            holders = reg.setdefault(os.path.abspath(written), {})
            if holders.get(self.claims.worker) != "final":  # a final one stays final
                holders[self.claims.worker] = kind
        return written

    def drop(self, old: str | None, new: str | None) -> None:
        """Remove `old`, superseded by `new`, unless a recorded failure is on disk as it."""
        with self._shared() as reg:
            self._drop(old, new, reg)

    def _drop(self, old: str | None, new: str | None, reg: dict | None) -> None:
        if not old or old == new or any(f.path == old for f in self.summary.failures):
            return
        if reg is not None:  # ours no more; another worker's record or unfinished failure stays
            key = os.path.abspath(old)
            holders = reg.get(key, {})
            holders.pop(self.claims.worker, None)
            if holders:
                return
            reg.pop(key, None)
        if os.path.exists(old):
            os.unlink(old)

    def rewrite(self, p, r, seconds: float) -> None:
        """The shrink phase's result `r` (fuzz.campaign.shrink_phase.Shrunk) for pending failure `p`:
        written over its earlier version (which stays when the write fails), its summary
        record (fuzz.targets.base.Failure) and its row's shrink checks updated. `minimal` is
        what the file says (`write` decides), on stderr and in the summary alike."""
        f, v = p.failure, r.violation
        f.shrink_seconds = round(f.shrink_seconds + seconds, 2)
        f.meta["shrink_checks"] = f.meta.get("shrink_checks", 0) + r.checks
        row = tuple(f.meta.get("counted_in") or self.target.stats_key(v.case))  # where it was found
        self.summary.cells.setdefault(row, CellStats()).add_shrink(r.checks, seconds)
        with self._shared() as reg:
            path = self._write_claimed(v, {"minimal": r.minimal, "seconds_to_find": f.seconds_to_find,
                                           "examples_before": f.examples_before}, reg, "final")
            if path is None:
                return
            # Shrunk onto another worker's reproducer: the same failure now; the merged summary
            # (fuzz.campaign.jobs) counts it once, as a repeat.
            old, p.violation, f.minimal = f.path, v, self.minimal
            f.path, f.message, f.case_desc, f.error_ratio = path, v.message, v.case.describe(), v.error_ratio
            f.oracle, f.second_opinion, f.size = v.oracle, v.second_opinion, case_size(v.case)
            f.meta["row"] = self.target.stats_key(v.case)[0]
            self._drop(old, path, reg)
        if self.progress:
            sys.stderr.write(f"\nSHRUNK {f.property} ({'minimal' if f.minimal else 'not minimal yet'}, "
                             f"{r.checks} checks, {seconds:.1f}s): {f.case_desc}\n  -> {path}\n")
            sys.stderr.flush()
