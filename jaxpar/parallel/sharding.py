"""Logical axis names -> mesh axes: one rules table per parallelism, as data.

The model names logical dims (`batch, seq, embed, heads, head_dim, mlp, vocab, layers`);
these tables say which mesh axis each name is split over. Parameter rules and activation
rules are separate tables (MaxText `logical_axis_rules`, Levanter's parameter/activation
maps). The tables themselves, their composition (`param_rules`: data -> fsdp -> tensor ->
pipe) and the per-group choice live in `jaxpar.parallel.layout` (jax-free, resolved once per run into a
`ParallelLayout`); this module turns rules into PartitionSpecs / NamedShardings and places
batches. `layers -> pipe` (the stacked block dim over `pipe`) is a layout rule that applies only
when a pipeline runs; `resolved_param_specs` shows the rules without it.

What each parallelism means for GPT-2 (shapes in `jaxpar.models.gpt2`):

* data (DP): every parameter replicated; the batch dim split over `data` (and `fsdp`);
  gradients all-reduced over the batch axes once per step (2(N-1)/N·Ψ per device, ring).
* fsdp (ZeRO-3): every parameter, hence its gradient and both AdamW moments, split on its
  `embed` dim over `fsdp` (all but c_attn.bias and c_fc.bias, 0.05% of gpt2, which have
  no embed dim and stay whole; memory is ~Ψ/N per device). The
  blocks are scanned, so the compiler all-gathers one layer's weights inside the loop
  (forward, and again in backward) and reduce-scatters its gradient: 3(N-1)/N·Ψ per device.
* tensor (Megatron): `heads` and `mlp` over `tensor` make c_attn / c_fc column-parallel and
  attn.c_proj / mlp.c_proj row-parallel (one all-reduce of (b, s, h) after each in forward,
  one before each in backward); `vocab` over `tensor` makes the tied embedding
  vocab-parallel (lookup and logits). Needs n_head, 4·n_embd and vocab_size divisible by
  `tensor` (`layout.mesh_problem`).
* products compose: data×fsdp×tensor splits the batch over data·fsdp, each parameter on
  embed over fsdp and on heads/mlp/vocab over tensor.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import MeshConfig
from jaxpar.parallel.layout import (  # noqa: F401  (the tables, re-exported for library users)
    ACTIVATION_RULES,
    BATCH_AXES,
    DP_PARAM_RULES,
    FSDP_PARAM_RULES,
    NAMED_MESHES,
    TP_PARAM_RULES,
    param_rules,
)
from jaxpar.parallel.logical import spec_for


def param_specs(axes_tree, rules) -> dict:
    """Tree of logical-axes tuples -> tree of PartitionSpec."""
    import jax

    return jax.tree.map(lambda a: spec_for(a, rules), axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def named(mesh, specs):
    """Tree of PartitionSpec -> tree of NamedSharding on `mesh`."""
    import jax

    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec(batch_axes=BATCH_AXES) -> PartitionSpec:
    """(B, T) token arrays: rows over the data-parallel axes."""
    return PartitionSpec(batch_axes, None)


def spec_to_json(spec: PartitionSpec) -> list:
    """PartitionSpec -> JSON-able list (None, "axis" or ["a", "b"] per dim)."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def resolved_param_specs(model_cfg, mc: MeshConfig) -> dict[str, list]:
    """{"h.attn.c_attn.weight": [None, "fsdp", None, "tensor", None], ...} for every GPT-2
    parameter under `mc` (what the golden snapshot test pins)."""
    import jax

    from jaxpar.models import gpt2

    specs = param_specs(gpt2.param_axes(model_cfg), param_rules(mc))
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return {".".join(k.key for k in path): spec_to_json(s) for path, s in flat}


