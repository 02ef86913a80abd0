"""ZeRO-3 (FSDP) as an explicit per-device program, so the gradient is reduce-scattered.

Under the auto-sharded step the SPMD partitioner reduces a ZeRO-3 gradient with an
all-reduce of the *full* gradient over `fsdp` and then slices the device's shard: XLA:GPU's
ReduceScatterCreator fuses that pair into a reduce-scatter, XLA:CPU does not, so on CPU the
step moved 1.23x the ZeRO-3 theory for GPT-2 124M (benchmarks/comm_volume.py). Here the
loss runs per device in `jax.shard_map`, manual over the batch axes (data, fsdp) and
automatic over `tensor`, and the collectives are written out:

  * each block's weights are all-gathered over fsdp *inside* the layer scan, so one layer is
    whole at a time (ZeRO-3 memory); their autodiff transpose is a `psum_scatter` over fsdp
    - the reduce-scatter - of that layer's gradient, once per layer;
  * the gathered block weights are never saved for backward (a checkpoint policy),
    so backward gathers each layer again: 3(f-1)/f·Ψ_blocks per device, the textbook ZeRO-3;
  * wte, wpe and ln_f are gathered once before the blocks and kept: the head uses wte at the
    end of forward and its backward right after, so a second gather would buy no memory at
    the step's peak (the logits). The tied wte's two uses (lookup, head) sum their gradients
    locally before its one reduce-scatter;
  * every parameter is marked varying over `data` (and over `fsdp` when it is not sharded
    there: replicated OSDP groups, the few params with no embed dim) once, before the scan,
    on its local shard: the transpose is one psum over data of the 1/f shard per step,
    2(d-1)/d·Ψ/f per device.

Same numbers as the auto-sharded path (the sums run in another order; fp32 parity bound):
`tests/parallel/test_sharding_equivalence.py`. Model code is unchanged: `gpt2.GPT2` embeds and
scores with the gathered params and one layer's `gpt2.Block` (weights merged per scan step)
runs each gathered layer; inside the shard_map only the tensor rules are in force (the batch
dim is local).

Used for fsdp > 1 without a pipeline (the pipeline gathers its stages itself) and without
dropout (the auto path draws one mask for the global batch; per-device draws would differ
from it, so dropout > 0 keeps the auto-sharded step). Also kept on the auto-sharded step:
train.remat=selective and train.mlp_chunks > 1. Their own inner `jax.checkpoint`s (attention
core, MLP chunks) lost their memory saving inside this file's policy checkpoint (measured,
4L/256 d=2 f=4: temp 59.9 vs 50.1 MiB selective, 67.4 vs 35.2 MiB mlp_chunks=4); not solved yet.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config, Remat
from jaxpar.models import gpt2
from jaxpar.models.precision import get_policy
from jaxpar.parallel.layout import ParallelLayout, zero3_applies
from jaxpar.parallel.logical import activation_rules
from jaxpar.parallel.pipeline import _manual_spec, _varying

MANUAL = ("data", "fsdp")  # shard_map is manual over the batch axes; `tensor` stays automatic


def applies(cfg: Config, mesh) -> bool:
    """True when the loss runs through this file (the layout's `zero3_applies` on `mesh`'s sizes)."""
    shape = dict(mesh.shape)
    return zero3_applies(cfg, shape.get("fsdp", 1), shape.get("pipe", 1))


def _gather(a, spec: P, tensor_spec: P):
    """All-gather the dims of `a` that `spec` (manual axes only) splits: (.., D/f, ..) -> (.., D, ..).
    tensor_spec: the (automatic) tensor split of `a`. The gather runs in a nested shard_map
    manual over `tensor` too: a manual collective on an operand split over an automatic axis
    makes the partitioner gather that axis first (seen in the HLO: an all-gather over tensor
    before every fsdp gather, and again before every reduce-scatter)."""
    def gather(x):
        for dim, axis in enumerate(spec):
            if axis is not None:
                x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
        return x

    if all(e is None for e in spec):
        return a
    if all(e is None for e in tensor_spec):
        return gather(a)
    return jax.shard_map(gather, in_specs=tensor_spec, out_specs=tensor_spec, axis_names=frozenset({"tensor"}))(a)


# re-layouts: recomputing one costs a copy, saving it saves nothing (same bytes as its input)
_RELAYOUTS = ("reshape", "transpose")


def _not_gathered(prim, *_, **__) -> bool:
    """Checkpoint policy: every value may be saved for backward except an all-gather's output (a
    whole layer's weights) and re-layouts, which may be of gathered weights (ops.chunked_mlp
    splits w_fc / w_proj into chunks: measured, the MLP weights were then kept from forward to
    backward). Backward gathers the layer again."""
    return prim.name != "all_gather" and prim.name not in _RELAYOUTS


def make_fsdp_loss_fn(cfg: Config, mesh, lay: ParallelLayout) -> Callable:
    """(params, inputs (B,T), targets (B,T), key=None) -> mean fp32 loss, ZeRO-3 over fsdp with
    explicit gathers and reduce-scatters (see module docstring). Params arrive in their stored
    shardings (the layout's per-group specs, `ParallelLayout.param_specs`)."""
    policy, mc, tc = get_policy(cfg.precision), cfg.model, cfg.train
    specs = lay.param_specs(gpt2.param_axes(mc))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    manual = jax.tree.map(lambda s: _manual_spec(s, MANUAL), specs, is_leaf=is_spec)
    tensor = jax.tree.map(lambda s: _manual_spec(s, ("tensor",)), specs, is_leaf=is_spec)
    # one layer's specs: the stacked `layers` dim (never split) dropped
    layer_specs = jax.tree.map(lambda s: P(*s[1:]), (manual["h"], tensor["h"]), is_leaf=is_spec)
    mode = Remat(tc.remat)
    block = nnx.graphdef(gpt2.Block(mc, policy, remat=mode, mlp_chunks=tc.mlp_chunks))  # one layer's structure

    def layer(h, lp):
        # lp: one layer's local shards; gathered here, so the scan holds one whole layer at a time
        lp = jax.tree.map(_gather, lp, *layer_specs)
        return nnx.merge(block, lp)(h), None

    if mode == Remat.FULL:  # only the block input is saved
        layer = jax.checkpoint(layer, prevent_cse=False)
    else:  # save what the mode saves, except the gathered weights: backward gathers them again
        layer = jax.checkpoint(layer, prevent_cse=False, policy=_not_gathered)

    def per_device(params, inputs, targets):
        # params: local shards; inputs/targets (B/(d·f), T)
        # varying over every manual axis once, on the shard: transpose = one psum over data
        # (over data·fsdp for params not sharded over fsdp), outside the layer loop
        params = jax.tree.map(lambda a: _varying(a, MANUAL), params)
        outer = {k: jax.tree.map(_gather, params[k], manual[k], tensor[k]) for k in ("wte", "wpe", "ln_f")}
        model = gpt2.GPT2(mc, {**outer, "h": params["h"]}, policy=policy, vocab_chunks=tc.vocab_chunks)
        with activation_rules(jax.sharding.get_abstract_mesh(), lay.pipeline_rules):  # tensor: the only auto axis
            x = model.embed(inputs)  # (b, T, D)
            # rolled even where gpt2.scan_unroll unrolls (on CPU): unrolled, each layer's
            # gathered weights were kept from forward to backward (measured: gather bytes = reduce-
            # scatter bytes, not 2x), i.e. every layer whole at once, not ZeRO-3 memory
            x, _ = jax.lax.scan(layer, x, params["h"])
            loss = model.head_loss(x, targets)  # mean over this device's b·T tokens
        return jax.lax.pmean(loss, MANUAL)  # equal rows per device: the global mean

    batch = P(MANUAL, None)
    f = jax.shard_map(per_device, mesh=mesh, in_specs=(manual, batch, batch), out_specs=P(),
                      axis_names=frozenset(MANUAL))

    def loss(params, inputs, targets, key=None):
        assert key is None, "dropout > 0 keeps the auto-sharded step (fsdp.applies)"
        return f(params, inputs, targets)

    return loss

