"""`jaxpar train` with pipeline parallelism end to end (8 emulated CPU devices, subprocess),
compared with the same 3 steps on one device in this process; pipeline errors exit 2."""

from __future__ import annotations

import json

import jax
import pytest
from support.cli_helpers import run

from gpt2common import data
from jaxpar import config as C
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout
from jaxpar.tolerances import SHARDED_VS_SINGLE
from jaxpar.train import build_trainer

COMMON = ["model=gpt2-tiny", "model.n_layer=4", "train.steps=3", "train.seq_len=32", "train.batch_size=16",
          "train.warmup_steps=0", "train.lr=1e-3", "train.eval_every=0", "precision=fp32", "progress=plain"]


def test_train_pipe2_data2_tensor2_matches_single_device(tmp_path):
    out = tmp_path / "run"
    r = run(["train", "mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", "pipeline.microbatches=4", *COMMON,
             f"out={out}"])
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    assert [x["step"] for x in recs] == [1, 2, 3]
    # The same 3 steps on one device (same init, same batches from the run's prepared data).
    cfg = C.resolve(COMMON + [f"out={out}"])
    ds = data.Dataset.open(str(out / "data"), cfg.model.vocab_size, cfg.train.seq_len)
    tr = build_trainer(build_layout(cfg, 1), devices=jax.devices()[:1])
    state, ref, ref_gn = tr.init_state(gpt2.init_params(cfg.model, cfg.seed)), [], []
    for step in range(3):
        x, y = data.train_batch(ds, cfg.train.seq_len, cfg.train.batch_size, cfg.seed, step)
        state, m = tr.step_fn(state, tr.put_batch(x), tr.put_batch(y))
        ref.append(float(m["loss"]))
        ref_gn.append(float(m["grad_norm"]))
    rel = [abs(a["loss"] - b) / abs(b) for a, b in zip(recs, ref)]
    assert max(rel) <= SHARDED_VS_SINGLE["fp32"]["loss"], (rel, ref)
    # gradients, not only losses: the pre-clip global norm of every step's averaged gradient (a
    # missing or doubled 1/N moves it by >= 50%; AdamW would hide a uniform scale in the loss)
    gn_rel = [abs(a["grad_norm"] - b) / b for a, b in zip(recs, ref_gn)]
    assert max(gn_rel) <= SHARDED_VS_SINGLE["fp32"]["grad"], (gn_rel, ref_gn)
    assert ref[0] - ref[2] > 1e-2  # the steps change the loss far beyond the tolerance


@pytest.mark.parametrize("args,msg", [
    (["mesh.pipe=4", "mesh.data=2", "model.n_layer=2", "pipeline.microbatches=2"],
     "error: mesh.pipe=4 stages exceed model.n_layer=2 layers"),
    (["mesh.pipe=2", "mesh.data=4", "model.n_layer=4", "pipeline.layers_per_stage=[1,2]"],
     "error: pipeline.layers_per_stage=[1, 2] sums to 3, not model.n_layer=4"),
    (["mesh.pipe=2", "mesh.data=4", "model.n_layer=4", "pipeline.schedule=circular", "pipeline.repeats=3"],
     "error: pipeline.repeats×mesh.pipe=3×2=6 exceeds model.n_layer=4 layers"),
])
def test_pipeline_errors_exit_2_with_one_line(tmp_path, args, msg):
    r = run(["train", "model=gpt2-tiny", "train.batch_size=16", "train.seq_len=32", "train.steps=1", *args,
             f"out={tmp_path / 'x'}"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [msg]
    assert not (tmp_path / "x").exists()


def test_microbatches_not_dividing_batch_exit_2(tmp_path):
    r = run(["train", "model=gpt2-tiny", "model.n_layer=4", "mesh.pipe=2", "mesh.data=4", "train.batch_size=16",
             "pipeline.microbatches=3", "train.seq_len=32", f"out={tmp_path / 'x'}"])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pipeline.microbatches" in lines[0] \
        and "3" in lines[0], lines


def test_bubble_warning_is_printed_once_by_the_command(tmp_path):
    """The layout carries the M < S warning; `jaxpar train` prints it once (it was printed by
    library code, once per check). The run then stops at the next check (out is not empty), so
    nothing is compiled."""
    out = tmp_path / "x"
    out.mkdir()
    (out / "stray").write_text("")
    r = run(["train", "mesh.pipe=2", "pipeline.microbatches=1", *COMMON, f"out={out}"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "warning: pipeline.microbatches=1 < mesh.pipe=2 stages: the pipeline bubble (50% of stage time idle) "
        "will dominate",
        f"error: out={str(out)!r} is not empty; pass resume=true to continue it or choose another out"]
