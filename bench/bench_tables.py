"""Table rendering shared by the benchmarks: the same rows as aligned text
for the terminal or as a Markdown table for bench/RESULTS.md, with failed
configurations listed under the table."""
from __future__ import annotations

from typing import List, Sequence


def render_table(header: Sequence[str], body: List[List[str]], errors: Sequence[str], markdown: bool,
                 left_columns: int) -> str:
    """``body`` rows of cells under ``header``; the first ``left_columns``
    columns are left-aligned (names), the rest right-aligned (numbers).
    ``errors`` are one line each, printed after the table as FAILED lines."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines + [""] + [f"- FAILED {error}" for error in errors])
    widths = [max(len(header[i]), *(len(cells[i]) for cells in body)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i >= left_columns else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(header), ""]
    lines[1] = "-" * len(lines[0])
    lines += [line(cells) for cells in body]
    return "\n".join(lines + [f"FAILED {error}" for error in errors])
