"""The mutation harness (tools/mutation) and the optional-extras check (tests/support/extras.py).

Reference: hand-built trees and the exact message texts (no code path under test computes them)."""

import importlib.util
import shutil
from pathlib import Path

import pytest
from support.extras import MPIEXEC_MISSING, require_mpiexec

from tools.mutation.mutants import MUTANTS, Mutant
from tools.mutation.run import Stale, apply

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_mutant_applies_to_this_tree(tmp_path):
    """A code change that moves a mutant's snippet must update the mutant (else it would go STALE).

    Slow-only: the default suite must not pin every mutated line, or each refactor fails CI until
    the mutant file is edited; `python -m tools.mutation --check` is the same check on demand."""
    stale = []
    for m in MUTANTS:
        text = (ROOT / m.file).read_text()
        if text.count(m.original) != 1:
            stale.append(f"{m.name}: snippet found {text.count(m.original)}x in {m.file}")
    assert not stale, "update tools/mutation/mutants/: " + "; ".join(stale)
    assert len(MUTANTS) >= 40 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert all(m.original != m.mutated for m in MUTANTS)


def test_apply_replaces_exactly_once_and_reports_stale(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\ny = x + 1\n")
    m = Mutant("m", "t", "a.py", "x + 1", "x - 1", "why")
    assert apply(m, tmp_path) == "x = 1\ny = x + 1\n"
    assert (tmp_path / "a.py").read_text() == "x = 1\ny = x - 1\n"
    with pytest.raises(Stale, match="occurs 0 times in a.py"):
        apply(m, tmp_path)  # already mutated: the original is gone
    (tmp_path / "a.py").write_text("x + 1; x + 1\n")
    with pytest.raises(Stale, match="occurs 2 times in a.py"):
        apply(m, tmp_path)
    with pytest.raises(Stale, match="b.py does not exist"):
        apply(Mutant("m", "t", "b.py", "a", "b", "why"), tmp_path)


def _outcome(f) -> tuple[type, str]:
    """(exception type, message) that f raised; skip/fail outcomes are caught, not propagated."""
    try:
        f()
    except BaseException as e:  # noqa: BLE001  # pytest's Skipped/Failed derive from BaseException
        return type(e), str(e)
    return type(None), ""


def test_mpi4py_without_mpiexec_fails_instead_of_skipping(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mpi4py" else real(name, *a))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert _outcome(require_mpiexec) == (pytest.fail.Exception, MPIEXEC_MISSING)


def test_without_mpi4py_the_skip_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    assert _outcome(require_mpiexec) == (pytest.skip.Exception,
                                         "needs the [mpi] extra (mpi4py + mpich): pip install -e '.[mpi]'")
