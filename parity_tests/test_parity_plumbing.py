"""The parity machinery's own plumbing, with stand-ins for the runs (no training here): what
`property.compare` lets pass, the mesh space and reproduction commands of the property set, how the
matrix turns a failed CLI and each row's gradients into rows, and how the report reaches its
overall verdict. A comparison that silently passes is the worst bug of a parity suite, so each
case plants one disagreement and checks that it comes out as a failure. Reference: the planted
values and the docstrings of parity_tests/{property,matrix,report}.py."""

import json
import math
import shlex
import subprocess

import numpy as np
import pytest

from parity_tests import matrix, report
from parity_tests import property as P
from parity_tests.common import ModelParity

TR = {"losses": [4.0, 3.5, 3.0, 2.5], "grad_norms": [2.0, 1.9, 1.8, 1.7]}


def test_property_compare_fails_a_run_that_turns_nan_after_its_first_step():
    # max() over the steps keeps the first value against a later nan (nan > x is False): only the
    # finiteness check sees it. A nan grad norm with finite losses: the last step's gradient overflowed.
    for side in ("jaxpar", "torchref"):
        for key in ("losses", "grad_norms"):
            bad = {k: list(v) for k, v in TR.items()}
            bad[key][2] = math.nan
            res = P.compare(bad, TR) if side == "jaxpar" else P.compare(TR, bad)
            assert res["pass"] is False, (side, key, res)
    assert P.compare(dict(TR), TR) == {"pass": True, "max_loss_rel": 0.0, "max_grad_norm_rel": 0.0, "steps": 4,
                                       "losses_jaxpar": TR["losses"], "losses_torchref": TR["losses"]}


def test_property_compare_fails_runs_of_different_lengths():
    short = {k: v[:3] for k, v in TR.items()}
    assert P.compare(short, TR) == {"pass": False, "error": "3 jaxpar steps vs 4 torchref steps"}
    assert P.compare(TR, short) == {"pass": False, "error": "4 jaxpar steps vs 3 torchref steps"}
    assert P.compare({"error": "ConfigError: x"}, TR) == {"pass": False, "error": "ConfigError: x"}


def test_property_meshes_use_up_to_all_8_devices():
    """gpt2-tiny's shape: the space holds meshes of 1, 2, 4 and all 8 devices, each one that
    jaxpar's check accepts (1-D over 8 devices included)."""
    meshes = P._meshes(2, 4, 128, 256)
    sizes = {m["data"] * m["fsdp"] * m["tensor"] * m["pipe"] for m in meshes}
    assert sizes == {1, 2, 4, 8}
    full = {(m["data"], m["fsdp"], m["tensor"], m["pipe"]) for m in meshes if m["mb"] == 1}
    assert {(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1), (4, 1, 2, 1), (2, 1, 2, 2)} <= full


# one drawn example, shape of test_property_parity.PINNED (not imported: that module imports torch)
PINNED = P.Example(
    common=("model=gpt2-tiny", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.vocab_size=64",
            "model.n_positions=16", "train.batch_size=8", "train.seq_len=8", "train.steps=4", "train.grad_accum=2",
            "seed=3"),
    vocab=64, jaxpar=("mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2", "mesh.pipe=1", "train.remat=selective"),
    torchref=("strategy=distributed-ps", "workers=2"))


def test_property_reproduction_commands_run_what_the_example_ran(tmp_path, monkeypatch):
    """The ready-to-paste commands of a failing example carry every key the two sides got."""
    got = {}
    monkeypatch.setattr(P.JaxRuns, "submit", classmethod(lambda cls, args, log: got.setdefault("jaxpar", args)))
    monkeypatch.setattr(P.JaxRuns, "result", classmethod(lambda cls, log: dict(TR)))
    monkeypatch.setattr(P, "run_torchref", lambda args, out: got.setdefault("torchref", args) and dict(TR))
    assert P.run_example(PINNED, str(tmp_path))["pass"] is True
    lines = PINNED.commands(str(tmp_path)).splitlines()
    assert lines[0].startswith("python -c ") and f"write_data('{PINNED.data_dir(str(tmp_path))}', 64, 20000)" in lines[0]
    for line, side in zip(lines[1:], ("jaxpar", "torchref")):
        words = shlex.split(line)
        assert words[:2] == [side, "train"]
        # the command's keys: exactly the example's (out= and the jaxpar eval switch-off aside)
        assert set(got[side]) == {w for w in words[2:] if not w.startswith(("out=", "train.eval_every="))}
    assert "precision=fp32" in got["jaxpar"] and {"strategy=distributed-ps", "workers=2"} <= set(got["torchref"])


