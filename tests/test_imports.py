"""The package's shape: no import cycles, small modules, a core free of the [eval] extra, families apart.

Imports are read from the source with `ast` (no module is imported): module level and inside functions,
relative imports resolved, `if TYPE_CHECKING:` blocks skipped. Importing `a.b.c` also runs the `__init__`
of every package on the way that is not already running (not an ancestor of the importer), so those count
as imports too; a package whose `__init__` imports all its submodules through pkgutil imports each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvsum"
MAX_LINES = 300
NOT_CORE = ("kvsum.eval", "kvsum.report", "kvsum.stability", "kvsum.cli", "kvsum.commands",  # the CLI's commands
            "kvsum.demo")
EXTRA = ("matplotlib", "rich")  # what the [eval] extra brings
GATEWAY = "kvsum.extras"  # the one core module that reaches the extra, and only where it is installed
FAMILIES = ("evict", "quant", "summary", "reconstruct")


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}
PACKAGES = {_name(p) for p in MODULES.values() if p.name == "__init__.py"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every import statement of the tree, `if TYPE_CHECKING:` bodies left out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_ancestor(pkg: str, module: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


def imports(module: str) -> tuple[set[str], set[str]]:
    """(kvsum modules, other top-level packages) that `module` imports."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if module in PACKAGES else module.rpartition(".")[0]
    targets, external = set(), set()
    for node in _statements(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            if name.split(".")[0] != "kvsum":
                external.add(name.split(".")[0])
                continue
            while name not in MODULES:  # `import kvsum.x.attr`-like names: the module that holds them
                name = name.rpartition(".")[0]
            targets.add(name)
            parts = name.split(".")
            for i in range(1, len(parts)):  # package __init__s run on the way, unless already running
                pkg = ".".join(parts[:i])
                if not _is_ancestor(pkg, module):
                    targets.add(pkg)
    if module in PACKAGES and "walk_packages(__path__" in path.read_text():
        targets |= {m for m in MODULES if m.startswith(module + ".")}
    targets.discard(module)
    return targets, external


GRAPH = {m: imports(m)[0] for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: every group of modules that import each other (directly or not), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(m):  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for n in graph.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while not group or group[-1] != m:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1 or m in graph.get(m, ()):
                out.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(out)


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}}) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_imports_are_read_with_function_level_and_relative_ones():
    assert "kvsum.errors" in GRAPH["kvsum.compress"]
    assert "kvsum.methods.registry" in GRAPH["kvsum.methods.full"]
    assert "kvsum.methods" not in GRAPH["kvsum.methods.full"]  # an ancestor: already running
    assert "kvsum.methods.full" in GRAPH["kvsum.methods"]  # imported through pkgutil


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles among: " + "; ".join(", ".join(c) for c in found)


def test_no_module_over_300_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _core(module: str) -> bool:
    return not any(_is_ancestor(n, module) for n in NOT_CORE)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _core(m)))
def test_the_core_imports_no_eval_extra(module):
    targets, external = imports(module)
    bad = sorted(t for t in targets if not _core(t))
    if module != GATEWAY:
        bad += sorted(set(external) & set(EXTRA))
    assert not bad, f"{module} (core) imports {', '.join(bad)}"


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["kvsum", "methods"] and parts[2] in FAMILIES else None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _family(m)))
def test_families_do_not_import_each_other(module):
    own = _family(module)
    bad = sorted(t for t in GRAPH[module] if _family(t) not in (None, own))
    assert not bad, f"{module} ({own}) imports {', '.join(bad)}"
