"""The layout's import rules (docs/architecture.md "Layers"), checked over every import in src/openforgerl.

An AST scan, no import is run: every `import` and `from ... import`, at any depth (one inside a
function is a dependency all the same, so hiding an import there does not get it past these tests),
relative forms resolved. `from pkg import name` points at the module `pkg.name` where there is one,
else at `pkg`. A parent package's __init__, which Python also runs, is not an arrow: counting it would
make every package whose __init__ re-exports its modules a circle.

Imports under `if TYPE_CHECKING:` never run, so they make no import cycle and the cycle test leaves
them out; they do name another layer's types, so the layer test counts them.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = "openforgerl"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module of the package
    where: str  # file:line
    typing_only: bool  # under `if TYPE_CHECKING:`


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _walk(node: ast.AST, typing_only: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node under `node`, and whether it sits under `if TYPE_CHECKING:`."""
    yield node, typing_only
    if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
        for child in node.body:
            yield from _walk(child, True)
        for child in node.orelse:
            yield from _walk(child, typing_only)
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, typing_only)


@cache
def imports(src: Path = SRC) -> list[Import]:
    mods = modules(src)

    def known(name: str) -> str | None:  # the innermost module of the package that `name` is in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # what `from .` means
        for node, typing_only in _walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(p for p in (base, node.module) if p)
                targets = [known(f"{module}.{a.name}") for a in node.names]
            else:
                continue
            where = f"{path.relative_to(src.parent)}:{node.lineno}"
            found += [Import(name, t, where, typing_only) for t in targets if t and t != name]
    return list(dict.fromkeys(found))  # one per line: `from m import a, b` names m once


def cycles(found: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over imports that run."""
    graph: dict[str, set[str]] = defaultdict(set)
    for i in found:
        if not i.typing_only:
            graph[i.source].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def layers(doc: Path = DOC) -> list[list[str]]:
    """docs/architecture.md's layers, bottom first: the numbered list under "## Layers", each item
    opening with the backquoted names of its packages or top-level modules."""
    text = doc.read_text().split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    return [
        re.findall(r"`([\w.]+)`", m.group(1))
        for m in re.finditer(r"^\d+\.\s+((?:`[\w.]+`,?\s*)+)", text, flags=re.MULTILINE)
    ]


def unit(module: str) -> str:
    """What a layer names: the package's top-level package or module a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def layer_violations(found: list[Import], stack: list[list[str]]) -> list[str]:
    level = {name: n for n, names in enumerate(stack) for name in names}
    bad = []
    for i in found:
        a, b = unit(i.source), unit(i.target)
        if a == b or b == PACKAGE:  # its own package; the package root (its version) is below all
            continue
        if level[b] >= level[a]:
            how = "a layer above" if level[b] > level[a] else "another package of its layer"
            bad.append(
                f"{i.where}: {i.source} (layer {level[a] + 1}) imports {i.target} ({how}: {level[b] + 1})"
            )
    return bad


def test_no_import_cycle() -> None:
    found = cycles(imports())
    edges = [
        f"  {i.where}: {i.source} -> {i.target}"
        for i in imports()
        if not i.typing_only and any(i.source in c and i.target in c for c in found)
    ]
    assert not found, "import cycles between modules of src/openforgerl:\n" + "\n".join(
        [*(" <-> ".join(c) for c in found), *edges]
    )


def test_every_package_has_one_layer() -> None:
    stack = layers()
    named = [name for names in stack for name in names]
    units = {unit(m) for m in modules()} - {PACKAGE}
    assert len(stack) > 5 and len(named) == len(set(named)), stack
    assert set(named) == units, (
        f"in no layer of docs/architecture.md: {sorted(units - set(named))}; "
        f"in a layer but not in src: {sorted(set(named) - units)}"
    )


def test_no_import_reaches_up_the_layers() -> None:
    bad = layer_violations(imports(), layers())
    assert not bad, "imports against docs/architecture.md's layer order:\n" + "\n".join(bad)


def test_the_package_root_imports_nothing_of_the_package() -> None:
    # Every layer may import the root (its version): it must stay below them all.
    assert not [i for i in imports() if i.source == PACKAGE]


def sandbox_modules(src: Path = SRC) -> tuple[str, ...]:
    """harnesses/launch.py's SANDBOX_MODULES, read from its source (its expression evaluated alone)."""
    tree = ast.parse((src / PACKAGE / "harnesses" / "launch.py").read_text())
    value = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "SANDBOX_MODULES" for t in node.targets)
    )
    return tuple(eval(compile(ast.Expression(value), "SANDBOX_MODULES", "eval"), {}))


def test_what_a_sandbox_sees_of_the_package_is_closed_under_its_imports() -> None:
    # The built-in harnesses and the local sites run inside a sandbox that sees only SANDBOX_MODULES of
    # the package: a module split in two must bring its new half along.
    mods = modules()
    seen = {
        name for name, path in mods.items() if path.relative_to(SRC / PACKAGE).as_posix() in sandbox_modules()
    }
    assert "openforgerl.harnesses.react" in seen and "openforgerl.web.serve" in seen, seen
    missing = [
        f"{i.where}: {i.source} imports {i.target}"
        for i in imports()
        if i.source in seen and i.target not in seen and not i.typing_only  # those never run
    ]
    assert not missing, (
        "imports of modules that a sandbox does not see (harnesses/launch.py SANDBOX_MODULES):\n"
        + ("\n".join(missing))
    )


MAX_LINES = 600
MAX_FUNCTION_LINES = 100


def long_modules(src: Path = SRC) -> dict[str, int]:
    """The modules over MAX_LINES lines, with their lengths."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules(src).items()}
    return {name: n for name, n in lengths.items() if n > MAX_LINES}


def long_functions(src: Path = SRC) -> dict[str, int]:
    """The functions and methods over MAX_FUNCTION_LINES lines (decorators left out), by
    module:qualified name, with their lengths."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = (child.end_lineno or child.lineno) - child.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        out[f"{module}:{name}"] = n
                visit(child, module, f"{name}.")
            else:
                visit(child, module, prefix)

    for name, path in modules(src).items():
        visit(ast.parse(path.read_text(), str(path)), name, "")
    return out


def test_no_module_is_over_600_lines() -> None:
    long = long_modules()
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def test_no_function_is_over_100_lines() -> None:
    long = long_functions()
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them along their seams): {long}"


def test_the_checks_find_planted_violations(tmp_path: Path) -> None:
    # A package with one of each fault: the checks above pass on src only if they would see them.
    pkg = tmp_path / PACKAGE
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from openforgerl.high import b\n")  # up the layers
    (pkg / "high.py").write_text("from openforgerl.low import a\nb = 1\n")  # and a circle
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "big.py").write_text(f"class C:\n    def long(self):\n{body.replace('    ', '        ')}\n")
    (pkg / "many.py").write_text("x = 1\n" * (MAX_LINES + 1))
    found = imports(tmp_path)
    assert cycles(found) == [["openforgerl.high", "openforgerl.low.a"]]
    stack = [["low", "big", "many"], ["high"]]
    assert [v.split(": ", 1)[1] for v in layer_violations(found, stack)] == [
        "openforgerl.low.a (layer 1) imports openforgerl.high (a layer above: 2)"
    ]
    assert long_functions(tmp_path) == {"openforgerl.big:C.long": MAX_FUNCTION_LINES + 1}
    assert long_modules(tmp_path) == {"openforgerl.many": MAX_LINES + 1}
