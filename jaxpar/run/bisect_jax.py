"""jaxpar's side of `jaxpar bisect` (jaxpar.run.bisection): one step of a run on its mesh, with every
named intermediate of the forward read through `nnx.capture` and renamed after HF's module tree.

The model's taps (`jaxpar.models.gpt2._tap`) record only inside `nnx.capture`; the training step
never enters one, so its program is unchanged (tests/run/test_bisect_hlo.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxpar import optim
from jaxpar.config import Config
from jaxpar.models import gpt2
from jaxpar.models.precision import Policy, get_policy

# tap name -> HF leaf under the module that holds the tap ("": the module's own output)
LEAVES = {"y": "", "out": "", "c_attn_out": "c_attn", "attn_scores": "attn_scores", "attn_weights": "attn_weights",
          "heads_out": "c_proj:input", "c_proj_out": "c_proj", "resid_mid": "ln_2:input", "c_fc_out": "c_fc",
          "act_out": "act", "wte_out": "wte", "wpe_out": "wpe", "drop_out": "drop"}


@dataclasses.dataclass(frozen=True)
class EinsumCorePolicy(Policy):
    """The run's policy with the einsum attention core, whose scores and probs are arrays a tap can
    read (the CPU core computes them inside its custom VJP); its forward is the same ops."""

    @property
    def attention_core(self) -> bool:
        return False


def hf_name(prefix: str, path: tuple) -> str:
    """Capture path ("attn", "c_attn_out") under `prefix` ("transformer.h.0") -> HF name."""
    if path == ("logits",):
        return "lm_head"
    parts = [str(p) for p in path[:-1]] + [LEAVES[str(path[-1])]]
    return ".".join(p for p in [prefix, *parts] if p)


def _flat(prefix: str, state) -> dict:
    """nnx.State of Intermediates (each a 1-tuple: one call) -> {HF name: array}."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        out[hf_name(prefix, tuple(path))] = value[0] if isinstance(value, tuple) else value
    return out


def capture_forward(cfg: Config, mesh, rules):
    """(params, tokens (B, T)) -> {HF name: array}: embed, each block, head, every tap."""
    from jaxpar.parallel.logical import activation_rules

    base = get_policy(cfg.precision)
    policy = EinsumCorePolicy(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Policy)})
    mc = cfg.model

    def forward(params, tokens):
        with activation_rules(mesh, rules):
            model = gpt2.GPT2(mc, params, policy=policy)
            x, got = nnx.capture(model.embed, nnx.Intermediate)(tokens)
            acts = _flat("transformer", got)
            for i in range(mc.n_layer):  # one block at a time: taps inside lax.scan would be scan-local
                block = gpt2.Block(mc, policy, jax.tree.map(lambda a, i=i: a[i], params["h"]))
                x, got = nnx.capture(block, nnx.Intermediate)(x)
                acts.update(_flat(f"transformer.h.{i}", got))
            _, got = nnx.capture(model.head, nnx.Intermediate)(x)
            acts.update(_flat("transformer", got))
        return acts

    return forward


def _adam(opt_state):
    found = []
    optim._replace_states(opt_state, lambda s: found.append(s) or s, lambda s: s)
    return found[0]


def run_jaxpar(cfg: Config, params: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """One step of `cfg` on its mesh (the first mesh-size devices) from `params` on batch (x, y)."""
    from gpt2common import hf
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.mesh import mesh_size
    from jaxpar.train import build_trainer, make_loss_fn

    wild = -1 in dataclasses.astuple(cfg.mesh)  # a -1 axis takes every device
    n = jax.device_count() if wild else mesh_size(cfg.mesh)
    layout = build_layout(cfg, n)
    tr = build_trainer(layout, devices=jax.devices()[:n])
    loss_fn = make_loss_fn(layout, tr.mesh)
    forward = capture_forward(cfg, tr.mesh, layout.activation_rules)

    def acts_and_grads(p, xs, ys):
        return forward(p, xs), jax.grad(lambda q: loss_fn(q, xs, ys, None))(p)

    psh, bsh = tr.state_shardings["params"], tr.batch_sharding
    xs, ys = tr.put_batch(x), tr.put_batch(y)
    state = tr.init_state(params)  # the one placement on the mesh: the step's own
    acts, grads = jax.jit(acts_and_grads, in_shardings=(psh, bsh, bsh))(state["params"], xs, ys)
    state, metrics = tr.step_fn(state, xs, ys)  # donates the state: after the read above
    acts, grads, state, metrics = jax.device_get((acts, grads, state, metrics))  # gathers every shard
    B, T = x.shape
    for name, v in acts.items():  # jaxpar's head-split layouts -> HF's (B, T, D) ones
        if name.endswith((".attn.c_attn", ".attn.c_proj:input")):
            acts[name] = v.reshape(B, T, -1)
    acts = {k: np.asarray(v) for k, v in acts.items()}
    acts["loss"] = np.float32(metrics["loss"])
    adam = _adam(state["opt_state"])
    sd = lambda tree: hf.to_hf_state_dict(cfg.model, tree)  # noqa: E731
    before, after = sd(params), sd(state["params"])
    return {"acts": acts, "grads": sd(grads), "mu": sd(adam.mu), "nu": sd(adam.nu),
            "update": {k: after[k].astype(np.float64) - before[k] for k in before},
            "grad_norm": float(metrics["grad_norm"]), "params": before}
