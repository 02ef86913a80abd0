"""A trained model on a mesh, for `jaxpar eval` and `jaxpar sample` (forward passes only).

The params are placed with exactly the shardings training uses for the same config
(the run's one `ParallelLayout`'s param specs), restored through
`jaxpar.run.checkpoint.restore` whatever mesh wrote them. The forward and the per-row NLL are
`jaxpar.run.evaluation`'s (the trainer's own eval function): through the pipeline schedule when
`mesh.pipe > 1`, otherwise the plain model under the layout's activation rules.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import Config, validate
from jaxpar.models import gpt2
from jaxpar.parallel import sharding as shd
from jaxpar.parallel.layout import min_batch_rows
from jaxpar.parallel.mesh import build_mesh, resolve_mesh_config
from jaxpar.run.checkpoint import restore
from jaxpar.run.evaluation import make_logits_fn, make_nll_fn


@dataclasses.dataclass
class Runner:
    cfg: Config  # mesh resolved against the devices
    mesh: Any
    param_shardings: Any  # tree of NamedSharding, same tree as the params
    batch_sharding: NamedSharding  # (B, T) token arrays: rows over data x fsdp
    logits: Callable  # (params, tokens (B, T)) -> fp32 logits (B, T, V), not jitted
    nll: Callable  # jit (params, inputs, targets) -> (B,) summed NLL per row (the trainer's eval_fn)
    put: Callable  # numpy (B, T) -> global batch array

    @property
    def replicas(self) -> int:
        """Rows a batch needs at least: one per data-parallel replica and pipeline microbatch."""
        return min_batch_rows(self.cfg.mesh, self.cfg.pipeline.microbatches)

    def abstract_params(self):
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            gpt2.abstract_params(self.cfg.model), self.param_shardings)

    def load(self, checkpoint: str = "", params=None):
        """Params from a run dir (any writer's mesh) or from host arrays (e.g. an HF dir), placed."""
        if checkpoint:
            return restore(checkpoint, self.abstract_params()).params
        return jax.device_put(params, self.param_shardings)


def build_runner(cfg: Config, min_batch: bool = False) -> Runner:
    """Resolve and check `cfg.mesh` against the devices (ConfigError on a bad mesh), then the
    shardings and the forward function. Call after the devices are set up (`commands._devices_for`).
    Batches have `train.batch_size` rows, or with `min_batch` (sampling) the fewest the mesh
    takes: one per data replica and pipeline microbatch. No gradient accumulation in a forward."""
    from jaxpar.train import resolve_layout

    tc = dataclasses.replace(cfg.train, grad_accum=1)
    if min_batch:  # the fewest rows the resolved sizes take (the layout then checks everything)
        mc = resolve_mesh_config(cfg.mesh, jax.device_count())
        tc = dataclasses.replace(tc, batch_size=min_batch_rows(mc, cfg.pipeline.microbatches))
    lay = resolve_layout(validate(dataclasses.replace(cfg, train=tc)), jax.device_count())  # validated once
    for w in lay.warnings:
        print(w, file=sys.stderr)
    cfg, mesh = lay.cfg, build_mesh(lay)
    # the parameter and batch shardings training uses for the same config: the layout's
    params_sh = shd.named(mesh, lay.param_specs(gpt2.param_axes(cfg.model)))
    batch_sh = NamedSharding(mesh, shd.batch_spec(lay.batch_axes))
    nll = make_nll_fn(cfg, lay, mesh, params_sh, batch_sh)
    put = functools.partial(shd.put_global_batch, sharding=batch_sh)
    return Runner(cfg, mesh, params_sh, batch_sh, make_logits_fn(cfg, lay, mesh), nll, put)


def make_next_logits(r: Runner, width: int) -> Callable:
    """(params, buf (W,) int32, pos) -> (V,) numpy fp32 logits at `pos`. The one sequence is
    repeated over `r.replicas` rows so that every data replica and pipeline microbatch gets
    a row (row 0's logits are returned; the others are identical copies)."""
    rows = r.replicas
    repl = NamedSharding(r.mesh, PartitionSpec())

    def next_logits(params, tokens, pos):
        return r.logits(params, tokens)[0, pos]

    jitted = jax.jit(next_logits, in_shardings=(r.param_shardings, r.batch_sharding, None), out_shardings=repl)

    def call(params, buf: np.ndarray, pos: int) -> np.ndarray:
        tokens = np.ascontiguousarray(np.broadcast_to(buf[None], (rows, width)))
        return np.asarray(jitted(params, shd.put_global_batch(tokens, r.batch_sharding), np.int32(pos)))

    return call
