"""A trained model on a mesh, for `jaxpar eval` and `jaxpar sample` (forward passes only).

The params are placed with exactly the shardings training uses for the same config
(`train.build_trainer`: one rules table, one place), restored through `jaxpar.checkpoint.restore`
whatever mesh wrote them. With `mesh.pipe > 1` the blocks run through the pipeline schedule
(`parallel.pipeline.make_pipeline_logits_fn`), otherwise through the plain model under the
activation rules. Sharding only reorders fp32 sums, so the numbers equal one device's within
`tolerances.SHARDED_VS_SINGLE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import sharding as shd
from jaxpar.checkpoint import restore
from jaxpar.config import Config, validate
from jaxpar.logical import activation_rules
from jaxpar.mesh import resolve_mesh_config
from jaxpar.models import gpt2
from jaxpar.precision import get_policy


@dataclasses.dataclass
class Runner:
    cfg: Config  # mesh resolved against the devices
    mesh: Any
    param_shardings: Any  # tree of NamedSharding, same tree as the params
    batch_sharding: NamedSharding  # (B, T) token arrays: rows over data x fsdp
    logits: Callable  # (params, tokens (B, T)) -> fp32 logits (B, T, V), not jitted

    @property
    def replicas(self) -> int:
        """Rows a batch needs at least: one per data-parallel replica and pipeline microbatch."""
        m = self.mesh.shape
        return m["data"] * m["fsdp"] * (self.cfg.pipeline.microbatches if m["pipe"] > 1 else 1)

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
    from jaxpar.train import build_trainer, check_model_vs_mesh

    mc = resolve_mesh_config(cfg.mesh, jax.device_count())
    rows = mc.data * mc.fsdp * (cfg.pipeline.microbatches if mc.pipe > 1 else 1)
    tc = dataclasses.replace(cfg.train, grad_accum=1, **({"batch_size": rows} if min_batch else {}))
    cfg = dataclasses.replace(cfg, mesh=mc, train=tc)
    validate(cfg)
    check_model_vs_mesh(cfg.model, cfg)
    trainer = build_trainer(cfg)  # nothing is compiled until called: only its shardings are used
    mesh = trainer.mesh
    if mesh.shape["pipe"] > 1:
        from jaxpar.parallel.pipeline import make_pipeline_logits_fn

        logits = make_pipeline_logits_fn(cfg, mesh)
    else:
        rules, policy = shd.activation_rules(cfg.mesh), get_policy(cfg.precision)

        def logits(params, tokens):
            with activation_rules(mesh, rules):
                return gpt2.forward(cfg.model, params, tokens, policy)

    return Runner(cfg, mesh, trainer.state_shardings["params"], trainer.batch_sharding, logits)


def make_row_nll(r: Runner) -> Callable:
    """jit (params, inputs (B,T), targets (B,T)) -> (B,) summed token NLL per row, replicated."""
    def row_nll(params, x, y):
        return gpt2.token_nll(r.logits(params, x), y).sum(-1)

    repl = NamedSharding(r.mesh, PartitionSpec())
    jitted = jax.jit(row_nll, in_shardings=(r.param_shardings, r.batch_sharding, r.batch_sharding),
                     out_shardings=repl)
    return lambda params, x, y: np.asarray(jitted(params, shd.put_global_batch(x, r.batch_sharding),
                                                  shd.put_global_batch(y, r.batch_sharding)))


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
