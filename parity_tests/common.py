"""The shared starting point of every parity check, and the single-device model comparison.

Both frameworks start from one set of weights and see one set of batches:
  * weights: `jaxpar.models.gpt2.init_params(cfg, seed)` (numpy, fixed seed) written ONCE as an HF
    save_pretrained dir with jaxpar's exporter (`gpt2common.hf.save_hf`); jaxpar reads it back with
    its importer (`load_hf`), torchref with its loader (`torchref.model.build_model`/`load_weights`);
    the CLIs take it as `init=<dir>`.
  * batches: one prepared dir (train.bin/val.bin/meta.json, uint16 ids) and the global batch order
    `gpt2common.data.train_batch(ds, T, B, seed, step)`, which torchref's workers also call.

`model_parity` runs one fp32 forward/backward and k AdamW steps in both frameworks in this
process (one CPU device) and returns the diffs that `parity_tests.tolerances.MODEL` bounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import numpy as np

from jaxpar.config import PRESETS, ModelConfig, TrainConfig

TINY = PRESETS["gpt2-tiny"]
# A non-preset shape: odd head count (5, head_dim 12), vocab not a power of two (101), 3 layers.
ODD = ModelConfig(n_layer=3, n_embd=60, n_head=5, vocab_size=101, n_positions=64)

# The optimizer settings of the model-parity step: warmup 0 so step 1 moves the weights (with
# warmup > 0 the first lr is 0 in both frameworks, and step 1 would test nothing); a clip
# threshold below the init's gradient norm (~1-2 on these models) so clipping is active.
PARITY_TRAIN = TrainConfig(steps=10, batch_size=8, seq_len=32, lr=1e-3, warmup_steps=0, weight_decay=0.1,
                           beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=0.5)

# How each optax setting (jaxpar.train.make_optimizer) maps onto torch.optim (torchref.model).
# `test_model_parity.test_optimizer_mapping` checks every line against the two implementations.
OPTIMIZER_MAP = {
    "lr": "optax schedule(count) with count = updates so far  <->  param_group['lr'] = lr_at(step) before step()",
    "b1, b2": "adamw(b1, b2)  <->  AdamW(betas=(beta1, beta2))",
    "eps": "optax: m_hat / (sqrt(v_hat + eps_root=0) + eps)  <->  torch: m_hat / (sqrt(v_hat) + eps): outside sqrt",
    "bias correction": "optax scale_by_adam always corrects (1-b^t)  <->  torch AdamW always corrects",
    "weight decay": "optax: u += wd*p (mask: matmul weights); p -= lr*u  <->  torch: p *= 1 - lr*wd "
                    "(param group with weight_decay=wd for the same tensors, 0 for the rest)",
    "decay mask": "decay_mask: ['weight'] not ln_*, wte, wpe  <->  decays(): c_attn/c_proj/c_fc weights",
    "clipping": "clip_by_global_norm(c): g*c/norm iff norm >= c, no epsilon  <->  torchref clip_grads_ "
                "(NOT torch.nn.utils.clip_grad_norm_, which divides by norm + 1e-6)",
    "amsgrad / maximize / nesterov": "absent in optax.adamw  <->  False (torch defaults)",
}


# ----------------------------------------------------------------------------- shared inputs


def write_init(path: str, cfg: ModelConfig, seed: int = 0) -> str:
    """Numpy init (fixed seed) -> HF save_pretrained dir via jaxpar's exporter. Returns `path`."""
    from gpt2common import hf
    from jaxpar.models import gpt2

    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        hf.save_hf(path, cfg, gpt2.init_params(cfg, seed))
    return str(path)


