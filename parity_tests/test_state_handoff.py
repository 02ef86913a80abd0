"""The training state moves between the frameworks mid-run (parity_tests/handoff.py): N steps in
one, M in the other, every continued step's loss and grad norm within TRAJECTORY["fp32"] of the
runs that stay in one framework, in both directions.

Default: a data x fsdp x tensor mesh (2 x 2 x 2, 8 emulated devices), N = M = 3. Slow: one device
and a pipeline, N = M = 5.
"""

import pytest

from parity_tests import handoff
from parity_tests.tolerances import TRAJECTORY

pytest.importorskip("torch", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")
pytest.importorskip("transformers", reason="needs the [torch] extra (torch + transformers): pip install -e '.[torch]'")


def _check(res: dict, n: int, m: int) -> None:
    bound = TRAJECTORY["fp32"]
    for direction in ("jaxpar->torchref", "torchref->jaxpar"):
        d = res[direction]
        assert d["steps"] == list(range(n + 1, n + m + 1)), (direction, d)  # continued at n+1, not from 0
        for ref in ("vs_jaxpar", "vs_torchref"):
            c = d[ref]
            assert c["max_loss_rel"] <= bound["loss_rel"], (direction, ref, c)
            assert c["max_grad_norm_rel"] <= bound["grad_rel"] == c["grad_bound"], (direction, ref, c)
            assert c["pass"], (direction, ref, c)
    # the run trains: n + m steps move the loss by far more than any bound (a continued run that
    # restarted from the init weights would sit ~0.2 above the stayed run at step n+1)
    assert res["trained"] > 0.2, res


def test_handoff_sharded_both_directions_short(tmp_path):
    res = handoff.handoff(str(tmp_path), 3, 3, {"data": 2, "fsdp": 2, "tensor": 2}, {})
    _check(res, 3, 3)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,pipeline", [({}, {}), ({"data": 2, "pipe": 2}, {"microbatches": 2})],
                         ids=["single-device", "pipe2-data2"])
def test_handoff_sharded_both_directions(tmp_path_factory, mesh, pipeline):
    root = tmp_path_factory.getbasetemp() / "handoff-sharded"  # the torchref reference run is shared
    root.mkdir(exist_ok=True)
    res = handoff.handoff(str(root), 5, 5, mesh, pipeline)
    _check(res, 5, 5)
