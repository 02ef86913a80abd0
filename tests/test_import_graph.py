"""No import cycles among jaxpar/, torchref/ and parity_tests/ modules, function-level imports
included (why: tests/import_graph.py)."""

from pathlib import Path

from import_graph import build_graph, cycles, importers

ROOT = Path(__file__).parent.parent


def test_project_has_no_import_cycles():
    graph = build_graph(ROOT)
    assert {"jaxpar.commands", "jaxpar.train", "torchref.worker", "parity_tests.common"} <= graph.keys()
    assert cycles(graph) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_graph_sees_function_level_relative_and_package_imports_not_type_checking(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from . import b\n",                       # fn-level, relative
        "pkg/b.py": "import pkg.sub.c\n",                                    # also runs pkg/sub/__init__
        "pkg/sub/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "pkg/sub/c.py": "from ..a import f\nclass K:\n    import pkg.b\n",    # class bodies run at import
        "pkg/d.py": "from pkg.sub import c\nimport os\n",
    })
    g = build_graph(tmp_path, packages=("pkg",))
    assert g["pkg.a"] == {"pkg.b": {"fn"}}
    assert g["pkg.b"] == {"pkg.sub": {"top"}, "pkg.sub.c": {"top"}}
    assert g["pkg.sub"] == {}  # TYPE_CHECKING-only import
    assert g["pkg.sub.c"] == {"pkg.a": {"top"}, "pkg.b": {"top"}}  # own parent packages are not edges
    assert g["pkg.d"] == {"pkg.sub": {"top"}, "pkg.sub.c": {"top"}}
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert importers(g, "pkg.sub.c") == {"pkg.b": {"top"}, "pkg.d": {"top"}}
