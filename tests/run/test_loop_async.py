"""The asynchronous loop logs what a synchronous one would: record n holds step n's loss,
gradient norm and lr, and `val_loss` is measured on the params after step n (not n+1, which is
already in flight). Independent reference: the plain jitted step called synchronously, one
`float()` per step, and the eval function on the params it returns. In-process, fp32, 1 device."""

from __future__ import annotations

import json

import jax
import pytest

from gpt2common import data as data_lib
from jaxpar import config as C
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout
from jaxpar.run.loop import run_train
from jaxpar.train import build_trainer

ARGS = ["model=gpt2-tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "train.seq_len=16",
        "train.batch_size=2", "train.steps=5", "train.lr=3e-3", "train.warmup_steps=2", "train.eval_every=2",
        "train.eval_batches=2", "precision=fp32", "progress=none", "device_peak_flops=1e12"]


@pytest.mark.skipif(jax.device_count() != 1, reason="in-process single-device run")
def test_async_records_equal_a_synchronous_loop(tmp_path):
    cfg = C.resolve([*ARGS, f"out={tmp_path / 'run'}"])
    assert run_train(cfg) == 0
    recs = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]

    tc, ds = cfg.train, data_lib.Dataset.open(str(tmp_path / "run" / "data"), 256, 16)
    tr = build_trainer(build_layout(cfg, jax.device_count()))
    state = tr.init_state(gpt2.init_params(cfg.model, cfg.seed))
    ref = []
    for step in range(tc.steps):
        x, y = data_lib.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, step)
        state, m = tr.step_fn(state, tr.put_batch(x), tr.put_batch(y))
        rec = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "lr": float(tr.schedule(step))}
        if (step + 1) % tc.eval_every == 0:
            from jaxpar.run.evaluation import mean_loss

            total, n = mean_loss(tr.eval_fn, tr.put_batch, state["params"], (data_lib.val_batch(
                ds, tc.seq_len, tc.batch_size, cfg.seed, i) for i in range(tc.eval_batches)), tc.batch_size)
            rec["val_loss"] = total / n
        ref.append(rec)

    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r.get("val_loss") is not None for r in recs] == [False, True, False, True, False]
    for got, want in zip(recs, ref):
        for k, v in want.items():
            # bit-identical on CPU fp32: the loop's step is the same computation plus the stop flag
            assert got[k] == v, (got["step"], k, got[k], v)
    assert len({r["loss"] for r in ref}) == len(ref)  # every step differs: a record shifted by one step shows
