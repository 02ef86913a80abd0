"""Check your own jaxpar configuration against the PyTorch reference: same init, N steps, a diff table.

    python examples/06_parity.py                                     # gpt2-tiny, one device, 10 steps
    python examples/06_parity.py mesh.data=2 mesh.tensor=2           # your mesh (CPU devices emulated)
    python examples/06_parity.py init=path/to/hf_dir train.steps=20  # your weights (HF save_pretrained dir)

Takes the keys of `jaxpar train` (model, mesh, pipeline, train, precision, seed, data, init). Steps:
  1. one starting point: numpy init (fixed seed) written once as an HF dir with jaxpar's exporter,
     read back by jaxpar's importer and by torchref's loader (or your own `init=` dir);
  2. one batch order: `gpt2common.data.train_batch(ds, T, B, seed, step)` for both;
  3. N steps of jaxpar (your mesh, jit + shardings, optax) and of the reference (HF GPT2LMHeadModel,
     torchref's optimizer mirror: torch AdamW + clip without epsilon + the same schedule), one process;
  4. per-step table of losses and logged grad norms, judged by parity_tests/tolerances.py.
Exit code 0 when every step is within the bound, 1 otherwise. ~30 s on a laptop CPU.
For the multi-process strategies, run `torchref train strategy=... workers=N init=<dir> data=<dir>`
with the same keys and compare its metrics.jsonl, or run `python -m parity_tests.report`.
"""

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for parity_tests (tolerances, trajectory_diffs)

from jaxpar import config as C
from jaxpar.parallel.mesh import emulate_devices_for, mesh_size, resolve_mesh_config

# 1. Your configuration, on top of small defaults. fp32 unless you ask for bf16.
defaults = ["model=gpt2-tiny", "train.seq_len=32", "train.batch_size=8", "train.steps=10", "train.warmup_steps=2",
            "train.lr=1e-3", "train.eval_every=0", "precision=fp32"]
try:
    cfg = C.resolve(defaults + sys.argv[1:])
except C.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
emulate_devices_for(cfg.mesh)  # must precede JAX's first device query (CPU only; GPUs ignore it)

import jax
import torch

from gpt2common import data, hf
from jaxpar.models import gpt2
from jaxpar.parallel.layout import build_layout
from jaxpar.train import build_trainer, check_model_vs_mesh
from parity_tests.common import trajectory_diffs
from parity_tests.tolerances import TRAJECTORY
from torchref.model import build_model, clip_grads_, loss_fn, lr_at, make_optimizer, set_lr

work = tempfile.mkdtemp(prefix="parity_example_")

# 2. One starting point, through the public converters.
init_dir = cfg.init or os.path.join(work, "init")
if not cfg.init:
    hf.save_hf(init_dir, cfg.model, gpt2.init_params(cfg.model, cfg.seed))
model_cfg, params = hf.load_hf(init_dir)  # jaxpar's importer
n_dev = mesh_size(cfg.mesh)
cfg = dataclasses.replace(cfg, model=model_cfg, mesh=resolve_mesh_config(cfg.mesh, n_dev))
try:
    check_model_vs_mesh(cfg.model, cfg)  # divisibility errors name the values, as the CLI does
except C.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)

# 3. One data set and batch order (the built-in corpus, byte-tokenized, unless data= is given).
ds = data.Dataset.open(data.resolve_data(cfg.data, cfg.tokenizer, work), cfg.model.vocab_size, cfg.train.seq_len)
tc = cfg.train
batches = [data.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, s) for s in range(tc.steps)]

# 4a. jaxpar on your mesh.
trainer = build_trainer(build_layout(cfg, n_dev), devices=jax.devices()[:n_dev])
state, jx = trainer.init_state(params), []
for x, y in batches:
    state, m = trainer.step_fn(state, trainer.put_batch(x), trainer.put_batch(y))
    jx.append((float(m["loss"]), float(m["grad_norm"])))

# 4b. The PyTorch reference (torchref `single`, in this process), from the same HF dir.
from safetensors.numpy import load_file

with open(os.path.join(init_dir, "config.json")) as f:
    model = build_model(json.load(f), load_file(os.path.join(init_dir, "model.safetensors")))  # torchref's loader
named = list(model.named_parameters())
opt, ref = make_optimizer(named, tc), []
for step, (x, y) in enumerate(batches):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64)))
    loss.backward()
    norm = clip_grads_([p for _, p in named], tc.grad_clip)  # optax's clip: no epsilon
    set_lr(opt, lr_at(tc, step))  # optax's schedule at the pre-update count
    opt.step()
    ref.append((float(loss.detach()), norm))

# 5. The diff table. bf16 runs are judged against the fp32 reference with the bf16 bounds.
res = trajectory_diffs(jx, ref, TRAJECTORY[cfg.precision])  # a nan step fails (numpy's max keeps it)
worst_loss, worst_gn, gbound, ok = res["max_loss_rel"], res["max_grad_norm_rel"], res["grad_bound"], res["pass"]
mesh_s = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.mesh).items() if v > 1) or "single device"
print(f"jaxpar ({mesh_s}, {cfg.precision}) vs PyTorch reference, {tc.steps} steps, "
      f"model L={cfg.model.n_layer} D={cfg.model.n_embd} H={cfg.model.n_head} V={cfg.model.vocab_size}")
print("| step | jaxpar loss | torch loss | loss rel diff | grad-norm rel diff |")
print("|---:|---:|---:|---:|---:|")
for s, ((lj, _), (lt, _), (dl, dg)) in enumerate(zip(jx, ref, res["diffs"]), start=1):
    print(f"| {s} | {lj:.7f} | {lt:.7f} | {dl:.1e} | {dg:.1e} |")
print(f"max loss diff {worst_loss:.1e} (bound {TRAJECTORY[cfg.precision]['loss_rel']:.0e}), max grad-norm diff "
      f"{worst_gn:.1e} (bound {gbound:.0e}): {'PASS' if ok else 'FAIL'}")
print(json.dumps({"max_loss_rel": worst_loss, "max_grad_norm_rel": worst_gn, "pass": ok, "steps": tc.steps}))
sys.exit(0 if ok else 1)
