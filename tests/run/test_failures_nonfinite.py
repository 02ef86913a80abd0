"""Non-finite steps, a failed run started over in the same out (the failed run, then its restart
in two parts around a `resume=true`, all in one run dir), the stop line's last checkpoint, and
(slow) `resume=true` from the run's own config.json with a torn metrics line.

lr=1e6 drives the tiny model's loss to ~1e13 and then its gradient norm to NaN within a few
steps. Independent reference: the arrays read back from the checkpoint
files with orbax, and the first run's own losses for the bit-identical restart."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import orbax.checkpoint as ocp
import pytest
from support.cli_helpers import run

from jaxpar.run.loop import nonfinite_message

TINY = ["model=gpt2-tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=16",
        "train.batch_size=2", "train.eval_every=0", "progress=plain"]
BLOWUP = [*TINY, "train.steps=6", "train.lr=1e6", "train.warmup_steps=0"]


def cosine_lr(s: int, steps: int, lr: float = 1e6, r: float = 0.1) -> float:
    """BLOWUP's schedule by hand (no warmup): lr * (r + (1 - r) * (1 + cos(pi * min(s, D) / D)) / 2), D = steps."""
    return lr * (r + (1 - r) * (1 + np.cos(np.pi * min(s, steps) / steps)) / 2)


def records(out):
    return [json.loads(ln) for ln in open(out / "metrics.jsonl")]


def ckpt_arrays(out, step):
    """Every array of checkpoint `step` (params and optimizer state), as numpy."""
    arrays = []
    for item in ("params", "opt_state"):
        tree = ocp.StandardCheckpointer().restore(os.path.abspath(out / "ckpt" / str(step) / item))
        arrays += [np.asarray(a) for a in __import__("jax").tree.leaves(tree)]
    return arrays


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("nf") / "run"
    return out, run(["train", *BLOWUP, f"out={out}"])


def test_nonfinite_step_stops_with_one_error_line_and_no_checkpoint(stopped):
    out, r = stopped
    assert r.returncode == 2, r.stderr[-2000:]
    recs = records(out)
    bad = [x["step"] for x in recs if x.get("nonfinite")]
    assert len(bad) == 1 and bad[0] == recs[-1]["step"] == len(recs) >= 2, recs
    assert all(np.isfinite(x["loss"]) and np.isfinite(x["grad_norm"]) for x in recs[:-1])
    m = re.fullmatch(r"error: step (\d+): non-finite loss or gradient norm \(loss=\S+, grad_norm=\S+\); the update "
                     r"was not applied and the run stopped \(last checkpoint: none\); lower train.lr, or pass "
                     r"train.skip_nonfinite=true to skip such batches\n", r.stderr)
    assert m and int(m.group(1)) == bad[0], r.stderr
    assert not os.path.exists(out / "ckpt") or not [n for n in os.listdir(out / "ckpt") if n.isdigit()]


def test_failed_run_restarts_in_place_and_skips_nonfinite_steps(stopped):
    out, first = stopped
    first_recs = records(out)
    # In two parts, so the count of skipped steps is carried across a resume (from checkpoint 4).
    r = run(["train", *BLOWUP, "train.steps=4", "train.skip_nonfinite=true", "train.ckpt_every=1", f"out={out}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"out={out} held a run that failed before its first checkpoint; starting it over" in r.stdout
    r = run(["train", f"out={out}", "resume=true", "train.steps=6"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from step 4" in r.stdout
    recs = records(out)
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5, 6]  # the failed run's lines are gone
    k = first_recs[-1]["step"]
    # Same seed, same batches: step n's loss is bit-identical while updates 1..n-1 had the same lr
    # (train.steps=4 here vs 6 there bends the cosine from update 2 on).
    n_same = next(i for i, (a, b) in enumerate(zip(recs, first_recs)) if a["lr"] != b["lr"])
    assert n_same >= 1 and [x["loss"] for x in recs[:n_same + 1]] == [x["loss"] for x in first_recs[:n_same + 1]]
    count = 0
    for x in recs:
        # each step's lr is the one its update applies: the schedule at the updates applied before
        # it, not at step - 1 (a skipped step applies none); over train.steps=4 before the resume
        # and 6 after it
        want = cosine_lr(x["step"] - 1 - count, 4 if x["step"] <= 4 else 6)
        assert x["lr"] == pytest.approx(want, rel=1e-6), (x, count)
        count += bool(x.get("nonfinite"))
        assert x["nonfinite_skipped"] == count
    assert count >= 1 and recs[k - 1].get("nonfinite") and k <= 4  # a skip before the resume
    for step in (5, 6):  # the two kept checkpoints hold finite values only
        assert all(np.isfinite(a).all() for a in ckpt_arrays(out, step))


def test_the_error_line_names_the_newest_checkpoint(tmp_path):
    for name in ("2", "10", "9", "11.orbax-checkpoint-tmp-5"):  # numeric order; a save cut short is no step
        (tmp_path / "ckpt" / name).mkdir(parents=True)
    assert nonfinite_message(12, 1.5e13, float("nan"), str(tmp_path)) == (
        "step 12: non-finite loss or gradient norm (loss=15000000000000.0, grad_norm=nan); the update was not "
        "applied and the run stopped (last checkpoint: step 10); lower train.lr, or pass "
        "train.skip_nonfinite=true to skip such batches")


@pytest.mark.slow  # two more runs; the pieces are covered in-process by test_failures_config.py
def test_resume_uses_the_runs_config_and_drops_a_torn_line(tmp_path):
    out = tmp_path / "run"
    r = run(["train", *BLOWUP, "train.skip_nonfinite=true", f"out={out}"])
    assert r.returncode == 0, r.stderr[-2000:]
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 5.5')  # a kill -9 mid-write
    r = run(["train", f"out={out}", "resume=true", "train.steps=8"])  # the README's form: no model keys
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from step 6" in r.stdout
    recs = records(out)
    assert [x["step"] for x in recs] == list(range(1, 9))
    assert recs[6]["nonfinite_skipped"] >= recs[5]["nonfinite_skipped"] >= 1  # the count carries over
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model"]["n_layer"], cfg["model"]["n_embd"], cfg["train"]["steps"], cfg["train"]["lr"]) == \
        (1, 32, 8, 1e6)
