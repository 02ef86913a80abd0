"""The one evaluation path: validation during training (`loop.evaluate`) and `jaxpar eval`.

Both score token windows with the same jitted function, built once per trainer from the run's
`ParallelLayout`: the forward runs through the pipeline schedule when `mesh.pipe > 1` (the
blocks stay where training keeps them), otherwise through the plain model under the layout's
activation rules. It returns the summed token NLL of each row, so a caller can pad a short
last batch to the compiled shape and drop the padded rows. Sharding and the pipeline only
reorder fp32 sums: the loss equals one device's within `tolerances.SHARDED_VS_SINGLE`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import Config
from jaxpar.models import gpt2
from jaxpar.parallel.layout import ParallelLayout
from jaxpar.parallel.logical import activation_rules


def make_logits_fn(cfg: Config, lay: ParallelLayout, mesh) -> Callable:
    """(params, tokens (B, T)) -> fp32 logits (B, T, V), not jitted. With a pipeline B must split
    into pipeline.microbatches per data-parallel replica, as in training."""
    if lay.pipelined:
        from jaxpar.parallel.pipeline import make_pipeline_logits_fn

        return make_pipeline_logits_fn(cfg, lay, mesh)
    graphdef = nnx.graphdef(gpt2.GPT2(cfg.model, policy=cfg.precision))  # built once, weights merged per call

    def logits(params, tokens):
        with activation_rules(mesh, lay.activation_rules):
            return nnx.merge(graphdef, params)(tokens)

    return logits


def make_nll_fn(cfg: Config, lay: ParallelLayout, mesh, param_shardings, batch_sharding) -> Callable:
    """jit (params, inputs (B, T), targets (B, T)) -> (B,) fp32 summed token NLL per row, replicated."""
    logits = make_logits_fn(cfg, lay, mesh)

    def row_nll(params, inputs, targets):
        return gpt2.token_nll(logits(params, inputs), targets).sum(-1)

    return jax.jit(row_nll, in_shardings=(param_shardings, batch_sharding, batch_sharding),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


def mean_loss(nll_fn: Callable, put: Callable, params, batches: Iterable[tuple[np.ndarray, np.ndarray]],
              rows: int) -> tuple[float, int]:
    """(summed NLL, target tokens) over host (inputs, targets) batches of at most `rows` rows.
    A shorter batch is padded with zero rows to `rows` (one compiled shape); padded rows are
    dropped. put: numpy (rows, T) -> global device array (`Trainer.put_batch`)."""
    total, tokens = 0.0, 0
    for x, y in batches:
        n, T = x.shape
        if n < rows:
            x, y = (np.concatenate([a, np.zeros((rows - n, T), a.dtype)]) for a in (x, y))
        total += float(np.asarray(nll_fn(params, put(x), put(y)))[:n].sum())
        tokens += n * T
    return total, tokens