def test_matrix_row_whose_cli_fails_is_a_failed_row(tmp_path, monkeypatch):
    err = "error: model.n_head=4 is not divisible by mesh.tensor=3"
    monkeypatch.setattr(matrix, "run_cli", lambda tool, args: subprocess.CompletedProcess(
        args, 2, "", "some warning\n" + err + "\n"))
    row = matrix.Row("planted", "jaxpar", ("mesh.tensor=3",), "fp32")
    with pytest.raises(matrix.RowFailed) as e:
        matrix.run_row(row, str(tmp_path), "init", "data")
    assert str(e.value).endswith("` exited 2: some warning | " + err)
    assert str(e.value).startswith("`jaxpar train train.seq_len=32 ")


def _stub_matrix(monkeypatch, off: dict[str, float], failed: tuple[str, ...] = ()):
    """run_matrix with stand-in runs: flat trajectories; every row's step-1 gradient equal to the
    reference's, except one entry of `off[row]` relative error; rows in `failed` raise RowFailed."""
    ref_g = {"a": np.ones(100, np.float32), "b": np.full(10, 2.0, np.float32)}

    def grads_of(name):
        g = {k: v.copy() for k, v in ref_g.items()}
        g["a"][3] *= 1 + off.get(name, 0.0)
        return g

    def run_row(row, root, init_dir, data_dir):
        if row.name in failed:
            raise matrix.RowFailed(f"`{row.name}` exited 1: boom")
        return {"losses": [4.0] * matrix.STEPS, "grad_norms": [2.0] * matrix.STEPS, "wall_s": 0.0,
                "out": f"runs/{row.name}"}

    monkeypatch.setattr(matrix, "prepare_inputs", lambda root: ("init", "data"))
    monkeypatch.setattr(matrix, "run_row", run_row)
    monkeypatch.setattr(matrix, "jax_grads", lambda rows, *a: {r.name: grads_of(r.name) for r in rows})
    monkeypatch.setattr(matrix, "torch_grads", lambda out: grads_of(out.split("/", 1)[1]))


def test_matrix_judges_each_row_on_its_own_gradients(tmp_path, monkeypatch):
    names = ["jaxpar single", "jaxpar data=8", "torchref single-ps ×2", "torchref distributed-ps ×2"]
    _stub_matrix(monkeypatch, {"jaxpar data=8": 1e-3, "torchref single-ps ×2": 1e-3},
                 failed=("torchref distributed-ps ×2",))
    rep = matrix.run_matrix(str(tmp_path), names, log=lambda m: None)
    rows = {r["row"]: r for r in rep["rows"]}
    assert set(rows) == set(names) | {matrix.REFERENCE.name}
    assert {n: r["pass"] for n, r in rows.items()} == {
        "jaxpar single": True, "jaxpar data=8": False, "torchref single-ps ×2": False,
        "torchref distributed-ps ×2": False, matrix.REFERENCE.name: True}
    for n in ("jaxpar data=8", "torchref single-ps ×2"):
        assert rows[n]["max_grad"] == pytest.approx(1e-3, rel=1e-4) and rows[n]["worst_grad_param"] == "a"
        assert rows[n]["checks"] == {"loss": True, "grad": False, "grad_norm": True}
    assert rows["torchref distributed-ps ×2"]["error"] == "`torchref distributed-ps ×2` exited 1: boom"
    assert rows["torchref distributed-ps ×2"]["checks"] == {"ran": False}


def _planted_report(monkeypatch, examples: list[dict]):
    monkeypatch.setattr(report, "host", lambda: {})
    monkeypatch.setattr(report, "model_rows", lambda root: [{"pass": True}])
    monkeypatch.setattr(matrix, "run_matrix", lambda root, names, log: {"rows": [{"pass": True}]})
    monkeypatch.setattr(report, "_start_property_set",
                        lambda root, n, log: lambda: {"examples": examples, "bounds": P.BOUNDS, "excluded": {}})


@pytest.mark.parametrize("bad", [
    {"config": "cfgB", "pass": False, "steps": 3, "max_loss_rel": 1.0, "max_grad_norm_rel": 0.0, "commands": "c"},
    {"config": "cfgC", "pass": False, "error": "parity_tests.jax_runs died (log: x)", "commands": "c"},
])
def test_report_fails_on_a_failed_or_errored_property_example(tmp_path, monkeypatch, bad):
    ok = {"config": "cfgA", "pass": True, "steps": 3, "max_loss_rel": 0.0, "max_grad_norm_rel": 0.0, "commands": "a"}
    _planted_report(monkeypatch, [ok, bad])
    assert report.build(str(tmp_path), examples=2, log=lambda m: None)["pass"] is False
    _planted_report(monkeypatch, [ok, ok])
    assert report.build(str(tmp_path), examples=2, log=lambda m: None)["pass"] is True


