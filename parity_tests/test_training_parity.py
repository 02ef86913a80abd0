"""Training parity: N=10-step loss trajectories, step-1 gradients and logged grad norms of jaxpar
configurations and torchref strategies against the PyTorch reference (torchref `single`), all
through the public CLIs from one shared init and one prepared data set.

Default run: the cross-framework pair on one device (jaxpar single vs torchref single).
Full matrix (every jaxpar mesh, all six torchref strategies, bf16 variants; ~10 min on 2 cores):

    python -m pytest -q -m slow parity_tests        # or: python -m parity_tests.report
"""

import json

import numpy as np
import pytest

from parity_tests import matrix
from parity_tests.tolerances import TRAJECTORY

pytest.importorskip("torch", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")


def _check(row: dict) -> None:
    tol = TRAJECTORY[row["precision"]]
    detail = json.dumps({k: row[k] for k in ("row", "max_loss_rel", "max_grad", "worst_grad_param",
                                             "max_grad_norm_rel", "losses")})
    assert row["steps"] == matrix.STEPS == 10, detail
    assert row["grad_params"] == 28, detail  # every gpt2-tiny parameter tensor
    assert row["max_loss_rel"] <= tol["loss_rel"], detail
    assert row["max_grad"] <= row["grad_bound"] == tol[row["grad_metric"]], detail
    assert row["max_grad_norm_rel"] <= row["grad_bound"], detail
    assert row["pass"], detail
    # the run trains: 10 steps move the loss by far more than any bound
    assert row["first_loss"] - row["last_loss"] > 0.5, detail


@pytest.fixture(scope="module")
def fast_matrix(tmp_path_factory):
    return matrix.run_matrix(str(tmp_path_factory.mktemp("fast")), list(matrix.FAST), log=lambda m: None)


def test_fast_subset_jaxpar_single_matches_torchref_single(fast_matrix):
    rows = {r["row"]: r for r in fast_matrix["rows"]}
    assert set(rows) == set(matrix.FAST)
    _check(rows["jaxpar single"])
    ref = rows[matrix.REFERENCE.name]
    assert ref["max_loss_rel"] == ref["max_grad"] == 0.0  # the reference against itself
    # loss at step 1 is the shared init's loss on batch 0: ~ln(256) for an untrained byte model
    assert abs(ref["first_loss"] - np.log(256)) < 0.1


def test_report_markdown_lists_rows_and_exclusions(fast_matrix):
    from parity_tests.report import markdown

    md = markdown({"training": fast_matrix, "pass": True})
    for r in fast_matrix["rows"]:
        assert f"| {r['row']} | {r['precision']} | {r['max_loss_rel']:.1e} |" in md
    assert "ps.async=true" in md and "asynchronous SGD" in md
    assert "Overall: PASS" in md


def test_every_configuration_is_a_row_or_excluded():
    names = [r.name for r in matrix.ROWS]
    jax_rows = [n for n in names if n.startswith("jaxpar")]
    for needed in ("single", "data=8", "fsdp=8", "tensor=4", "pipe=2", "3-D"):
        assert any(needed in n for n in jax_rows), needed
    torch_rows = {r.args[0].split("=")[1] for r in matrix.ROWS if r.tool == "torchref"}
    assert torch_rows == {"single", "single-ps", "distributed-ps", "horovod", "distributed-ps-amp", "horovod-amp"}
    assert all(("workers=2" in r.args) for r in matrix.ROWS if r.tool == "torchref" and r is not matrix.REFERENCE)
    assert {"fp32", "bf16"} == {r.precision for r in matrix.ROWS}
    assert all(len(reason) > 40 for reason in matrix.EXCLUDED.values())


@pytest.fixture(scope="module")
def full_matrix(tmp_path_factory):
    return matrix.run_matrix(str(tmp_path_factory.mktemp("full")), None, log=lambda m: None)


@pytest.mark.slow
@pytest.mark.parametrize("name", [r.name for r in matrix.ROWS])
def test_full_matrix_row(full_matrix, name):
    rows = {r["row"]: r for r in full_matrix["rows"]}
    assert "error" not in rows[name], rows[name]["error"]
    assert len(rows) == len(matrix.ROWS)
    _check(rows[name])
