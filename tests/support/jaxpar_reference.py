"""jaxpar's side of the torchref-strategy checks: the loss of every step and the step-1 gradient
of `jaxpar train` on one CPU device, in fp32, for the configuration the torchref tests run.

    python tests/jaxpar_reference.py DATA_DIR OUT.npz KEY=VALUE ...

Runs in a subprocess: the torchref tests fork their ranks from the pytest process, which must not
have started JAX's threads. The weights are the shared numpy init (`gpt2.init_params(model, seed)`,
what torchref loads too), the batches `gpt2common.data.train_batch` of DATA_DIR (what torchref's
workers slice), and the step is the trainer `jaxpar train` compiles (`build_trainer`, AdamW, clip).
Writes OUT.npz: `losses` (steps,) and `grad/<HF name>` for every parameter (pre-clip, step 1).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np


def main(data_dir: str, out: str, args: list[str]) -> None:
    import jax

    from gpt2common import data, hf
    from jaxpar.config import resolve
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.train import build_trainer, make_loss_fn

    cfg = resolve([*args, "precision=fp32", f"data={data_dir}"])
    tc, mc = cfg.train, cfg.model
    tr = build_trainer(build_layout(cfg, jax.device_count()))
    ds = data.Dataset.open(data_dir, mc.vocab_size, tc.seq_len)
    batches = [data.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, s) for s in range(tc.steps)]
    params = gpt2.init_params(mc, cfg.seed)
    loss_fn = make_loss_fn(tr.layout, tr.mesh)
    g = jax.jit(jax.grad(lambda p, x, y: loss_fn(p, x, y, None)))(params, *batches[0])
    state, losses = tr.init_state(params), []
    for x, y in batches:
        state, m = tr.step_fn(state, tr.put_batch(x), tr.put_batch(y))
        losses.append(float(m["loss"]))
    grads = hf.to_hf_state_dict(mc, jax.device_get(g))
    np.savez(out, losses=np.array(losses), **{f"grad/{k}": v for k, v in grads.items()})


def run(data_dir: str, out: str, args: list[str], env: dict) -> dict[str, np.ndarray]:
    """Run the worker in a subprocess; returns {"losses": ..., "grads": {HF name: array}}."""
    r = subprocess.run([sys.executable, __file__, data_dir, out, *args], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out) as z:
        return {"losses": z["losses"], "grads": {k[5:]: z[k] for k in z.files if k.startswith("grad/")}}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
