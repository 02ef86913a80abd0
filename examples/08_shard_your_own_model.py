"""Shard a Flax NNX model of your own with jaxpar's mesh utilities: annotate parameters the Flax way
(`nnx.with_partitioning(init, ("embed", "mlp"))`), then train it over data x fsdp x tensor on 8
emulated CPU devices, and check that the losses and gradients equal a one-device run (fp32).

The model is not GPT-2: a byte-level MLP language model (Bengio et al. 2003): embed the last
CONTEXT bytes, concatenate, a Megatron-style MLP (up to HIDDEN, down to EMBED), LayerNorm, logits
over the next byte. Each parameter's names must map to different mesh axes (Flax maps names one by
one), so a (mlp, vocab) matrix would put `tensor` twice: the logits read the EMBED-wide stream.

    python examples/08_shard_your_own_model.py [--steps N] [--save out.npz]

What jaxpar adds to plain Flax is three calls:
    mesh = M.build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))   # validated (data, fsdp, tensor, pipe) mesh
    rules = S.model_rules(mesh_cfg)      # {"batch": ("data", "fsdp"), "embed": "fsdp", "mlp": "tensor", ...}
    with M.mesh_and_rules(mesh, rules):  # jax.set_mesh + Flax's logical_axis_rules (pairs) together
        ...                              # build, shard and train exactly as in Flax's own guides
"""

import argparse
import os
import sys

# Emulated CPU devices must be requested before JAX initialises.
from jaxpar.parallel import mesh as M  # noqa: E402  (imports no JAX backend)

M.emulate_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen, nnx  # noqa: E402

from gpt2common.data import builtin_text  # noqa: E402
from jaxpar.config import MeshConfig  # noqa: E402
from jaxpar.parallel import sharding as S  # noqa: E402

VOCAB, CONTEXT, EMBED, HIDDEN = 256, 8, 32, 128
BATCH, LR, SEED = 32, 3e-3, 0


def part(init, names):
    """An initializer whose Variable carries logical axis names (Flax's own annotation)."""
    return nnx.with_partitioning(init, names)


