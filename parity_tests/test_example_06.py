"""examples/06_parity.py: a user's own configuration against the PyTorch reference."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.matrix import clean_env
from parity_tests.tolerances import TRAJECTORY

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("torch", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")


def test_example_06_sharded_run_matches_reference():
    """A 2x2 (data, tensor) mesh on emulated CPU devices, 10 steps, fp32: every step within the table."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "06_parity.py"), "mesh.data=2", "mesh.tensor=2"],
                       capture_output=True, text=True, timeout=900, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    res = json.loads(lines[-1])
    assert res["steps"] == 10 and res["pass"] is True
    assert res["max_loss_rel"] <= TRAJECTORY["fp32"]["loss_rel"]
    assert res["max_grad_norm_rel"] <= TRAJECTORY["fp32"]["grad_rel"]
    assert "data=2 tensor=2, fp32" in lines[0]
    assert sum(1 for x in lines if x.startswith("| ") and x.split("|")[1].strip().isdigit()) == 10


@pytest.mark.slow
def test_example_06_rejects_bad_mesh_with_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "06_parity.py"), "mesh.tensor=3"],
                       capture_output=True, text=True, timeout=300, env=clean_env(), cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == "error: model.n_head=4 is not divisible by mesh.tensor=3"