def write_data(path: str, vocab_size: int = 256, n_tokens: int = 200_000, seed: int = 0) -> str:
    """A prepared dir. vocab 256: the built-in corpus, byte-tokenized (`gpt2common.data.prepare`).
    Any other vocab: uniform random ids from numpy (the byte corpus would exceed the vocab)."""
    from gpt2common import data

    if data.is_prepared(path):
        return str(path)
    if vocab_size == 256:
        data.prepare(data.builtin_text(), path, "byte", source="tinyshakespeare")
        return str(path)
    os.makedirs(path, exist_ok=True)
    ids = np.random.default_rng(seed).integers(0, vocab_size, n_tokens).astype("<u2")
    n_val = n_tokens // 10
    ids[:-n_val].tofile(os.path.join(path, "train.bin"))
    ids[-n_val:].tofile(os.path.join(path, "val.bin"))
    meta = {"tokenizer": "random", "vocab_size": vocab_size, "train_tokens": n_tokens - n_val, "val_tokens": n_val,
            "source": f"numpy default_rng({seed}).integers(0, {vocab_size})"}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    return str(path)


def batches(data_dir: str, cfg: ModelConfig, tc: TrainConfig, seed: int, steps: int):
    """The global batches of steps 0..steps-1, [(inputs, targets)] int32 (B, T)."""
    from gpt2common import data

    ds = data.Dataset.open(data_dir, cfg.vocab_size, tc.seq_len)
    return [data.train_batch(ds, tc.seq_len, tc.batch_size, seed, s) for s in range(steps)]


def load_torch(init_dir: str):
    """torchref's loader: GPT2LMHeadModel from the HF dir's config.json + safetensors (tied lm_head)."""
    from safetensors.numpy import load_file

    from torchref.model import build_model

    with open(os.path.join(init_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    return build_model(hf_cfg, load_file(os.path.join(init_dir, "model.safetensors")))


# ----------------------------------------------------------------------------- metrics


def rel_inf(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||_2 / ||b||_2."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def trajectory_diffs(run, ref, tol: dict) -> dict:
    """A run's per-step (loss, logged grad norm) pairs against the reference's, [(loss, grad_norm)]
    each -> the relative diffs per step, (steps, 2); the worst of each column; the verdict under
    `tol` (TRAJECTORY[precision]: loss_rel, and grad_rel or, bf16, grad_l2_rel for the norms).
    A nan step fails: numpy's max propagates it, where Python's max() keeps an earlier value
    against a later nan (nan > x is False), so a run that diverged after step 1 would pass."""
    a, b = np.asarray(run, np.float64), np.asarray(ref, np.float64)
    assert a.shape == b.shape and a.ndim == 2 and a.shape[1] == 2, (a.shape, b.shape)
    d = np.abs(a - b) / np.abs(b)
    worst_loss, worst_gn = (float(v) for v in np.max(d, axis=0))
    gbound = tol.get("grad_rel", tol.get("grad_l2_rel"))
    return {"diffs": d, "max_loss_rel": worst_loss, "max_grad_norm_rel": worst_gn, "grad_bound": gbound,
            "pass": worst_loss <= tol["loss_rel"] and worst_gn <= gbound}


def worst(d: dict[str, float]) -> tuple[str, float]:
    k = max(d, key=d.get)
    return k, d[k]


# ----------------------------------------------------------------------------- model parity


@dataclass
class ModelParity:
    """Diffs of one single-device fp32 comparison (bounds: tolerances.MODEL)."""

    model: dict
    logits_abs: float
    loss_rel: float
    loss_jax: float
    loss_torch: float
    grad_rel: dict[str, float]  # per HF parameter name
    grad_norm: float  # pre-clip global norm of step 1 (torch): > grad_clip shows clipping was active
    update_rel: dict[int, dict[str, float]] = field(default_factory=dict)  # k -> per name
    n_params: int = 0


def jax_side(init_dir: str, batch):
    """jaxpar: load_hf -> fp32 logits, loss and grads of one batch. HF-named numpy outputs."""
    import jax
    import jax.numpy as jnp

    from gpt2common import hf
    from jaxpar.models import gpt2

    cfg, params = hf.load_hf(init_dir)

    @jax.jit
    def f(p, x, y):
        def loss(q):
            logits = gpt2.GPT2(cfg, q, policy="fp32")(x)
            return gpt2.cross_entropy(logits, y), logits

        (loss_val, logits), g = jax.value_and_grad(loss, has_aux=True)(p)
        return loss_val, logits, g

    loss, logits, grads = f(params, jnp.asarray(batch[0]), jnp.asarray(batch[1]))
    return np.asarray(logits), float(loss), hf.to_hf_state_dict(cfg, jax.device_get(grads))


def jax_optimizer_steps(init_dir: str, tc: TrainConfig, hf_grads: list[dict]) -> dict[int, dict]:
    """jaxpar's optax chain (make_optimizer) fed the given HF-named gradients, one per step, from the
    init weights. Returns {k: HF-named params after k steps}."""
    import jax

    from gpt2common import hf
    from jaxpar.train import make_optimizer

    cfg, params = hf.load_hf(init_dir)
    tx = make_optimizer(tc)
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return jax.tree.map(lambda a, b: a + b, p, u), s

    after = {}
    for k, g in enumerate(hf_grads, start=1):
        params, state = step(params, state, hf.from_hf_state_dict(cfg, g))
        after[k] = hf.to_hf_state_dict(cfg, jax.device_get(params))
    return after


def torch_side(init_dir: str, tc: TrainConfig, steps_batches):
    """torchref: build_model -> logits of batch 0; then per step: loss, pre-clip grads, and torchref's
    clip_grads_ + AdamW + lr_at. Returns (logits, losses, grads, params after k, grad norms)."""
    import torch

    from torchref.model import clip_grads_, hf_state_dict, loss_fn, lr_at, make_optimizer, set_lr

    torch.manual_seed(0)
    model = load_torch(init_dir)
    named = list(model.named_parameters())
    x0 = torch.from_numpy(steps_batches[0][0].astype(np.int64))
    logits = model(input_ids=x0).logits.detach().numpy()
    opt = make_optimizer(named, tc)
    after, losses, grads, norms = {}, [], [], []
    for k, (x, y) in enumerate(steps_batches, start=1):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64)))
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.detach().numpy().copy() for n, p in named})  # pre-clip
        norms.append(clip_grads_([p for _, p in named], tc.grad_clip))
        set_lr(opt, lr_at(tc, k - 1))
        opt.step()
        after[k] = hf_state_dict(model)
    return logits, losses, grads, after, norms


