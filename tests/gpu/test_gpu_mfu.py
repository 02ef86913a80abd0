"""GPU lane: benchmarks/gpu_mfu.py prints its MFU line and the side-by-side line and writes both to
JSON, on a small shape (GPT-2 124M, B4 x T256, the eager PyTorch peer: no torch.compile wait).
The figures themselves are the benchmark's (benchmarks/gpu_session.sh), not this test's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.gpu import gpu_env, require_gpu, require_torch_cuda

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()
    require_torch_cuda()


def test_the_mfu_line_and_the_speedup_are_printed_and_written(tmp_path):
    out = tmp_path / "mfu.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_mfu.py"), "--models", "gpt2", "--batch", "4",
                        "--seq", "256", "--steps", "3", "--warmup", "2", "--torch", "eager", "--out", str(out)],
                       capture_output=True, text=True, env=gpu_env(), timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)  # the figures, in the lane's -s / -rA output
    assert re.search(r"^gpt2 +B=4 +T=256 +[\d.]+ ms/step +\d+ tok/s +[\d.]+ TFLOP/s +MFU [\d.]+%$", r.stdout, re.M)
    assert re.search(r"^jaxpar / torch \(eager\) gpt2 +B=4 +T=256 .* speedup [\d.]+x", r.stdout, re.M)
    rep = json.loads(out.read_text())
    (j,), (t,), (s,) = rep["rows"], rep["torch_rows"], rep["side_by_side"]
    assert t["device"] == "cuda" and 0 < j["mfu"] < 1 and 0 < t["mfu"] < 1
    assert s["speedup"] == t["median_step_s"] / j["median_step_s"]


def test_the_profile_joins_the_kernels_to_the_compiled_step(tmp_path):
    """benchmarks/gpu_profile.py on the same small shape: the GPU trace names each kernel's HLO
    instruction (cuBLAS gemms under their custom-call), so nearly all kernel time joins to the step
    and the matmuls to jaxpar's einsum/linear lines."""
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--model", "gpt2", "--batch", "4",
                        "--seq", "256", "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, env=gpu_env(), timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    rep = json.loads(out.read_text())
    busy, hlo = rep["kernels"]["busy_ms"], rep["hlo"]
    assert hlo["unjoined_ms"] <= 0.1 * sum(rep["kernels"]["by_class_ms"].values()), hlo["unjoined_ms"]
    matmuls = [row for row in hlo["rows"] if row["hlo"] and ("custom-call" in row["opcode"] or "dot" in row["ops"])]
    assert matmuls and any(s.startswith("precision.py") for row in matmuls for s in row["sources"]), matmuls[:3]
    assert busy > 0 and rep["hbm_tbps"] in (None, 2.0, 3.35, 4.8)
