"""Logical axis names -> mesh axes: one rules table per strategy, as data.

The model names logical dims (`batch, seq, embed, heads, head_dim, mlp, vocab, layers`);
these tables say which mesh axis each name is split over. Parameter rules and activation
rules are separate tables (MaxText `logical_axis_rules`, Levanter's parameter/activation
maps). `param_rules(mesh_cfg)` composes the tables of the axes in use, in the documented
order data -> fsdp -> tensor (later tables add names; no name is claimed twice). The
`pipe` axis is never used here: the pipeline schedule (`jaxpar.parallel.pipeline`) places
stages itself.

What each strategy means for GPT-2 (shapes in `jaxpar.models.gpt2`):

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
  `tensor` (`train.check_model_vs_mesh`).
* products compose: data×fsdp×tensor splits the batch over data·fsdp, each parameter on
  embed over fsdp and on heads/mlp/vocab over tensor.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import MeshConfig
from jaxpar.logical import spec_for

BATCH_AXES = ("data", "fsdp")  # the batch dim is split over every data-parallel axis

# ---- parameter rules (one table per strategy; composed by `param_rules`)
# Data parallel: nothing sharded, params replicated.
DP_PARAM_RULES: dict = {}
# FSDP / ZeRO-3: params (hence grads and optimizer state) sharded on their embed dim over fsdp.
FSDP_PARAM_RULES = {"embed": "fsdp"}
# Tensor (Megatron): heads / mlp / vocab over tensor -> qkv & c_fc column-parallel,
# c_proj row-parallel, vocab-parallel embedding and logits.
TP_PARAM_RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}

# ---- per-group OSDP (`sharding.replicate=embed,attn,mlp`): parameter groups, by path prefix,
# that keep the data-parallel rules (replicated over fsdp) while the others are ZeRO-3 sharded.
# Same groups as the planner's cost model (jaxpar.planner.cost.GROUPS).
PARAM_GROUPS = {
    "embed": ("wte", "wpe", "ln_f"),
    "attn": ("h.ln_1", "h.attn"),
    "mlp": ("h.ln_2", "h.mlp"),
}

# ---- activation rules: batch over the data-parallel axes; inside a block the head / mlp
# dims follow the parameters' tensor split; the residual stream (embed) stays whole
# (no sequence parallelism), so each row-parallel matmul ends in one all-reduce.
ACTIVATION_RULES = {"batch": BATCH_AXES, "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}

# Named strategies (used by the golden snapshot, the examples and the comm benchmark).
STRATEGIES: dict[str, MeshConfig] = {
    "dp": MeshConfig(data=8),
    "fsdp": MeshConfig(fsdp=8),
    "tp": MeshConfig(tensor=4, data=2),
    "dp_fsdp_tp": MeshConfig(data=2, fsdp=2, tensor=2),
}


def param_rules(mc: MeshConfig, replicated: bool = False) -> dict:
    """Parameter rules for the axes in use (size != 1), composed data -> fsdp -> tensor.
    replicated: an OSDP group kept whole over fsdp (the fsdp table is skipped)."""
    rules: dict = dict(DP_PARAM_RULES)
    if mc.fsdp != 1 and not replicated:
        rules.update(FSDP_PARAM_RULES)
    if mc.tensor != 1:
        rules.update(TP_PARAM_RULES)
    return rules


def activation_rules(mc: MeshConfig) -> dict:
    """Activation rules (names mapped to size-1 axes are harmless no-ops)."""
    return dict(ACTIVATION_RULES)


def param_specs(axes_tree, rules) -> dict:
    """Tree of logical-axes tuples -> tree of PartitionSpec."""
    import jax

    return jax.tree.map(lambda a: spec_for(a, rules), axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def group_of(path: str) -> str:
    """OSDP group of a dotted parameter path ("h.attn.c_attn.weight" -> "attn")."""
    for g, prefixes in PARAM_GROUPS.items():
        if any(path == p or path.startswith(p + ".") for p in prefixes):
            return g
    raise KeyError(path)


def grouped_param_specs(axes_tree, mc: MeshConfig, replicate=(), extra_rules: dict | None = None) -> dict:
    """param_specs with per-group rules: groups in `replicate` skip the fsdp table.
    `extra_rules` (e.g. the pipeline's `layers` -> pipe) apply to every group."""
    import jax

    extra = extra_rules or {}
    by_group = {g: {**param_rules(mc, g in replicate), **extra} for g in PARAM_GROUPS}

    def one(path, a):
        return spec_for(a, by_group[group_of(".".join(k.key for k in path))])

    return jax.tree_util.tree_map_with_path(one, axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def block_group_rules(mc: MeshConfig, replicate=()) -> dict:
    """Rules per top-level block key (ln_1, attn, ln_2, mlp): for code that walks BLOCK_AXES."""
    return {k: param_rules(mc, group_of(f"h.{k}") in replicate) for k in ("ln_1", "attn", "ln_2", "mlp")}


def named(mesh, specs):
    """Tree of PartitionSpec -> tree of NamedSharding on `mesh`."""
    import jax

    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec() -> PartitionSpec:
    """(B, T) token arrays: rows over the data-parallel axes."""
    return PartitionSpec(BATCH_AXES, None)


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
    or use `jaxpar.mesh.mesh_and_rules`.

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
