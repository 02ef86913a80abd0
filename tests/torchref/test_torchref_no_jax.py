"""torchref workers never import jax: the boundary that lets a rank start in the time torch and
transformers take, and keeps the reference independent of the code it checks.

How: `tests/jaxfree_hook/sitecustomize.py` is put on the PYTHONPATH of the processes the launcher
starts; in every process whose argv[0] is `torchref/zygote.py` (the fork server whose forked
children are the ranks of single / single-ps / distributed-ps) or `torchref/worker.py` (the
mpiexec ranks of horovod) it records each import of jax or jaxlib with its stack, and marks that
it ran. (The launcher needs no jax either since torchref imports nothing from jaxpar, only the
jax-free `gpt2common`: tests/test_import_graph.py and tests/models/test_shared_boundary.py check that
statically and in a fresh interpreter; this test process itself has imported jax already.)
"""

import os
import shutil
from pathlib import Path

import pytest

HOOK = str(Path(__file__).parents[1] / "jaxfree_hook")
ARGS = ["model=gpt2-tiny", "train.seq_len=16", "train.batch_size=4", "train.steps=2", "train.log_every=0"]


def _run_watched(tmp_path, monkeypatch, strategy: str, workers: int) -> tuple[list[str], dict[str, str]]:
    """Train `strategy` with fresh worker processes under the watch; returns (watched argv0s,
    {forbidden-import file: its stack})."""
    from torchref import launch
    from torchref.config import resolve_ref

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (HOOK, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("JAXFREE_DIR", str(marks))
    monkeypatch.setenv("JAXFREE_WATCH", "torchref/zygote.py,torchref/worker.py")
    monkeypatch.setenv("JAXFREE_FORBID", "jax,jaxlib")
    # A zygote another test started (without the watch) would serve the ranks: start our own.
    monkeypatch.setattr(launch, "_ZYGOTE", None)
    try:
        cfg, ref = resolve_ref(ARGS + [f"strategy={strategy}", f"workers={workers}", f"out={tmp_path / 'run'}"])
        summary = launch.train(cfg, ref)
    finally:
        if launch._ZYGOTE is not None:  # EOF on stdin ends our zygote
            proc, replies = launch._ZYGOTE
            proc.stdin.close()
            proc.wait(30)
            replies.close()
    assert summary["steps"] == 2
    watched = [p.read_text() for p in marks.glob("watched.*")]
    forbidden = {p.name: p.read_text() for p in marks.glob("forbidden.*")}
    return watched, forbidden


def test_forked_ranks_import_no_jax(tmp_path, monkeypatch):
    watched, forbidden = _run_watched(tmp_path, monkeypatch, "distributed-ps", 2)
    # The zygote and both forked ranks each imported something new under the watch.
    assert len(watched) == 3 and all(w.endswith("torchref/zygote.py") for w in watched), watched
    assert not forbidden, "\n\n".join(forbidden.values())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (pip install mpich)")
def test_mpi_ranks_import_no_jax(tmp_path, monkeypatch):
    watched, forbidden = _run_watched(tmp_path, monkeypatch, "horovod", 2)
    assert len(watched) == 2 and all(w.endswith("torchref/worker.py") for w in watched), watched
    assert not forbidden, "\n\n".join(forbidden.values())
