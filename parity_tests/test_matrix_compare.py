"""What a parity-matrix row is judged on (`matrix.compare`), on hand-made trajectories and gradients,
no runs: the worst step's loss difference, the worst tensor's gradient difference (max-norm for fp32
rows, l2 for bf16 ones) and the logged grad norms, every one of them needed for a pass.
Reference: differences planted here by hand against a flat reference (losses 4.0, grad norms 2.0,
gradients of ones), so each expected figure is the planted one."""

import numpy as np
import pytest

from parity_tests import matrix
from parity_tests.common import worst
from parity_tests.tolerances import TRAJECTORY

REF = {"losses": [4.0] * 10, "grad_norms": [2.0] * 10}
REF_G = {"a": np.ones(10_000), "b": np.ones(100)}


def _grads(da: float = 0.0, db: float = 0.0) -> dict:
    """REF_G with one entry of `a` off by da and one of `b` off by db: rel_inf da (db), rel_l2 da/100 (db/10)."""
    a, b = np.ones(10_000), np.ones(100)
    a[7] += da
    b[3] += db
    return {"a": a, "b": b}


def _row(precision: str) -> matrix.Row:
    return matrix.Row("planted", "jaxpar", (), precision)


def test_one_diverging_step_fails_the_loss_check():
    res = {"losses": [4.0] * 9 + [4.0 * (1 + 5e-6)], "grad_norms": [2.0] * 10}
    r = matrix.compare(_row("fp32"), res, REF, _grads(), REF_G)
    assert r["max_loss_rel"] == pytest.approx(5e-6, rel=1e-6)  # the worst step, not the mean over 10 (5e-7)
    assert r["checks"] == {"loss": False, "grad": True, "grad_norm": True} and r["pass"] is False


def test_fp32_gradients_are_judged_in_max_norm_on_the_worst_tensor():
    res = {"losses": [4.0] * 10, "grad_norms": [2.0] * 10}
    r = matrix.compare(_row("fp32"), res, REF, _grads(da=1e-3, db=2e-4), REF_G)
    # max-norm per tensor: a 1e-3, b 2e-4 -> a is the worst (in l2 b would be: a 1e-5, b 2e-5)
    assert (r["grad_metric"], r["worst_grad_param"]) == ("grad_rel", "a")
    assert r["max_grad"] == pytest.approx(1e-3, rel=1e-9) and r["grad_bound"] == TRAJECTORY["fp32"]["grad_rel"]
    assert r["checks"]["grad"] is False and r["pass"] is False
    assert worst({"x": 0.5, "y": 2.0, "z": 1.0}) == ("y", 2.0)


def test_bf16_gradients_are_judged_in_l2():
    res = {"losses": [4.0] * 10, "grad_norms": [2.0] * 10}
    r = matrix.compare(_row("bf16"), res, REF, _grads(da=1e-3, db=2e-4), REF_G)
    assert (r["grad_metric"], r["worst_grad_param"]) == ("grad_l2_rel", "b")
    assert r["max_grad"] == pytest.approx(2e-5, rel=1e-6) and r["pass"] is True


def test_an_off_grad_norm_trajectory_alone_fails_the_row():
    res = {"losses": [4.0] * 10, "grad_norms": [2.0] * 9 + [2.0 * (1 + 1e-4)]}
    r = matrix.compare(_row("fp32"), res, REF, _grads(), REF_G)
    assert r["max_grad_norm_rel"] == pytest.approx(1e-4, rel=1e-6)
    assert r["checks"] == {"loss": True, "grad": True, "grad_norm": False} and r["pass"] is False
    same = matrix.compare(_row("fp32"), dict(REF), REF, _grads(), REF_G)
    assert same["pass"] is True and same["max_loss_rel"] == same["max_grad"] == 0.0
