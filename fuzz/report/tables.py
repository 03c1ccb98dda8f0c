"""HTML tables of the report (fuzz.report.render, fuzz.report.green_html): plain ones, and the
cell-by-name matrices (config limits, case classes) whose many columns get turned heads so that
they fit the page's width instead of making it scroll."""
from __future__ import annotations

import html

# Turned column heads: written bottom to top, wrapped at MATRIX_HEAD_PX so that a long name
# takes two or three narrow lines rather than a tall one.
MATRIX_HEAD_PX = 150
CSS = (f"th.v{{writing-mode:vertical-rl;transform:rotate(180deg);max-height:{MATRIX_HEAD_PX}px;"
       "text-align:left;vertical-align:bottom;font-weight:normal;font-size:12px;padding:4px 2px}"
       "table.m td{font-size:12px;padding:2px 4px}table.m td.z{color:#bbb}")


class Cell(str):
    """A table cell that is already HTML (`<td ...>...</td>`); plain strings are escaped."""


def table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    th = "".join(h if isinstance(h, Cell) else f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(c if isinstance(c, Cell) else f"<td>{html.escape(c)}</td>" for c in r)
                  + "</tr>" for r in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><tr>{th}</tr>{trs}</table>"


def matrix_table(corner: str, rows: list[tuple[str, dict]], names: list[str]) -> str:
    """One row per (label, {name: share in 0..1}), one turned column per name: percent, a grey
    "0" where the row never reached it (what an engine developer looks for: the gaps)."""
    head = [corner] + [Cell(f'<th class="v">{html.escape(n)}</th>') for n in names]
    body = []
    for label, shares in rows:
        cells = []
        for n in names:
            v = shares.get(n) or 0
            cells.append(Cell('<td class="z">0</td>') if not v else "<1" if v < 0.005 else f"{100 * v:.0f}")
        body.append([label] + cells)
    return table(head, body, "m")
