"""examples/02_mesh_utilities.py and examples/03_multi_process.sh run and print what they promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support.extras import require_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def test_example_02_mesh_utilities():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "02_mesh_utilities.py")], env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.splitlines()[0] == "mesh: data=2×fsdp=2×tensor=2×pipe=1 = 8 devices, axis types Auto"
    assert ("rejected: mesh data=2×fsdp=1×tensor=1×pipe=1 needs 2 devices but 8 are available "
            "(the product of mesh sizes must equal the device count)") in out
    # wte (256, 128): vocab over tensor=2, embed over fsdp=2 -> (128, 64) per device
    assert re.search(r"^wte\.weight\s+\(256, 128\)\s+\('tensor', 'fsdp'\)\s+\(128, 64\)$", out, re.M)
    m = re.search(r"measured ([\d.]+) KiB vs theory ([\d.]+) KiB \(dp ([\d.]+) \+ fsdp ([\d.]+) \+ tp ([\d.]+)\)", out)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0
    measured, theory, dp, fsdp, tp = map(float, m.groups())
    # the measured total is the sum of the kinds printed above it, the theory the sum of its terms (each
    # rounded to 0.1 KiB), and the two within 5% as test_comm_bytes finds for ZeRO-3 x tensor
    kinds = re.search(r"^step collectives per device: (.*)$", out, re.M)[1]
    assert abs(sum(float(x) for x in re.findall(r"([\d.]+) KiB", kinds)) - measured) <= 0.2, (kinds, measured)
    assert abs(dp + fsdp + tp - theory) <= 0.2 and 0.95 <= measured / theory <= 1.05, m.group(0)


@pytest.mark.slow
def test_example_03_multi_process(tmp_path):
    require_mpiexec()
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "03_multi_process.sh"), str(tmp_path / "o")],
                       env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in r.stdout.splitlines()
             if ln.startswith(("launch [", "mpiexec ["))}
    assert set(lines) == {"launch", "mpiexec"}
    assert lines["launch"] == lines["mpiexec"]  # same losses (rounded to 1e-6) from both launches
