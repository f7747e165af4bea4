"""The library's prose explains the code, not its history: no development history in `src/`
(stop numbers, VMs, run letters, dates, issue numbers, design-document sections), and every
`[Note: name]` a comment or docstring refers to is defined somewhere in `src/`."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "deepcompile"

HISTORY = re.compile(
    r"(?i:\bstops? \d+|\bsessions?\b|\bVMs?\b|\b20\d\d-\d\d-\d\d\b|\bissues? #?\d+|"
    r"DESIGN ?§|docs/notes|\bjournal/)|\b[Rr]un [A-H]\b(?! \w)")
# a [Note: ...] whose name may wrap onto the next comment line
NOTE = re.compile(r"\[Note: ((?:[^\]\n]|\n[ \t]*#?[ \t]*)+?)\]")


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_no_development_history_in_the_library():
    found = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if (m := HISTORY.search(line)) and "benchmarks/results/" not in line:
                found.append(f"{path.relative_to(SRC.parent)}:{n}: {m.group(0)!r}: {line.strip()}")
    assert not found, "development history in src/:\n" + "\n".join(found)


def notes():
    """({name: [where it opens a line]}, {name: [where it is referred to]}) over `src/`: a
    Note is written where its name opens a comment or docstring line (or a row of a docstring's
    table), and referred to anywhere else."""
    defined, referred = {}, {}
    for path in _sources():
        text = path.read_text()
        for m in NOTE.finditer(text):
            name = " ".join(re.sub(r"\n[ \t]*#?", " ", m.group(1)).split())
            start = text.rfind("\n", 0, m.start()) + 1
            where = f"{path.relative_to(SRC.parent)}:{text.count(chr(10), 0, m.start()) + 1}"
            opens = re.fullmatch(r'\s*(#\s*(--\s*)?|"""|[A-Z]+\s+)?', text[start:m.start()])
            (defined if opens else referred).setdefault(name, []).append(where)
    return defined, referred


def test_every_note_reference_resolves():
    defined, referred = notes()
    assert len(defined) > 20
    dangling = {k: v for k, v in referred.items() if k not in defined}
    assert not dangling, "[Note] references with no definition: " + repr(dangling)
