"""examples/10_state_handoff.sh: a 2x2 jaxpar run handed to torchref and a torchref run handed to
jaxpar's 2x2 mesh, mid-run; the continued steps equal the runs that stayed (fp32 table)."""

import json
import subprocess
from pathlib import Path

import pytest

from parity_tests.matrix import clean_env
from parity_tests.tolerances import TRAJECTORY

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("torch", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")


@pytest.mark.slow
def test_example_10_hands_the_state_over_both_ways(tmp_path):
    env = {**clean_env(), "N": "3", "M": "3"}
    r = subprocess.run(["bash", str(ROOT / "examples" / "10_state_handoff.sh"), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    tol = TRAJECTORY["fp32"]
    for moved in ("jaxpar_to_torchref", "torchref_to_jaxpar"):
        assert res[moved]["steps"] == [4, 5, 6], res
        assert res[moved]["max_loss_rel"] <= tol["loss_rel"], res
        assert res[moved]["max_grad_norm_rel"] <= tol["grad_rel"], res
    assert sum(1 for x in r.stdout.splitlines() if x.startswith("| ") and x.split("|")[1].strip().isdigit()) == 6