def local_shard_elements(model_cfg, mc: MeshConfig) -> int:
    """Parameter elements one device holds under `mc` (sum over params of size / split)."""
    import jax

    from jaxpar.models import gpt2

    sizes = {"data": mc.data, "fsdp": mc.fsdp, "tensor": mc.tensor, "pipe": mc.pipe}
    specs = param_specs(gpt2.param_axes(model_cfg), param_rules(mc))
    total = 0
    for shape, spec in zip(jax.tree.leaves(gpt2.param_shapes(model_cfg), is_leaf=lambda x: isinstance(x, tuple)),
                           jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))):
        split = 1
        for e in spec:
            for a in ((e,) if isinstance(e, str) else (e or ())):
                split *= max(sizes[a], 1)
        total += int(np.prod(shape)) // split
    return total


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """[lo, hi) rows of a dim-0-sharded global array that this process's devices hold.

    With devices ordered by process, the data-parallel axes give each process a contiguous
    block of rows (or all rows when the batch is replicated across processes)."""
    idx = sharding.addressable_devices_indices_map(global_shape).values()
    starts = [(s[0].start or 0) for s in idx]
    stops = [(s[0].stop if s[0].stop is not None else global_shape[0]) for s in idx]
    lo, hi = min(starts), max(stops)
    covered = sum(b - a for a, b in {(a, b) for a, b in zip(starts, stops)})
    if covered != hi - lo:
        raise ValueError(f"this process's rows are not contiguous ({sorted(set(zip(starts, stops)))})")
    return lo, hi


def put_global_batch(x: np.ndarray, sharding: NamedSharding):
    """A global array from per-process slices: each process passes the *global* batch `x`
    (data order is a pure function of (seed, step)) and contributes only its own rows via
    `jax.make_array_from_process_local_data`, so the same code runs single- and multi-process."""
    import jax

    lo, hi = process_rows(sharding, x.shape)
    return jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(x[lo:hi]), x.shape)


# ----------------------------------------------------------------------------- Flax's rules form
# Flax (linen and NNX alike) keeps one logical-axis-rules table as pairs, `((name, mesh axes), ...)`,
# read by `nnx.with_partitioning` annotations (eager sharding, `nnx.get_partition_spec`) and by
# `flax.linen.with_logical_constraint`. Two differences from our dicts decide the layout of the pairs:
# * Flax passes a name it has no pair for through unchanged (it would then be taken for a mesh axis),
#   so every logical name gets a pair, `None` meaning "not split".
# * Activation constraints assign mesh axes in pair order, skipping a pair whose axes are taken, so
#   `batch` comes first: an activation (batch, seq, embed) keeps the batch split over (data, fsdp) and
#   leaves embed whole, as our `spec_for` does. Parameters have no batch dim and see only their pairs.

LOGICAL_NAMES = ("batch", "seq", "embed", "heads", "head_dim", "mlp", "vocab", "layers")


def to_flax_rules(rules, names=LOGICAL_NAMES) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """A rules dict -> Flax's logical-axis-rules pairs, one pair per name in `names` (then any other
    name of `rules`), in that order; names the dict does not map get `None`. A pairs tuple is
    returned unchanged. Feed the result to `flax.linen.logical_axis_rules` / `nnx.logical_axis_rules`,
    or use `jaxpar.parallel.mesh.mesh_and_rules`.

        >>> to_flax_rules({"embed": "fsdp", "batch": ("data", "fsdp")}, names=("batch", "embed", "mlp"))
        (('batch', ('data', 'fsdp')), ('embed', 'fsdp'), ('mlp', None))
    """
    if isinstance(rules, tuple):
        return rules
    order = list(names) + [k for k in rules if k not in names]
    return tuple((k, rules.get(k)) for k in order)


def model_rules(mc: MeshConfig) -> dict:
    """One table for a model of your own under `mc`: the parameter rules plus the batch split of
    the activations (`batch` -> data, fsdp). `to_flax_rules(model_rules(mc))` is its Flax form."""
    return {"batch": BATCH_AXES, **param_rules(mc)}


def flax_rules(mc: MeshConfig) -> tuple:
    """`model_rules(mc)` in Flax's pairs form (see `to_flax_rules`)."""
    return to_flax_rules(model_rules(mc))
