"""`examples/05_six_strategies.sh` (torchref compare): every strategy at 2 workers, the table,
the JSON and the plot; the numbers in them checked against `single` and the analytic volumes.
This is also where horovod (algorithm=mpi) and horovod-amp at 2 workers are checked in the
default test run (test_torchref_strategies covers the ring algorithm and 4 workers)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.extras import require_mpiexec

from jaxpar.tolerances import LOSS_RTOL_AMP, LOSS_RTOL_FP32

ROOT = Path(__file__).resolve().parents[2]


def test_example_six_strategies(tmp_path):
    require_mpiexec()
    out = tmp_path / "cmp"
    r = subprocess.run(["bash", str(ROOT / "examples" / "05_six_strategies.sh"), str(out), "train.steps=3",
                        "train.seq_len=32"], capture_output=True, text=True, check=False, timeout=600, cwd=ROOT,
                       env=dict(os.environ, PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"plot:             {out}/compare.png" in r.stdout
    doc = json.loads((out / "compare.json").read_text())
    rows = {(x["strategy"], x["workers"]): x for x in doc["rows"]}
    assert list(rows) == [("single", 1), ("single-ps", 2), ("distributed-ps", 2), ("horovod", 2),
                          ("distributed-ps-amp", 2), ("horovod-amp", 2)]
    single = rows["single", 1]
    psi = single["param_bytes"]
    assert psi == 1_849_344
    base = np.array(single["losses"])
    assert len(base) == 3
    for (s, n), x in rows.items():
        rel = np.max(np.abs(np.array(x["losses"]) - base) / base)
        assert rel <= (LOSS_RTOL_AMP if s.endswith("-amp") else LOSS_RTOL_FP32), (s, rel)
        assert x["speedup"] == pytest.approx(x["tokens_per_s"] / single["tokens_per_s"])
        assert x["efficiency"] == pytest.approx(x["speedup"] / n)
        assert x["peak_rss_mb"] > 50
        if s == "single":
            assert x["worker_bytes_per_step"] == 0
        elif s == "single-ps":
            assert x["worker_bytes_per_step"] == 2 * psi  # Psi up + Psi down
            assert x["server_bytes_per_step"] == 2 * psi * n
        else:
            assert x["worker_bytes_per_step"] == 2 * (2 * (n - 1) * psi // n)  # ring, sent + received
            assert x["server_bytes_per_step"] is None
    md = (out / "compare.md").read_text()
    assert ("| strategy | N | tokens/s | speed-up | efficiency | step time (s) | peak RSS/proc (MB) | "
            "bytes/step/worker | bytes/step at server | final loss |") in md
    assert md.count("\n| ") == 7  # header + 6 strategies
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    for (s, n) in rows:
        assert (out / f"{s}-w{n}" / "hf" / "model.safetensors").is_file()


def test_row_medians_leave_out_the_first_step_only():
    """tokens/s and step time are medians over the steps after the first (which pays for warm-up);
    bytes are a mean over every step. Reference: medians of the rows written down here, by hand."""
    from torchref.compare import row_of

    rows = [{"step": i + 1, "tokens_per_s": tps, "step_time_s": st, "bytes_sent": 10, "bytes_received": 30,
             "loss": 5.0 - i} for i, (tps, st) in enumerate([(1000.0, 0.01), (100.0, 0.5), (300.0, 0.2), (200.0, 0.3),
                                                             (50.0, 0.9)])]
    summary = {"strategy": "horovod", "workers": 2, "procs": [{"role": "worker", "peak_rss_bytes": 2**20}],
               "wall_s": 3.0, "param_bytes": 4, "out": "x"}
    r = row_of(summary, rows)
    # steps 2..5: tokens/s 100, 300, 200, 50 -> median 150; step time 0.5, 0.2, 0.3, 0.9 -> 0.4
    # (steps 1..4 would give 250 and 0.25)
    assert (r["tokens_per_s"], r["step_time_s"]) == (150.0, 0.4)
    assert (r["worker_bytes_per_step"], r["server_bytes_per_step"], r["final_loss"]) == (40, None, 1.0)


def test_peak_rss_column_is_the_largest_process_not_their_sum():
    """'peak RSS/proc (MB)': the largest peak RSS of the run's processes, in MiB."""
    from torchref.compare import row_of

    rows = [{"tokens_per_s": 1.0, "step_time_s": 1.0, "bytes_sent": 0, "bytes_received": 0, "loss": 1.0,
             "server_bytes_sent": 5, "server_bytes_received": 7}]
    procs = [{"role": "server", "peak_rss_bytes": 300 * 2**20}, {"role": "worker", "peak_rss_bytes": 100 * 2**20},
             {"role": "worker", "peak_rss_bytes": 200 * 2**20}]
    r = row_of({"strategy": "single-ps", "workers": 2, "procs": procs, "wall_s": 1.0, "param_bytes": 4, "out": "x"},
               rows)
    assert (r["peak_rss_mb"], r["server_bytes_per_step"]) == (300.0, 12)
