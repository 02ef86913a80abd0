"""One training step of HF `GPT2LMHeadModel` with every named intermediate read by forward hooks,
for `jaxpar bisect` (jaxpar.run.bisection). No jaxpar import: the step is torchref's (its loss, its
optax mirror `clip_grads_` + AdamW + `lr_at`), the names are HF's module tree.

Each tap is (module path, what, name): "out" the module's output (the first element of a tuple),
"out1" the second element (GPT2Attention returns (output, probs) under eager attention), "in" its
first input. Names are the module path, with `:input` for inputs and `attn.attn_weights` for the
probs, so jaxpar's `nnx.capture` taps line up with them by name.
"""

from __future__ import annotations

import numpy as np
import torch

from torchref.model import clip_grads_, loss_fn, lr_at, make_optimizer, set_lr


def taps(n_layer: int) -> list[tuple[str, str, str]]:
    """(module path, what, name) of every hooked intermediate, in model order."""
    out = [("transformer.wte", "out", "transformer.wte"), ("transformer.wpe", "out", "transformer.wpe"),
           ("transformer.drop", "out", "transformer.drop")]
    for i in range(n_layer):
        p = f"transformer.h.{i}"
        out += [(f"{p}.ln_1", "out", f"{p}.ln_1"), (f"{p}.attn.c_attn", "out", f"{p}.attn.c_attn"),
                (f"{p}.attn", "out1", f"{p}.attn.attn_weights"), (f"{p}.attn.c_proj", "in", f"{p}.attn.c_proj:input"),
                (f"{p}.attn.c_proj", "out", f"{p}.attn.c_proj"), (f"{p}.ln_2", "in", f"{p}.ln_2:input"),
                (f"{p}.ln_2", "out", f"{p}.ln_2"), (f"{p}.mlp.c_fc", "out", f"{p}.mlp.c_fc"),
                (f"{p}.mlp.act", "out", f"{p}.mlp.act"), (f"{p}.mlp.c_proj", "out", f"{p}.mlp.c_proj"),
                (p, "out", p)]
    return out + [("transformer.ln_f", "out", "transformer.ln_f"), ("lm_head", "out", "lm_head")]


def _hook(store: dict, what: str, name: str):
    def hook(_module, inputs, output):
        v = inputs[0] if what == "in" else output
        if isinstance(v, tuple):
            v = v[1] if what == "out1" else v[0]
        store[name] = v.detach().float().numpy().copy()
    return hook


def train_step(model: torch.nn.Module, n_layer: int, tokens: np.ndarray, targets: np.ndarray, train) -> dict:
    """One step of `model` (weights loaded, train mode) on (B, T) int tokens/targets with torchref's
    optimizer for `train` (torchref.run_config.TrainSettings). Returns {"acts": {name: array} in
    model order + "loss", "grads", "mu", "nu", "update": {HF param name: array}, "grad_norm"}."""
    model.set_attn_implementation("eager")  # the probs are a module output only in eager attention
    acts: dict[str, np.ndarray] = {}
    modules = dict(model.named_modules())
    handles = [modules[path].register_forward_hook(_hook(acts, what, name)) for path, what, name in taps(n_layer)]
    named = list(model.named_parameters())
    before = {n: p.detach().numpy().copy() for n, p in named}
    opt = make_optimizer(named, train)
    try:
        loss = loss_fn(model, torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)))
    finally:
        for h in handles:
            h.remove()
    loss.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in named}
    norm = clip_grads_([p for _, p in named], train.grad_clip)
    set_lr(opt, lr_at(train, 0))
    opt.step()
    mu = {n: opt.state[p]["exp_avg"].numpy().copy() for n, p in named}
    nu = {n: opt.state[p]["exp_avg_sq"].numpy().copy() for n, p in named}
    update = {n: p.detach().numpy().astype(np.float64) - before[n] for n, p in named}
    acts["loss"] = np.float32(loss.detach())
    return {"acts": acts, "grads": grads, "mu": mu, "nu": nu, "update": update, "grad_norm": norm,
            "params": before}
