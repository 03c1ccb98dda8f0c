"""Attention kernels as cells of one campaign: the GPU leg fuzzes what users run.

`llmfuzz run --device cuda` (and ci/gpu.sh) fuzz bf16 on the real kernels: torch_flash
(PyTorch's FlashAttention-2) and, when the flash-attn package is importable, flash_attn
(flash-attn-4's `flash_attn.cute`, or FlashAttention-2). `KernelCells` is the reference
engine's target (fuzz.targets.base.HarnessTarget) with one cell per (layout, kernel): the round
robin alternates kernels on each layout, a summary row is (layout, mode, kernel), and the
summary names every row's kernel (JSON `per_cell` keys "tp1pp2/graph/flash_attn",
`per_kernel` totals, `kernel` in each failure; the table has a kernel column).
"""
from __future__ import annotations

import dataclasses

from fuzz.targets.base import Cell
from fuzz.targets.reference import HarnessTarget


class KernelCells(HarnessTarget):
    """HarnessTarget over (layout, kernel) cells; `bases` are one base config per kernel."""

    def __init__(self, harness, layouts=(), modes=("eager",), faults=(), bases=(), max_requests: int = 10) -> None:
        bases = list(bases)
        super().__init__(harness, layouts, modes, faults, bases[0], max_requests)
        self.bases = {b.attention_backend: b for b in bases}
        self._kernel_of: dict[str, str] = {}

    @property
    def kernels(self) -> list[str]:
        return list(self.bases)

    def cells(self) -> list[Cell]:
        from fuzz.cases.strategies import cases

        out = []
        for lay in self.layouts:
            for kernel, base in self.bases.items():
                name = repr((lay, self.modes, self.faults, kernel))
                self._kernel_of[name] = kernel
                out.append(Cell(name, cases((lay,), self.modes, self.faults, base, self.max_requests), lay))
        return out

    def stats_key(self, case) -> tuple:
        return case.layout, case.mode, case.config.attention_backend

    def describe(self) -> str:
        return f"{super().describe()}, kernels {','.join(self.bases)}"

    def summary_json(self, summary) -> dict:
        out = dataclasses.replace(summary, target=None).to_json()
        out["kernels"] = self.kernels
        out["dtype"] = self.base.dtype
        out["per_cell"] = {f"{k[0]}/{k[1]}/{k[2]}": {
            "examples": c.examples, "failures": c.failures, "kernel": k[2],
            "examples_per_s": round(c.examples / c.seconds, 2) if c.seconds else None}
            for k, c in sorted(summary.cells.items())}
        per_kernel = {k: {"examples": 0, "failures": 0, "seconds": 0.0} for k in self.bases}
        for (_, _, kernel), c in summary.cells.items():
            row = per_kernel.setdefault(kernel, {"examples": 0, "failures": 0, "seconds": 0.0})
            row["examples"] += c.examples
            row["failures"] += c.failures
            row["seconds"] = round(row["seconds"] + c.seconds, 2)
        out["per_kernel"] = per_kernel
        for d, f in zip(out["failure_details"], summary.failures):
            d["kernel"] = self._kernel_of.get(f.cell)
        return out

    def summary_table(self, summary) -> str:
        rows = [f"{'layout':<10}{'mode':<7}{'kernel':<13}{'examples':>9}{'ex/s':>8}{'failures':>10}"]
        for (lay, mode, kernel), c in sorted(summary.cells.items()):
            rate = f"{c.examples / c.seconds:.2f}" if c.seconds else "-"
            rows.append(f"{lay:<10}{mode:<7}{kernel:<13}{c.examples:>9}{rate:>8}{c.failures:>10}")
        rows.append(f"{'total':<30}{summary.examples:>9}{summary.examples / max(summary.seconds, 1e-9):>8.2f}"
                    f"{len(summary.failures):>10}")
        rows.append(f"({self.base.dtype}; kernels: {', '.join(self.bases)})")
        return "\n".join(rows)
