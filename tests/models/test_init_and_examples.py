"""Fine-tuning from an HF dir (`init=`), TensorBoard output, and example 01."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from support.cli_helpers import clean_env, run

from gpt2common import hf
from jaxpar.config import ModelConfig
from jaxpar.models import gpt2

ROOT = Path(__file__).resolve().parents[2]


def test_train_from_hf_init_starts_from_those_weights(tmp_path):
    mc = ModelConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    params = gpt2.init_params(mc, seed=11)
    hf.save_hf(tmp_path / "hf", mc, params)
    # OpenAI's GPT-2 config.json says dropout 0.1; the run's model.dropout (default 0) wins, so step 1's
    # loss below is the weights' deterministic loss (an inherited 0.1 would drop units and move it).
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_cfg.update(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_cfg))
    out = tmp_path / "ft"
    r = run(["train", f"init={tmp_path / 'hf'}", "train.steps=3", "train.seq_len=32", "train.batch_size=4",
             "precision=fp32", "train.eval_every=0", f"out={out}"])
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["n_embd"] == 64 and cfg["model"]["dropout"] == 0.0 and cfg["init"] == str(tmp_path / "hf")
    # The first logged loss is the HF weights' loss on step 0's batch.
    from gpt2common import data

    ds = data.Dataset.open(str(out / "data"), 256, 32)
    x, y = data.train_batch(ds, 32, 4, 0, 0)
    expect = float(gpt2.GPT2(mc, params).loss(x, y))
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - expect) <= 1e-6 * expect
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())


def test_example_01_trains_and_samples():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "01_train_gpt2.py")], capture_output=True,
                       text=True, timeout=600, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "462,336 parameters"
    losses = [float(ln.split()[-1]) for ln in lines if ln.startswith("step")]
    assert len(losses) == 7 and losses[-1] < 0.7 * losses[0]
    assert "ROMEO:" in r.stdout
    assert np.isfinite(losses).all()


def test_eval_hf_dir_equals_transformers_loss(tmp_path):
    """`jaxpar eval hf=DIR data=X.bin` == HF GPT2LMHeadModel's mean CE over the same windows."""
    import torch
    import transformers

    mc = ModelConfig(n_layer=2, n_embd=48, n_head=3, vocab_size=97, n_positions=32)
    hf.save_hf(tmp_path / "hf", mc, gpt2.init_params(mc, seed=2))
    toks = np.random.default_rng(4).integers(0, 97, 16 * 7 + 5).astype("<u2")
    toks.tofile(tmp_path / "t.bin")
    r = run(["eval", f"hf={tmp_path / 'hf'}", f"data={tmp_path / 't.bin'}", "train.seq_len=16", "train.batch_size=3"])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["tokens"] == 7 * 16  # windows k*16..k*16+16 for k = 0..6
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.tensor(np.stack([toks[k * 16:k * 16 + 16] for k in range(7)]).astype(np.int64))
    y = torch.tensor(np.stack([toks[k * 16 + 1:k * 16 + 17] for k in range(7)]).astype(np.int64))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(m(x).logits.reshape(-1, 97), y.reshape(-1)).item()
    assert abs(got["loss"] - ref) <= 1e-6 * ref
