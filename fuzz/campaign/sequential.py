"""How a campaign visits the cells of a `sequential` target (vLLM: an engine start per cell):
each once, in order, for its share of the time left. A mixin of fuzz.campaign.loop.Campaign, whose
one loop (`_visit`: find, then finish each failure) it drives.
"""
from __future__ import annotations

import sys

from fuzz.verdict.properties import Violation
from fuzz.stop import check_stop
from fuzz.targets.base import Cell, Unsupported
from fuzz.campaign.summary import CellStats


# Why a sequential cell that started has no row of examples (its engine up, no example checked).
NOT_VISITED = "not visited: no example checked"


class SequentialVisits:
    WAIT_SLICE_S = 0.5  # examples while the next cell's engine starts: how often to look whether it is up
    STRETCH = 1.5  # the most a cell short of `Target.min_cell_examples` may run past its share, as a multiple of it

    def _run_sequential(self) -> None:
        """Each cell once, in order, for an equal share of the examples' time, at least
        min(min_cell_s, budget) once started. Counting a start in its cell's share gave the
        cheap configs planned first a minute of examples and the compiled and multi-worker
        ones after them, whose starts take most of a share, a few seconds; so the share is
        the time left, less the start-ups still to wait for (`Target.start_estimate_s`), over
        the cells left. A target that `prestarts` starts the next cell's engine as soon as this
        one's is up, beside this cell's examples, and this cell goes on with examples until it
        is (`Target.starting`) rather than wait idle, while there is time to spare for the cells
        left (`_time_to_spare`): each cell then lasts its share or the next start, whichever is
        longer, and the share is what makes the cells left end at the deadline (`fill_share`).
        Equal time is not equal depth (a config's examples cost 1-5 s): a cell whose share ends
        short of the target's `min_cell_examples` goes on, up to STRETCH x its share, on the same
        condition of time to spare; the cells after it share what is left.
        A cell's costs are added to its row however it ends (Target.cell_done). A shard's cell
        keeps its place in the whole campaign (`share.positions`) and runs its stream of the
        chunks: the seeds one machine uses. A cell that ends with no example checked is not
        visited, and its row says so.
        Where the cells end before the budget does (the last one ended by a crash, or refused),
        the time left goes to the shrink phase: it minimizes what the cells left unfinished."""
        if self._visit_cells():
            self.shrink_budget_s += max(0.0, self._deadline - self.clock())

    def _visit_cells(self) -> bool:
        """`_run_sequential`'s visits: True when every cell had its turn before the deadline
        and no stop ended one."""
        share = self.share
        stream, streams = (share.stream, share.streams) if share is not None else (0, 1)
        for ci, cell in enumerate(self.cells):
            now = self.clock()
            if now >= self._deadline:
                return False
            if self.target.prestarts:
                fuzz_share = self._prestarted_share(ci, now)
            else:
                starts = sum(self.target.start_estimate_s(c) for c in self.cells[ci:])
                fuzz_share = max(0.0, self._deadline - now - starts) / (len(self.cells) - ci)
            place = (share.positions or {}).get(cell.name, ci) if share is not None else ci
            row = self.summary.cells.setdefault(self.target.stats_key(cell.data), CellStats())
            try:
                if not self._start(cell, row):
                    continue
                nxt = self.cells[ci + 1] if ci + 1 < len(self.cells) else None
                if nxt is not None:  # its start-up runs beside this cell's examples
                    self.target.prestart(nxt)
                started = self.clock()
                end, j = max(min(started + fuzz_share, self._deadline),
                             started + min(self.min_cell_s, self.budget_s)), stream
                while not row.stopped:
                    now = self.clock()
                    if now >= end:
                        # The next engine still starting, or this cell short of examples: the
                        # time goes to this cell's examples while the cells left can still all be
                        # reached; once they cannot, a start has the cores to itself (beside
                        # examples, measured: 2-3 x slower).
                        short = row.examples < self.target.min_cell_examples \
                            and now < started + self.STRETCH * fuzz_share
                        if nxt is None or now >= self._deadline or not (short or self.target.starting(nxt)) \
                                or not self._time_to_spare(ci, now):
                            break
                        end = min(now + self.WAIT_SLICE_S, self._deadline)
                    check_stop()
                    if self._visit(cell, row, place * 1009 + j, end):
                        return False
                    j += streams
            finally:
                if not row.visited() and not row.stopped:  # started, but the time ran out before an example
                    row.stopped = NOT_VISITED
                self.target.cell_done(cell, row)
        return True

    def _prestarted_share(self, ci: int, now: float) -> float:
        """Cell `ci`'s share where each later start runs beside the cell before it, which lasts
        until it is up: after what is left of `ci`'s own start, each cell from `ci` on lasts
        max(share, the next start), the last max(share, 0), and together they end at the deadline."""
        left = self._deadline - now - self.target.start_estimate_s(self.cells[ci])
        return fill_share(left, [self.target.start_estimate_s(c) for c in self.cells[ci + 1:]] + [0.0])

    def _time_to_spare(self, ci: int, now: float) -> bool:
        """Whether, after the next cell's start (what is left of it) and the later ones, each
        cell left past this one still gets its least time."""
        return self._prestarted_share(ci + 1, now) >= min(self.min_cell_s, self.budget_s)

    def _start(self, cell: Cell, row: CellStats) -> bool:
        """Start a sequential cell's engine: False when it is refused (unsupported) or fails
        to start (a failure, recorded without minimizing: every check would restart it)."""
        self._cell, self._row, self._found = cell, row, {}
        if self.progress:
            sys.stderr.write(f"llmfuzz: cell {cell.name}: starting\n")
        try:
            self.target.start(cell)
            return True
        except Unsupported as e:
            row.unsupported = row.stopped = str(e)[:500]
        except Violation as v:
            self._finish(v, shrink=False)
            row.stopped = f"engine did not start ({getattr(v, 'signature', v.property)})"
        return False


def fill_share(total: float, floors: list[float]) -> float:
    """The share x with sum(max(x, f) for f in floors) = total: each of the cells left lasts
    its share or its floor (the next engine's start), whichever is longer. 0 where the floors
    alone take more than `total`."""
    fs = sorted(floors)
    for k in range(len(fs), 0, -1):  # k floors below the share
        x = (total - sum(fs[k:])) / k
        if x >= fs[k - 1]:
            return x
    return 0.0
