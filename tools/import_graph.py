"""The import graph of the project's packages, read statically with `ast` (nothing is imported).

What counts as an edge A -> B (A's source names B):
  * every `import` / `from ... import` in A, at module level AND inside functions. jaxpar imports
    JAX-heavy modules inside functions to set XLA flags first (commands.py), not to make cycles
    legal: a function-level cycle still means neither module can be read, tested or moved alone,
    and it runs as soon as both functions do. Each edge is tagged "top" or "fn" so reports can say
    which kind a cycle uses.
  * not imports under `if TYPE_CHECKING:` (never executed).
  * `from P import x` is an edge to the module P.x when that is a module, else to P; relative
    imports are resolved. Importing P.Q also runs P/__init__.py, so it is an edge to P too, except
    to A's own parent packages (a package importing its children is how packages work).
Only modules of the scanned packages are nodes; the standard library and third parties are not.

Run as a script to print the graph, its cycles and which modules import a given module:
    python tools/import_graph.py [ROOT] [--importers jaxpar.parallel.sharding,jaxpar.parallel.pipeline]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("gpt2common", "jaxpar", "torchref", "parity_tests")


def module_files(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under root/<package>."""
    mods = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """Yield (import node, is_top_level), skipping `if TYPE_CHECKING:` bodies."""
    stack = [(n, True) for n in tree.body]
    while stack:
        node, top = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, top
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((n, top) for n in node.orelse)
            continue
        # Bodies of if/try/with/class at module level run at import time; function bodies do not.
        runs = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, runs) for child in ast.iter_child_nodes(node))


def build_graph(root: Path, packages=PACKAGES) -> dict[str, dict[str, set[str]]]:
    """{importer: {imported: {"top", "fn"}}} over the modules of `packages` under `root`."""
    mods = module_files(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, set[str]]] = {}
    for m, path in mods.items():
        own_pkg = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        ancestors = {".".join(own_pkg[:i]) for i in range(1, len(own_pkg) + 1)} | {m}
        out: dict[str, set[str]] = {}
        for node, top in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: strip level-1 trailing parts of the package
                    parts = own_pkg[:len(own_pkg) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                target = resolve(name)
                if target is None:
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # the target and the packages it runs on the way
                    t = ".".join(parts[:i])
                    if t in mods and t not in ancestors:
                        out.setdefault(t, set()).add("top" if top else "fn")
        graph[m] = out
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted; sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def importers(graph: dict[str, dict[str, set[str]]], target: str) -> dict[str, set[str]]:
    """{module: edge kinds} of the modules that import `target` directly."""
    return {m: deps[target] for m, deps in sorted(graph.items()) if target in deps}


def main(argv: list[str]) -> None:
    root = Path(argv[0]) if argv and not argv[0].startswith("--") else Path(__file__).parent.parent
    graph = build_graph(root)
    for m, deps in sorted(graph.items()):
        print(m, "->", ", ".join(f"{d}({'+'.join(sorted(k))})" for d, k in sorted(deps.items())) or "-")
    print("cycles:", cycles(graph) or "none")
    if "--importers" in argv:
        for target in argv[argv.index("--importers") + 1].split(","):
            found = importers(graph, target)
            print(f"importers of {target}:", ", ".join(f"{m}({'+'.join(sorted(k))})" for m, k in found.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
