"""Shared body of the `jaxpar train` tests of the table schedules and sequence parallelism
(tests/parallel/test_pipeline_zb.py, test_pipeline_interleaved.py, test_sequence_parallel_cli.py):
3 steps on 8 emulated CPU devices (subprocess) stopped after step 2 and resumed (or run through),
training's evaluation after every step, all against the same 3 steps on one device in-process."""

from __future__ import annotations

import json

import jax

from gpt2common import data
from jaxpar import config as C
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout
from jaxpar.run.loop import evaluate
from jaxpar.tolerances import SHARDED_VS_SINGLE
from jaxpar.train import build_trainer
from support.cli_helpers import run

COMMON = ["model=gpt2-tiny", "model.n_layer=4", "train.seq_len=32", "train.batch_size=16", "train.warmup_steps=0",
          "train.lr=1e-3", "train.eval_every=1", "train.eval_batches=2", "precision=fp32", "progress=plain"]


def train_resume_eval_matches_single_device(tmp_path, mesh_args: list[str], resume: bool = True) -> list[dict]:
    """`resume=False`: one uninterrupted run, for a setting that leaves the parameter and optimizer
    shardings (hence the checkpoint and its restore) as another test's resumed run has them."""
    out = tmp_path / "run"
    if resume:  # a 3-step run stopped after step 2 (a SIGTERM it sends itself), then resumed
        r = run(["train", *mesh_args, *COMMON, "train.steps=3", f"out={out}"], JAXPAR_FAULT_SIGNAL="SIGTERM@2")
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip().splitlines()[-1] == (f"stopped by SIGTERM after step 2; checkpoint saved to "
                                                     f"{out / 'ckpt' / '2'}; continue with resume=true")
    r = run(["train", *mesh_args, *COMMON, "train.steps=3", f"out={out}", *(["resume=true"] if resume else [])])
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    train = [x for x in recs if "loss" in x]
    val = {x["step"]: x["val_loss"] for x in recs if "val_loss" in x}
    assert [x["step"] for x in train] == [1, 2, 3] and sorted(val) == [1, 2, 3], recs
    # the same 3 steps and evaluations on one device (same init, same batches from the run's data)
    cfg = C.resolve(COMMON + ["train.steps=3", f"out={out}"])
    ds = data.Dataset.open(str(out / "data"), cfg.model.vocab_size, cfg.train.seq_len)
    tr = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])
    state, ref = tr.init_state(gpt2.init_params(cfg.model, cfg.seed)), []
    for step in range(3):
        x, y = data.train_batch(ds, cfg.train.seq_len, cfg.train.batch_size, cfg.seed, step)
        state, m = tr.step_fn(state, tr.put_batch(x), tr.put_batch(y))
        ref.append((float(m["loss"]), float(m["grad_norm"]), evaluate(tr, state["params"], ds, cfg)))
    tol = SHARDED_VS_SINGLE["fp32"]
    for rec, (loss, gn, vl) in zip(train, ref):
        assert abs(rec["loss"] - loss) <= tol["loss"] * abs(loss), (recs, ref)
        # gradients, not only losses: the pre-clip global norm of each step's averaged gradient
        assert abs(rec["grad_norm"] - gn) <= tol["grad"] * gn, (recs, ref)
        assert abs(val[rec["step"]] - vl) <= tol["loss"] * abs(vl), (recs, ref)
    assert ref[0][0] - ref[2][0] > 1e-2  # the steps move the loss far beyond the tolerance
    return recs
