"""Plain-text tables with box-drawing rules: every label whole, numbers right-aligned.

(`rich` would draw the same; the library does not depend on it, and a report is often read in a
log file, where plain characters are what survives.)
"""

from __future__ import annotations

from typing import Any, Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None,
          right: Sequence[int] | None = None) -> list[str]:
    """Lines of a table. `right`: column indices aligned right (default: every column whose
    cells all look numeric)."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    n = len(headers)
    if right is None:
        right = [i for i in range(n)
                 if cells and all(_numeric(r[i]) for r in cells if i < len(r))]
    width = [max([len(headers[i])] + [len(r[i]) for r in cells if i < len(r)]) for i in range(n)]

    def line(values: Sequence[str]) -> str:
        out = []
        for i in range(n):
            v = values[i] if i < len(values) else ""
            out.append(v.rjust(width[i]) if i in right else v.ljust(width[i]))
        return "│ " + " │ ".join(out) + " │"

    rule = "─┼─".join("─" * w for w in width)
    out = []
    if title:
        out.append(title)
    out += ["┌─" + "─┬─".join("─" * w for w in width) + "─┐", line(list(headers)),
            "├─" + rule + "─┤"]
    out += [line(r) for r in cells]
    out.append("└─" + "─┴─".join("─" * w for w in width) + "─┘")
    return out


def _numeric(text: str) -> bool:
    t = text.replace(",", "").replace("→", "").replace("->", "").replace(" ", "")
    t = t.replace("%", "").replace("x", "").replace("-", "")
    return bool(t) and all(ch.isdigit() or ch == "." for ch in t)
