"""benchmarks/gpu_mfu.py refuses on a machine without a GPU: one line, exit 2, nothing written."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_refuses_on_cpu(tmp_path):
    out = tmp_path / "mfu.json"
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_mfu.py"), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: gpu_mfu.py measures GPU MFU and needs an NVIDIA GPU (none here: no /dev/nvidia*, no nvidia-smi, "
        "or JAX_PLATFORMS='cpu')"]
    assert r.stdout == "" and not out.exists()
