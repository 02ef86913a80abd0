"""Logical axis names -> mesh axes: one rules table per strategy, as data.

Parameter rules and activation rules are separate tables (MaxText `logical_axis_rules`,
Levanter's parameter/activation maps). `rules_for(mesh_cfg)` composes the tables of the
axes that are in use, in the documented order data -> fsdp -> tensor.
"""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import MeshConfig
from jaxpar.logical import spec_for

BATCH_AXES = ("data", "fsdp")  # the batch dim is split over every data-parallel axis

# Data parallel: params replicated; batch over data (and fsdp when present).
DP_PARAM_RULES: dict = {}
# FSDP / ZeRO-3: params (hence grads and optimizer state) sharded on their embed dim over fsdp.
FSDP_PARAM_RULES = {"embed": "fsdp"}
# Tensor (Megatron): heads / mlp / vocab over tensor -> qkv & c_fc column-parallel,
# c_proj row-parallel, vocab-parallel embedding and logits.
TP_PARAM_RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}

ACTIVATION_RULES = {"batch": BATCH_AXES, "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def param_rules(mc: MeshConfig) -> dict:
    rules: dict = dict(DP_PARAM_RULES)
    if mc.fsdp != 1:
        rules.update(FSDP_PARAM_RULES)
    if mc.tensor != 1:
        rules.update(TP_PARAM_RULES)
    return rules


def activation_rules(mc: MeshConfig) -> dict:
    return dict(ACTIVATION_RULES)


def param_specs(axes_tree, rules) -> dict:
    """Tree of logical-axes tuples -> tree of PartitionSpec."""
    import jax

    return jax.tree.map(lambda a: spec_for(a, rules), axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def named(mesh, specs):
    import jax

    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_spec() -> PartitionSpec:
    """(B, T) token arrays: rows over the data-parallel axes."""
    return PartitionSpec(BATCH_AXES, None)