def test_report_model_row_fails_when_any_adamw_step_is_off():
    r = ModelParity(model={}, logits_abs=0.0, loss_rel=0.0, loss_jax=1.0, loss_torch=1.0, grad_rel={"a": 0.0},
                    grad_norm=1.0, update_rel={1: {"a": 0.0}, 3: {"a": 1.0, "b": 0.0}}, n_params=1)
    row = report.model_row("planted", r)
    assert row["adamw_update_rel"] == {"1": 0.0, "3": 1.0} and row["adamw_worst_param"] == {"1": "a", "3": "a"}
    assert row["checks"] == {"logits": True, "loss": True, "grad": True, "adamw": False} and row["pass"] is False
    json.dumps(row)  # the report writes it as JSON


def test_report_model_row_judges_each_check_by_its_own_bound():
    """Each model check fails just over its own bound and passes at it (the loss must not be judged
    by the logits bound, 2.5x looser). Bounds: parity_tests/tolerances.MODEL."""
    from parity_tests.tolerances import MODEL

    def row(**kw):
        at = dict(logits_abs=MODEL["logits_abs"], loss_rel=MODEL["loss_rel"], grad_rel={"a": MODEL["grad_rel"]},
                  update_rel={1: {"a": MODEL["update_rel"]}, 3: {"a": 0.0}})
        return report.model_row("planted", ModelParity(model={}, loss_jax=1.0, loss_torch=1.0, grad_norm=1.0,
                                                       n_params=1, **{**at, **kw}))

    assert row()["checks"] == {"logits": True, "loss": True, "grad": True, "adamw": True}
    over = 1.01  # just over each bound (the loss one, 8e-7, is 2.5x under the logits and grad ones)
    for k, kw, check in (("logits_abs", dict(logits_abs=over * MODEL["logits_abs"]), "logits"),
                         ("loss_rel", dict(loss_rel=over * MODEL["loss_rel"]), "loss"),
                         ("grad_rel", dict(grad_rel={"a": over * MODEL["grad_rel"]}), "grad"),
                         ("update_rel", dict(update_rel={1: {"a": 0.0}, 3: {"a": over * MODEL["update_rel"]}}), "adamw")):
        r = row(**kw)
        assert [c for c, ok in r["checks"].items() if not ok] == [check] and r["pass"] is False, k


def test_report_fails_on_a_failed_model_row(tmp_path, monkeypatch):
    """A failed model-parity row fails the whole report (not only the matrix's verdict)."""
    _planted_report(monkeypatch, [])
    monkeypatch.setattr(report, "model_rows", lambda root: [{"pass": True}, {"pass": False}])
    assert report.build(str(tmp_path), log=lambda m: None)["pass"] is False
    monkeypatch.setattr(report, "model_rows", lambda root: [{"pass": True}, {"pass": True}])
    assert report.build(str(tmp_path), log=lambda m: None)["pass"] is True


def test_trajectory_diffs_of_example_06_fail_a_run_that_turns_nan():
    """examples/06_parity.py's verdict: a NaN diff fails. Python's max() keeps step 1's diff against the
    nan steps of a diverged run (lr 1e30: both sides nan from step 2), which would print PASS, exit 0."""
    from parity_tests.common import trajectory_diffs
    from parity_tests.tolerances import TRAJECTORY

    diverged = [(5.5518336, 2.0), (math.nan, math.nan), (math.nan, math.nan)]
    ref = [(5.5518332, 2.0), (math.nan, math.nan), (math.nan, math.nan)]
    assert trajectory_diffs(diverged, ref, TRAJECTORY["fp32"])["pass"] is False
    assert trajectory_diffs([(4.0, 2.0), (3.0, 2.0)], [(4.0, 2.0), (3.0, math.nan)], TRAJECTORY["fp32"])["pass"] is False
    # a planted 5e-7 loss diff at step 2 (within fp32's 1e-6), grad norms 1e-5 off at step 1: bf16's l2 bound
    run, ref = [(4.0, 2.0 * (1 + 1e-5)), (3.0 * (1 + 5e-7), 2.0)], [(4.0, 2.0), (3.0, 2.0)]
    r = trajectory_diffs(run, ref, TRAJECTORY["fp32"])
    assert r["max_loss_rel"] == pytest.approx(5e-7, rel=1e-6) and r["max_grad_norm_rel"] == pytest.approx(1e-5, rel=1e-6)
    assert (r["grad_bound"], r["pass"]) == (TRAJECTORY["fp32"]["grad_rel"], False)
    b = trajectory_diffs(run, ref, TRAJECTORY["bf16"])
    assert (b["grad_bound"], b["pass"]) == (TRAJECTORY["bf16"]["grad_l2_rel"], True)
    assert r["diffs"].shape == (2, 2) and r["diffs"][0, 0] == 0.0
