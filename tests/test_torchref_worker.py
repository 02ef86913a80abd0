"""torchref.worker.main, the entry point of an mpiexec-launched rank, run as one process (MPI's
singleton init, no mpiexec): where its output goes. The strategy body (`run_process`) and the job
file are stubbed, so no model is built; ~3 s, most of it importing torch and MPI."""

import subprocess
import sys

from extras import require_mpiexec

# Stubs: the job names only its out dir; the "strategy" prints one line to each stream.
SCRIPT = """
import sys, types
from torchref import runtime, worker
out = sys.argv.pop()
runtime.Job.from_json = staticmethod(lambda s: types.SimpleNamespace(out=out))
worker.run_process = lambda job, rank, world: (print("rank stdout", flush=True),
                                               print("rank stderr", file=sys.stderr, flush=True))
worker.main()
"""


def test_rank0_keeps_the_console_and_its_log_starts_empty(tmp_path):
    """Rank 0's stdout (the progress lines) stays on the console; its stderr goes to
    <out>/logs/rank0.log, truncated first, so a reused out dir's log holds only this run's lines
    (the launcher quotes a dead rank's log tail)."""
    require_mpiexec()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").write_text("RuntimeError: a previous run's failure\n")
    (tmp_path / "job.json").write_text("{}")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "job.json"), str(tmp_path)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert (r.returncode, r.stdout) == (0, "rank stdout\n"), r.stderr
    assert (tmp_path / "logs" / "rank0.log").read_text() == "rank stderr\n"
