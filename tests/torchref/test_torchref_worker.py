"""torchref.worker.main, the entry point of an mpiexec-launched rank, run as one process (MPI's
singleton init, no mpiexec): where its output goes. The strategy body (`run_process`) and the job
file are stubbed, so no model (nor torch) is loaded; 0.3 s."""

import subprocess
import sys

from support.extras import require_mpiexec

# Stubs: the job names only its out dir; the "strategy" prints one line to each stream.
SCRIPT = """
import sys, types
out = sys.argv.pop()
runtime = types.ModuleType("torchref.runtime")  # stands in for the real one (no torch import: 0.3 s, not 4)
runtime.Job = types.SimpleNamespace(from_json=lambda s: types.SimpleNamespace(out=out))
sys.modules["torchref.runtime"] = runtime
from torchref import worker
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