class MLPLanguageModel(nnx.Module):
    """Next byte from the previous CONTEXT bytes. Parameters and their logical axes:
    embed.embedding (VOCAB, EMBED) (vocab, embed); up.kernel (CONTEXT·EMBED, HIDDEN) (embed, mlp);
    down.kernel (HIDDEN, EMBED) (mlp, embed); norm.scale/bias (EMBED,) (embed,);
    out.kernel (EMBED, VOCAB) (embed, vocab); biases name their one dim likewise."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers
        self.embed = nnx.Embed(VOCAB, EMBED, embedding_init=part(init.normal(0.02), ("vocab", "embed")), rngs=rngs)
        # Column-parallel up (mlp over tensor), row-parallel down (one all-reduce), as in Megatron.
        self.up = nnx.Linear(CONTEXT * EMBED, HIDDEN, kernel_init=part(init.lecun_normal(), ("embed", "mlp")),
                             bias_init=part(init.zeros_init(), ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(HIDDEN, EMBED, kernel_init=part(init.lecun_normal(), ("mlp", "embed")),
                               bias_init=part(init.zeros_init(), ("embed",)), rngs=rngs)
        self.norm = nnx.LayerNorm(EMBED, scale_init=part(init.ones_init(), ("embed",)),
                                  bias_init=part(init.zeros_init(), ("embed",)), rngs=rngs)
        self.out = nnx.Linear(EMBED, VOCAB, kernel_init=part(init.lecun_normal(), ("embed", "vocab")),
                              bias_init=part(init.zeros_init(), ("vocab",)), rngs=rngs)

    def __call__(self, x):  # x: (B, CONTEXT) int32 -> logits (B, VOCAB) fp32
        e = self.embed(x).reshape(x.shape[0], CONTEXT * EMBED)  # (B, CONTEXT·EMBED)
        h = jax.nn.gelu(self.up(e))  # (B, HIDDEN)
        # An activation named the Flax way: a no-op without rules, (data·fsdp, tensor) under them.
        h = linen.with_logical_constraint(h, ("batch", "mlp"))
        return self.out(self.norm(e[:, -EMBED:] + self.down(h)))  # residual on the last byte's embedding


def batches(steps: int):
    """(x, y) numpy batches from the built-in corpus (bytes): x (BATCH, CONTEXT), y (BATCH,)."""
    tokens = np.frombuffer(builtin_text()[:100_000].encode("utf-8"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(SEED)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - CONTEXT - 1, BATCH)
        yield (np.stack([tokens[s:s + CONTEXT] for s in starts]), tokens[starts + CONTEXT])


@nnx.jit
def train_step(model, optimizer, x, y):
    """One AdamW step; returns the loss and the gradients (an nnx.State shaped like the params)."""

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, grads


def train(mesh_cfg: MeshConfig, steps: int, verbose: bool = False):
    """Build, shard and train on a mesh of `mesh_cfg`'s size. Returns (losses per step, the first
    step's gradients {path: ndarray}, {path: (PartitionSpec, per-device shard shape) of each trained
    parameter}).

    Gradients are compared at the first step only, where both runs hold the same weights; later
    steps start from weights that already differ by fp32 rounding, which AdamW amplifies (its
    update is ~sign(g) for tiny g), so later gradients measure the optimizer, not the sharding."""
    n = mesh_cfg.data * mesh_cfg.fsdp * mesh_cfg.tensor * mesh_cfg.pipe
    mesh = M.build_mesh(mesh_cfg, jax.devices()[:n])
    rules = S.model_rules(mesh_cfg)
    losses, grads = [], None
    with M.mesh_and_rules(mesh, rules):
        model = MLPLanguageModel(rngs=nnx.Rngs(SEED))
        # Place every parameter by its names under the rules (Flax's eager sharding may already have).
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
        batch = M.logical_sharding(mesh, ("batch", None), rules)  # rows over data·fsdp
        target = M.logical_sharding(mesh, ("batch",), rules)
        for step, (x, y) in enumerate(batches(steps)):
            loss, g = train_step(model, optimizer, jax.device_put(x, batch), jax.device_put(y, target))
            losses.append(float(loss))
            if grads is None:
                grads = {_name(p): np.asarray(v) for p, v in nnx.to_flat_state(g)}
            if verbose:
                print(f"  step {step}: loss {losses[-1]:.6f}")
    params = {_name(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    specs = {k: (x.sharding.spec, x.sharding.shard_shape(x.shape)) for k, x in params.items()}
    return losses, grads, specs


def _name(path) -> str:
    return ".".join(str(k) for k in path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save", help="write both runs' losses and gradients to this .npz")
    args = ap.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 matmuls: comparable to 1e-6

    sharded_cfg = MeshConfig(data=2, fsdp=2, tensor=2)
    print(f"flax rules: {S.to_flax_rules(S.model_rules(sharded_cfg))}")
    print("data=2 x fsdp=2 x tensor=2 on 8 devices:")
    losses, grads, specs = train(sharded_cfg, args.steps, verbose=True)
    print("one device:")
    losses1, grads1, _ = train(MeshConfig(), args.steps, verbose=True)

    print(f"\n{'parameter':<18}{'spec':<22}{'per-device shard'}")
    for name, (spec, shard) in specs.items():
        print(f"{name:<18}{str(tuple(spec)):<22}{shard}")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, losses1))
    grad_err = max(np.abs(grads[k] - grads1[k]).max() / np.abs(grads1[k]).max() for k in grads1)
    print(f"\nsharded vs one device: max rel. loss diff {loss_err:.2e} over {args.steps} steps, "
          f"max rel. gradient diff {grad_err:.2e} (first step, same weights)")
    if args.save:
        arrays = {"losses_sharded": np.array(losses), "losses_single": np.array(losses1),
                  **{f"sharded/{k}": v for k, v in grads.items()}, **{f"single/{k}": v for k, v in grads1.items()},
                  "specs": np.array([f"{k} {tuple(spec)} {shard}" for k, (spec, shard) in specs.items()])}
        np.savez(args.save, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
