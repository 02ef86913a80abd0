"""The attention paths on one GPU against each other: loss and gradients of GPT-2 124M, seq 1024.

    python benchmarks/gpu_check.py [--batch 4] [--seq 1024] [--out benchmarks/results/gpu_check.json]

On GPU `model.attention=auto` is cuDNN flash attention in bf16 (jaxpar.models.gpt2.attention_impl);
this compares it, XLA's `jax.nn.dot_product_attention` and jaxpar's own einsum core (forced) on the
same weights and batch, all through the real loss function (`jaxpar.train.make_loss_fn`):

  * bf16 rows: each path against the fp32 einsum reference: |d loss| / loss and ||d grad|| / ||grad||
    (the norm over every parameter's gradient at once);
  * fp32 rows: XLA's path against the einsum core, both fp32.

The CPU pins (tests/models/test_attention.py: xla == einsum within 1e-6 in fp32) cannot run cuDNN; this is
their GPU counterpart, run when a GPU is lent. On a machine without a GPU it refuses: one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_mfu, also under runpy (gpu_session.sh)

from gpu_mfu import start_gpu, write_json  # noqa: E402


def grads_and_loss(precision: str, impl: str, batch: int, seq: int):
    """(loss, flat fp32 gradient vector) of gpt2 at `precision` with attention `impl` forced."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.config import PRESETS, Config, TrainConfig
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.train import make_loss_fn

    real = gpt2.attention_impl
    gpt2.attention_impl = lambda *a, **k: impl  # einsum has no config name on GPU
    try:
        mc = dataclasses.replace(PRESETS["gpt2"], attention="auto")
        cfg = Config(model=mc, model_name="gpt2", precision=precision,
                     train=TrainConfig(batch_size=batch, seq_len=seq))
        loss_fn = make_loss_fn(lay := build_layout(cfg, 1), build_mesh(lay, jax.devices()[:1]))
        params = gpt2.init_params(mc, 0)
        toks = np.random.default_rng(0).integers(0, mc.vocab_size, (batch, seq + 1)).astype(np.int32)
        loss, g = jax.jit(jax.value_and_grad(loss_fn))(params, jnp.asarray(toks[:, :-1]),
                                                       jnp.asarray(toks[:, 1:]), None)
        flat = jnp.concatenate([x.astype(jnp.float32).ravel() for x in jax.tree.leaves(g)])
        return float(loss), np.asarray(flat, np.float64)
    finally:
        gpt2.attention_impl = real


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "gpu_check.json"))
    args = p.parse_args(argv)
    if not start_gpu("gpu_check.py", "compares the GPU attention paths"):
        return 2
    import jax
    import numpy as np

    ref_loss, ref_g = grads_and_loss("fp32", "einsum", args.batch, args.seq)
    rows = []

    def row(precision, impl, against, a_loss, a_g):
        loss, g = grads_and_loss(precision, impl, args.batch, args.seq)
        r = {"precision": precision, "attention": impl, "against": against, "loss": loss,
             "loss_rel": abs(loss - a_loss) / abs(a_loss),
             "grad_rel": float(np.linalg.norm(g - a_g) / np.linalg.norm(a_g)), "finite": bool(np.isfinite(g).all())}
        rows.append(r)
        print(f"{precision:<5} {impl:<6} vs {against:<12} loss {loss:.6f}  |dloss|/loss {r['loss_rel']:.2e}  "
              f"||dg||/||g|| {r['grad_rel']:.2e}  finite {r['finite']}", flush=True)

    print(f"fp32 einsum reference: loss {ref_loss:.6f}, ||g|| {np.linalg.norm(ref_g):.4e}", flush=True)
    row("fp32", "xla", "fp32 einsum", ref_loss, ref_g)
    for impl in ("cudnn", "xla", "einsum"):
        row("bf16", impl, "fp32 einsum", ref_loss, ref_g)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": args.batch, "seq": args.seq,
              "reference_loss": ref_loss, "rows": rows}
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