def model_parity(init_dir: str, data_dir: str, tc: TrainConfig = PARITY_TRAIN, seed: int = 0,
                 steps: tuple[int, ...] = (1, 3)) -> ModelParity:
    """fp32, one device, both frameworks from `init_dir` on the batches of steps 0..max(steps)-1.

    Forward/backward: each framework on its own (logits, loss, grads of batch 0). Optimizer: both
    optimizers are fed the SAME gradients (torch's, step by step), so the comparison isolates the
    optax <-> torch.optim mapping. With each framework's own gradients, Adam's step-1 update
    lr*g/(|g|+eps) turns rounding-level gradient entries into ±lr steps of random sign: the key
    part of c_attn.bias has an analytically zero gradient (softmax is shift-invariant per query),
    both frameworks return ~1e-11 noise there, and the two "updates" disagree by 100%. That is
    Adam, not a mapping error; the end-to-end effect is bounded by the trajectory tests.
    """
    from gpt2common import hf

    cfg = hf.model_config_from_hf(init_dir)
    bs = batches(data_dir, cfg, tc, seed, max(steps))
    lj, loss_j, gj = jax_side(init_dir, bs[0])
    lt, losses_t, grads_t, after_t, norms = torch_side(init_dir, tc, bs)
    after_j = jax_optimizer_steps(init_dir, tc, grads_t)
    gt, loss_t = grads_t[0], losses_t[0]
    init = hf.to_hf_state_dict(*hf.load_hf(init_dir))
    assert set(gj) == set(gt) == set(init), (sorted(set(gj) ^ set(gt)), sorted(set(gt) ^ set(init)))
    upd = {k: {n: rel_l2(after_j[k][n] - init[n], after_t[k][n] - init[n]) for n in init} for k in steps}
    return ModelParity(model=dataclasses.asdict(cfg), logits_abs=float(np.max(np.abs(lj - lt))),
                       loss_rel=abs(loss_j - loss_t) / abs(loss_t), loss_jax=loss_j, loss_torch=loss_t,
                       grad_rel={n: rel_inf(gj[n], gt[n]) for n in gt}, grad_norm=norms[0], update_rel=upd,
                       n_params=len(gt))
