"""One data-parallel reduction for the tied embedding's gradient.

GPT-2 ties `wte` (V, D): the token lookup and the LM head both read it, so its gradient is
the sum of a scatter-add (lookup) and a dot (head), each a partial sum over the batch rows a
data shard holds. XLA's SPMD partitioner reduces a partial sum at the op that makes it, so
plain data parallelism all-reduces the (V, D) gradient twice: for GPT-2 124M that is 1.31x
the ring all-reduce theory (benchmarks/comm_volume.py).

`grouped_loss` sums the two partial gradients before the reduction. The global batch is cut
into G = `data` groups (one per data shard, the rows that shard holds) and the loss is
`vmap`-ed over them with `wte` broadcast to (G, V, D) and sharded on G over `data`: each
group's wte gradient, lookup + head, is then local to its shard, and the one reduction left
is the sum over G of the (G, V, D) cotangent (the broadcast's transpose). Every other
parameter is unmapped, so its gradient is reduced as before. The model code is unchanged:
inside the vmap the per-group batch is unsharded (`batch` mapped to no mesh axis) and the
vmapped G dim carries the `data` split (`spmd_axis_name`).

Used when `data` > 1 and `fsdp` = 1 (under ZeRO-3 wte is sharded over fsdp on its embed dim
and its gradient is reduce-scattered once per use already; pipelines have their own loss).
The loss is the mean of G equal-sized group means = the global mean; values equal the
ungrouped loss to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def grouped_loss(loss: Callable, mesh, groups: int, wte_spec: PartitionSpec) -> Callable:
    """loss(params, inputs (B, T), targets (B, T), key) -> the same mean loss, computed as
    the mean over `groups` batch groups with wte mapped per group (see module docstring).

    `loss` must run the model with `batch` mapped to no mesh axis: the group dim carries it.
    wte_spec: wte's own (V, D) spec (vocab over `tensor` under Megatron), kept per group."""
    group_spec = NamedSharding(mesh, PartitionSpec("data", *wte_spec))

    def grouped(params, inputs, targets, key):
        B, T = inputs.shape
        wte = params["wte"]["weight"]  # (V, D) replicated over data
        rest = {k: v for k, v in params.items() if k != "wte"}
        # (G, V, D): one copy per data shard (a local broadcast, no communication)
        wte_g = jax.lax.with_sharding_constraint(jnp.broadcast_to(wte, (groups, *wte.shape)), group_spec)
        # (B, T) -> (G, B/G, T): group g = the contiguous rows data shard g holds
        xs, ys = inputs.reshape(groups, B // groups, T), targets.reshape(groups, B // groups, T)
        keys = None if key is None else jax.random.split(key, groups)  # distinct dropout per group

        def one(w, x, y, k):
            return loss({**rest, "wte": {"weight": w}}, x, y, k)

        per_group = jax.vmap(one, in_axes=(0, 0, 0, None if keys is None else 0), spmd_axis_name="data")(
            wte_g, xs, ys, keys)
        return per_group.mean()

    return grouped


# ----------------------------------------------------------------------------- pipelines
# A pipeline embeds and scores outside its stage loop, in auto-sharded SPMD, with the rows split
# over (data, pipe) (pipeline.outer_activation_rules): the same two partial wte gradients, each
# reduced over data·pipe (GPT-2 124M, data=2 x pipe=4: 1.58x theory, benchmarks/comm_volume.py).
# The embedding and the loss are two calls on either side of the stage loop, so the groups are
# made once (`broadcast_groups`) and both calls map over them (`per_group`): the (G, V, D)
# cotangent then sums both uses locally and the broadcast's transpose reduces it once.


def pipeline_groups(mesh, batch_axes) -> int:
    """G = devices the outer rows are split over (`batch_axes`), when the tied reduction applies:
    fsdp = 1 (under ZeRO-3 wte is split on its embed dim) and G > 1; else 1 (not grouped)."""
    shape = dict(mesh.shape)
    if shape.get("fsdp", 1) > 1:
        return 1
    g = 1
    for a in batch_axes:
        g *= shape.get(a, 1)
    return g


def broadcast_groups(wte, mesh, groups: int, batch_axes, wte_spec: PartitionSpec):
    """(V, D) -> (G, V, D), one copy per row shard (a local broadcast, no communication)."""
    spec = NamedSharding(mesh, PartitionSpec(tuple(batch_axes), *wte_spec))
    return jax.lax.with_sharding_constraint(jnp.broadcast_to(wte, (groups, *wte.shape)), spec)


def per_group(fn: Callable, wte_g, batch_axes, *rows):
    """vmap fn(wte (V, D), *row arrays (B/G, ...)) over the G groups of `wte_g` and of each
    (B, ...) array in `rows` (group g = the contiguous rows shard g holds); returns fn's outputs
    with a leading G dim. fn must run the model with `batch` mapped to no mesh axis."""
    G = wte_g.shape[0]
    split = [r.reshape(G, r.shape[0] // G, *r.shape[1:]) for r in rows]
    return jax.vmap(fn, spmd_axis_name=tuple(batch_axes))(wte_g, *split)
