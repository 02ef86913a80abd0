"""docs/testing.md's table of hand-written replacements covers every custom gradient in jaxpar/.

Reference: the package's source, parsed (ast): every function decorated with, or built by a call
of, `custom_vjp` / `custom_jvp`. A new one without a row (and so without a property test against
its reference) fails here; so does a row whose function or test no longer exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "testing.md"
CUSTOM = ("custom_vjp", "custom_jvp")


def _mentions_custom(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in CUSTOM or isinstance(n, ast.Name) and n.id in CUSTOM
               for n in ast.walk(node))


def custom_gradients(root: Path = ROOT) -> set[str]:
    """'path::qualname' of every custom_vjp / custom_jvp function under jaxpar/ (nested functions as
    'outer.inner'); raises on a use of either that is neither a decorator nor an assignment."""
    found = set()
    for path in sorted((root / "jaxpar").rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(root).as_posix()
        attributed = set()

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    for d in getattr(child, "decorator_list", []):
                        if _mentions_custom(d):
                            found.add(f"{rel}::{name}")
                            attributed.update(id(n) for n in ast.walk(d))
                    visit(child, f"{name}.")
                elif isinstance(child, ast.Assign) and _mentions_custom(child.value):
                    for t in child.targets:
                        if isinstance(t, ast.Name):
                            found.add(f"{rel}::{prefix}{t.id}")
                    attributed.update(id(n) for n in ast.walk(child.value))
                else:
                    visit(child, prefix)

        visit(tree, "")
        stray = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Name))
                 and getattr(n, "attr", getattr(n, "id", None)) in CUSTOM and id(n) not in attributed]
        assert not stray, f"{rel}: custom_vjp/custom_jvp used at lines {stray} outside a decorator or assignment"
    return found


def table_rows() -> dict[str, list[str]]:
    """'path::qualname' -> the test ids of its row in docs/testing.md's table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`jaxpar/"):
            rows[cells[0].strip("`")] = re.findall(r"`(tests/[\w/]+\.py::\w+)`", cells[2])
    return rows


def _defines(path: Path, qualname: str) -> bool:
    """Whether `path` defines qualname ('outer.inner' for a nested def)."""
    node = ast.parse(path.read_text())
    for part in qualname.split("."):
        node = next((n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
                    None)
        if node is None:
            return False
    return True


def test_every_custom_gradient_has_a_row_with_a_property_test():
    found, rows = custom_gradients(), table_rows()
    assert len(found) >= 8  # the parser sees the ones the package has (layernorm, softmax, gelu, ...)
    assert sorted(found - set(rows)) == [], "custom gradients without a row in docs/testing.md"
    stale = [r for r in rows if not _defines(ROOT / r.split("::")[0], r.split("::")[1])]
    assert stale == [], "rows naming a function that no longer exists"
    for row, tests in rows.items():
        assert tests, f"{row}: no test named"
        for t in tests:
            path, name = t.split("::")
            assert _defines(ROOT / path, name), f"{row}: {t} does not exist"


def test_the_finder_sees_a_new_custom_gradient(tmp_path):
    """A decorated function, a nested one and an assigned one are all found (the check above relies on it)."""
    pkg = tmp_path / "jaxpar" / "models"
    pkg.mkdir(parents=True)
    (pkg / "new_op.py").write_text(
        "import functools\nimport jax\n\n\n@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))\n"
        "def fast_op(x, n):\n    return x\n\n\ndef make():\n    @jax.custom_jvp\n    def inner(x):\n"
        "        return x\n    return inner\n\n\nslow = jax.custom_vjp(lambda x: x)\n")
    assert custom_gradients(tmp_path) == {"jaxpar/models/new_op.py::fast_op", "jaxpar/models/new_op.py::make.inner",
                                          "jaxpar/models/new_op.py::slow"}
