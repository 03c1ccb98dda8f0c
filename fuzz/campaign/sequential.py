"""How a campaign visits the cells of a `sequential` target (vLLM: an engine start per cell):
each once, in order, for its share of the time left. A mixin of fuzz.campaign.loop.Campaign, whose
one loop (`_visit`: find, then finish each failure) it drives.
"""
from __future__ import annotations

import sys
import time

from fuzz.verdict.properties import Violation
from fuzz.stop import check_stop
from fuzz.targets.base import Cell, Unsupported
from fuzz.campaign.summary import CellStats


class SequentialVisits:
    def _run_sequential(self) -> None:
        """Each cell once, in order, for an equal share of the examples' time: the time left,
        less the start-ups of the cells not yet started (`Target.start_estimate_s`), over those
        cells; at least min(min_cell_s, budget) once started. Counting a start in its cell's
        share gave the cheap configs planned first a minute of examples and the compiled and
        multi-worker ones after them, whose starts take most of a share, a few seconds. A cell's
        costs are added to its row however it ends (Target.cell_done). A shard's cell keeps its
        place in the whole campaign (`share.positions`) and runs its stream of the chunks: the
        seeds one machine uses."""
        share = self.share
        stream, streams = (share.stream, share.streams) if share is not None else (0, 1)
        for ci, cell in enumerate(self.cells):
            now = time.monotonic()
            if now >= self._deadline:
                return
            starts = sum(self.target.start_estimate_s(c) for c in self.cells[ci:])
            fuzz_share = max(0.0, self._deadline - now - starts) / (len(self.cells) - ci)
            place = (share.positions or {}).get(cell.name, ci) if share is not None else ci
            row = self.summary.cells.setdefault(self.target.stats_key(cell.data), CellStats())
            try:
                if not self._start(cell, row):
                    continue
                if ci + 1 < len(self.cells):  # its start-up runs beside this cell's examples
                    self.target.prestart(self.cells[ci + 1])
                started = time.monotonic()
                end, j = max(min(started + fuzz_share, self._deadline),
                             started + min(self.min_cell_s, self.budget_s)), stream
                while time.monotonic() < end and not row.stopped:
                    check_stop()
                    if self._visit(cell, row, place * 1009 + j, end):
                        return
                    j += streams
            finally:
                self.target.cell_done(cell, row)

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
