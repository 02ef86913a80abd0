"""HF GPT2LMHeadModel built from the shared GPT-2 config and weights (`gpt2common`), plus the optimizer
that mirrors jaxpar's optax chain exactly.

jaxpar's update is `optax.chain(clip_by_global_norm(c), adamw(schedule, b1, b2, eps, wd, mask))`.
The torch mirror:
  * AdamW with two param groups: weight decay only on the 2-D matmul weights
    (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj); none on biases, LayerNorms, wte, wpe.
    torch's decoupled decay `p *= 1 - lr*wd` equals optax's `update += wd*p; p -= lr*update`.
  * `clip_grads_`: scale = max_norm / norm when norm >= max_norm, with NO epsilon
    (torch.nn.utils.clip_grad_norm_ divides by norm + 1e-6, optax does not).
  * `lr_at(step)`: the learning-rate schedule (definition in its docstring), written here from
    the definition, not by calling jaxpar's optax schedule, and evaluated at the update count
    *before* the update (step 0 -> lr(0) = 0 when warmup > 0).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from torchref.run_config import RunConfig, TrainSettings

DECAY_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def build_model(hf_config: dict, state_dict: dict[str, np.ndarray] | None = None) -> torch.nn.Module:
    """GPT2LMHeadModel from an HF config dict (`gpt2common.hf.hf_config_dict`, or the config.json
    of the run's init dir) with the given HF-named float32 weights (lm_head tied to wte).

    Workers read the dict from <out>/init/config.json rather than building it from a ModelConfig:
    every import second counts when mpiexec starts N ranks on a small CPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**hf_config))
    if state_dict is not None:
        load_weights(model, state_dict)
    model.train()  # dropout is 0 by default, so train mode is still deterministic
    return model


def load_weights(model: torch.nn.Module, state_dict: dict[str, np.ndarray]) -> None:
    sd = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight" and not m.endswith(".attn.bias")]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()


def initial_state_dict(cfg: RunConfig) -> dict[str, np.ndarray]:
    """The exact weights `jaxpar train` starts from: `init=<HF dir>` or the shared numpy init(seed)."""
    from gpt2common.hf import load_hf, to_hf_state_dict
    from gpt2common.init import init_params

    if cfg.init:
        mcfg, params = load_hf(cfg.init, "init")
        return to_hf_state_dict(mcfg, params)
    return to_hf_state_dict(cfg.model, init_params(cfg.model, cfg.seed))


def hf_state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Model weights under HF names as float32 numpy, tied lm_head dropped (save_pretrained's layout)."""
    return {n: p.detach().float().cpu().numpy().copy() for n, p in model.named_parameters()}


def save_weights(path: str, hf_config: dict, sd: dict[str, np.ndarray]) -> None:
    """config.json + model.safetensors (the layout `gpt2common.hf.load_hf` and HF from_pretrained read)."""
    import json

    from safetensors.numpy import save

    from gpt2common.writes import write_atomic

    os.makedirs(path, exist_ok=True)
    # Serialised here, written by write_atomic: a refused write names its file (safetensors' own
    # save_file reports "I/O error" without one) and leaves no half-written file.
    write_atomic(os.path.join(path, "model.safetensors"),
                 save({k: np.ascontiguousarray(v) for k, v in sd.items()}, metadata={"format": "pt"}))
    write_atomic(os.path.join(path, "config.json"), json.dumps(hf_config, indent=2))


def decays(name: str) -> bool:
    return name.endswith(DECAY_SUFFIXES)


def make_optimizer(named_params: list[tuple[str, torch.nn.Parameter]], t: TrainSettings) -> torch.optim.AdamW:
    decay = [p for n, p in named_params if decays(n)]
    no_decay = [p for n, p in named_params if not decays(n)]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the plain per-tensor loop, the easiest path to read against optax.
    return torch.optim.AdamW(groups, lr=0.0, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)


def lr_at(t: TrainSettings, step):
    """Learning rate of 0-based step `step` (the update count before the update); `step` may be
    an int (-> float) or an integer numpy array (-> float64 array). The project's one schedule:

        W = min(train.warmup_steps, train.steps)       warmup never outlasts the run
        D = max(train.steps - W, 1)                    cosine length
        lr(s) = lr * (s + 1) / (W + 1)                        for s < W (nanoGPT's, torchtitan's +1s)
        lr(s) = lr * (r + (1 - r) * (1 + cos(pi * min(s - W, D) / D)) / 2)   otherwise, r = min_lr_ratio

    So the first update already moves the weights (lr(0) = lr / (W + 1)), a run shorter than its
    warmup warms up over the whole run, and a run with W = 0 starts at the peak. jaxpar's `lr_schedule` builds the same function from optax
    parts; `parity_tests/test_schedule.py` compares the two value by value."""
    s = np.asarray(step, dtype=np.float64)
    warm = min(t.warmup_steps, t.steps)
    span = max(t.steps - warm, 1)
    frac = np.minimum(s - warm, span) / span
    cosine = t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.5 * (1.0 + np.cos(np.pi * frac)))
    lr = np.where(s < warm, t.lr * (s + 1) / (warm + 1), cosine)
    return float(lr) if lr.ndim == 0 else lr


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


@torch.no_grad()
def clip_grads_(params, max_norm: float) -> float:
    """optax.clip_by_global_norm: g -> g / norm * max_norm when norm >= max_norm; no epsilon.
    Returns the global norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
    if max_norm > 0 and norm >= max_norm:
        for g in grads:
            g.div_(norm).mul_(max_norm)
    return float(norm)


def loss_fn(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 (logits are upcast even under autocast).
    inputs, targets: (B, T) int64 -> scalar."""
    logits = model(input_ids=inputs).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
