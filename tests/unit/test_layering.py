"""The package's layering, read from its import statements (ast: nothing is imported or run).

* The library never imports the tools (`deepcompile.tools`: the command, the demo, the bench,
  the planner); `python -m deepcompile` (`__main__.py`) is the command itself.
* The planner (`deepcompile.tools.plan`) imports neither the bench nor the engine, directly or
  through anything it imports.
* No circle: no module imports itself through the modules it imports.

Every import counts: at module level, inside a function, and under `if TYPE_CHECKING:` (a
type-only import ties two modules' designs as a real one does, and the package's lazy
`__getattr__` imports by name what only its TYPE_CHECKING block shows).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

TOOLS = "deepcompile.tools"
ENTRY_POINTS = {"deepcompile.__main__"}   # the command, outside tools/ so that -m finds it


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file of every module under `root` (a directory holding packages)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports: `from a import b` names
    module a.b where there is one, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for t in targets:
            while t and t not in known:   # `import a.b.c` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(g: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def reachable(g: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` imports, directly or not: module -> the module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in g.get(v, ()):
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# ----------------------------------------------------------------------------------- the rules
def library_imports_of_tools(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in g.items() for t in ts
                  if not _within(m, TOOLS) and m not in ENTRY_POINTS and _within(t, TOOLS))


def planner_reaches(g: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    """(planner module, bench or engine module it reaches, the module that imports that)."""
    bad = []
    for m in sorted(g):
        if _within(m, f"{TOOLS}.plan"):
            for t, via in sorted(reachable(g, m).items()):
                if _within(t, f"{TOOLS}.bench") or t == "deepcompile.engine":
                    bad.append((m, t, via))
    return bad


def test_the_library_never_imports_the_tools():
    assert library_imports_of_tools(graph(SRC)) == []


def test_the_planner_imports_neither_the_bench_nor_the_engine():
    assert planner_reaches(graph(SRC)) == []


def test_no_import_circle():
    assert sorted(sorted(c) for c in circles(graph(SRC))) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """The rules on a made-up package: circles through a function-level and a type-only import,
    a library module importing a tool, the planner reaching the bench through the library."""
    files = {
        "deepcompile/__init__.py": "",
        "deepcompile/engine.py": "from .a import x\n",
        "deepcompile/a.py": textwrap.dedent("""\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .engine import Engine
            def f():
                from . import b
            """),
        "deepcompile/b.py": "import deepcompile.a\nfrom .tools.bench import run\n",
        "deepcompile/tools/__init__.py": "",
        "deepcompile/tools/bench/__init__.py": "run = 1\n",
        "deepcompile/tools/plan/__init__.py": "from ...a import f\n",
        "deepcompile/tools/plan/ok.py": "from .. import plan\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = graph(tmp_path)
    assert g["deepcompile.a"] == {"deepcompile.b", "deepcompile.engine"}
    assert g["deepcompile.b"] == {"deepcompile.a", "deepcompile.tools.bench"}
    assert g["deepcompile.tools.plan.ok"] == {"deepcompile.tools.plan"}
    assert circles(g) == [{"deepcompile.a", "deepcompile.b", "deepcompile.engine"}]
    assert library_imports_of_tools(g) == [("deepcompile.b", "deepcompile.tools.bench")]
    assert [(m, t) for m, t, _ in planner_reaches(g)] == [
        (m, t) for m in ("deepcompile.tools.plan", "deepcompile.tools.plan.ok")
        for t in ("deepcompile.engine", "deepcompile.tools.bench")]
