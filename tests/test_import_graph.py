"""No import cycles among jaxpar/, torchref/ and parity_tests/ modules, function-level imports
included (why: tools/import_graph.py)."""

from pathlib import Path

from tools.import_graph import build_graph, cycles, importers

ROOT = Path(__file__).parent.parent


def test_project_has_no_import_cycles():
    graph = build_graph(ROOT)
    assert {"jaxpar.run.commands", "jaxpar.train", "torchref.worker", "parity_tests.common"} <= graph.keys()
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


# The declared boundary (gpt2common/__init__.py): torchref may import from jaxpar only what is listed
# here. Nothing: everything the two share lives in gpt2common (jaxpar.tolerances, stdlib only, is
# imported by tests and parity_tests, not by torchref).
TORCHREF_MAY_IMPORT_FROM_JAXPAR: set[str] = set()


def test_boundary_torchref_imports_no_jaxpar_and_gpt2common_imports_neither():
    graph = build_graph(ROOT)
    shared = {m for m in graph if m.split(".")[0] == "gpt2common"}
    assert {"gpt2common.grammar", "gpt2common.model", "gpt2common.init", "gpt2common.hf", "gpt2common.data",
            "gpt2common.outdir"} <= shared
    leaks = {(m, d) for m in shared for d in graph[m] if d.split(".")[0] != "gpt2common"}
    assert leaks == set(), "gpt2common imports project code outside itself"
    from_jaxpar = {(m, d) for m, deps in graph.items() if m.split(".")[0] == "torchref"
                   for d in deps if d.split(".")[0] == "jaxpar" and d not in TORCHREF_MAY_IMPORT_FROM_JAXPAR}
    assert from_jaxpar == set(), "torchref imports jaxpar"
    # both sides really use the shared package (not a copy of it)
    assert {"gpt2common.grammar", "gpt2common.data", "gpt2common.hf"} <= set(graph["torchref.launch"]) | set(
        graph["torchref.runtime"]) | set(graph["torchref.config"]) | set(graph["torchref.model"])
    assert "gpt2common.grammar" in graph["jaxpar.config"] and "gpt2common.init" in graph["jaxpar.models.gpt2"]


def test_no_module_is_named_like_a_standard_library_module():
    """`jaxpar/inspect.py` once shadowed `inspect` for any script run from jaxpar/: names stay distinct."""
    import sys

    mods = build_graph(ROOT).keys()
    assert [m for m in mods if m.rsplit(".", 1)[-1] in sys.stdlib_module_names] == []


def test_jaxpar_root_holds_only_the_entry_point_the_step_and_the_shared_vocabulary():
    """The wings: parallel/ (layout, mesh, rules, shard_map programs), models/ (GPT-2 and its
    numerics), run/ (commands and run plumbing), planner/; the root keeps what every wing shares."""
    root = ROOT / "jaxpar"
    assert sorted(p.stem for p in root.glob("*.py")) == ["__init__", "cli", "config", "optim", "tolerances", "train"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "models", "parallel", "planner", "run"]
