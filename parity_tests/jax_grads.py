"""Worker: step-1 gradients of jaxpar configurations, exactly as `jaxpar train` computes them.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m parity_tests.jax_grads DIR

DIR/rows.json: {"rows": [{name, mesh, pipeline, precision}], "init", "data", "common"}. For each
row: the Config `jaxpar train` would resolve from the same keys, `build_trainer` on a mesh of
exactly that many devices (the first of the 8), the weights of the HF init placed with the
trainer's parameter shardings, the first global batch (`train_batch(..., step=0)`), and
`jax.grad` of the trainer's own loss (`make_loss_fn`: pipeline schedule included). Writes
DIR/row<i>.npz with HF-named float32 gradients (`to_hf_state_dict`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import numpy as np


def main(path: str) -> None:
    import jax

    from gpt2common import data, hf
    from jaxpar.config import resolve
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.mesh import build_mesh, mesh_size, resolve_mesh_config
    from jaxpar.train import build_trainer, make_loss_fn

    with open(os.path.join(path, "rows.json")) as f:
        spec = json.load(f)
    mcfg, params = hf.load_hf(spec["init"])
    with open(os.path.join(path, "todo.json")) as f:
        todo = json.load(f)
    for i in todo:
        row = spec["rows"][i]
        args = list(spec["common"]) + [f"mesh.{k}={v}" for k, v in row["mesh"].items()]
        args += [f"pipeline.{k}={v}" for k, v in row["pipeline"].items()] + [f"precision={row['precision']}"]
        cfg = resolve(args)
        n = mesh_size(cfg.mesh)
        cfg = dataclasses.replace(cfg, model=mcfg, mesh=resolve_mesh_config(cfg.mesh, n))
        mesh = build_mesh(cfg.mesh, jax.devices()[:n])
        tr = build_trainer(build_layout(cfg, mesh.devices.size), mesh)
        loss_fn = make_loss_fn(tr.layout, mesh)
        ps = tr.state_shardings["params"]
        grad = jax.jit(jax.grad(functools.partial(loss_fn, key=None)),
                       in_shardings=(ps, tr.batch_sharding, tr.batch_sharding), out_shardings=ps)
        ds = data.Dataset.open(spec["data"], mcfg.vocab_size, cfg.train.seq_len)
        x, y = data.train_batch(ds, cfg.train.seq_len, cfg.train.batch_size, cfg.seed, 0)
        g = grad(jax.device_put(params, ps), tr.put_batch(x), tr.put_batch(y))
        sd = hf.to_hf_state_dict(mcfg, jax.device_get(g))
        np.savez(os.path.join(path, f"row{i}.npz"), **sd)
        print(f"{row['name']}: {len(sd)} gradients", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
