"""torchref's side of the shared training-state format (`gpt2common.state`): `init_state=<dir>`
continues a state written by `jaxpar convert to_state=` (or by torchref itself), and
`state_every=N` writes `<out>/state/<step>/` every N steps and after the last one, which
`jaxpar train init_state=` continues.

The mapping onto torch.optim.AdamW (`torchref.model.make_optimizer`, foreach=False): per parameter,
state = {"step": float32 scalar tensor = the AdamW count, "exp_avg": first moment, "exp_avg_sq":
second moment}, the optax `mu` / `nu` under the parameter's HF name. The learning rate is not
state: `lr_at(t, step)` of the loop's step, which is why the AdamW and schedule counts must both
equal the step (a jaxpar state with skipped non-finite steps cannot continue here).
"""

from __future__ import annotations

import os

import numpy as np

from gpt2common import state as fmt
from gpt2common.grammar import ConfigError

KEY = "init_state"
STATE_DIR = "state"


def check(cfg, ref) -> dict | None:
    """The manifest of `init_state=`, checked against the run's settings (launcher, before any write)."""
    if not cfg.init_state:
        return None
    if cfg.init:
        raise ConfigError(f"init={cfg.init!r} cannot be combined with init_state= (the state holds the weights)")
    if ref.strategy == "single-ps":
        raise ConfigError("init_state= needs an all-reduce strategy (single, distributed-ps, horovod and their "
                          "-amp variants); strategy=single-ps keeps its optimizer on the server")
    m = fmt.read_manifest(cfg.init_state, KEY)
    fmt.check_compatible(m, cfg.init_state, KEY, cfg.model, cfg.train, cfg.seed)
    opt = m["optimizer"]
    if not opt.get("adam_count") == opt.get("schedule_count") == m["step"]:
        raise ConfigError(f"{KEY}={cfg.init_state!r} has AdamW count {opt.get('adam_count')} and schedule count "
                          f"{opt.get('schedule_count')} at step {m['step']} (skipped non-finite steps); torchref "
                          "continues only states whose counts equal the step")
    fmt.load_state(cfg.init_state, KEY, m)  # checked whole (finite, fp32, no extra tensors) before any write
    return m


def weights(path: str, m: dict) -> dict[str, np.ndarray]:
    """The state's HF-named fp32 weights (checksums checked): the run's `<out>/init/` weights."""
    params = fmt.load_state(path, KEY, m).params
    fmt.forget_loaded()  # the ranks read the moments themselves
    return params


def load_optimizer(opt, named, path: str) -> int:
    """Fill `opt` (AdamW over `named` = [(HF name, parameter)]) with the state's moments and
    count; returns the step to continue from."""
    import torch

    st = fmt.load_state(path, KEY)
    count = torch.tensor(float(st.manifest["optimizer"]["adam_count"]), dtype=torch.float32)
    for name, p in named:
        if name not in st.exp_avg:
            raise ConfigError(f"{KEY}={path!r} has no moments for {name!r}")
        opt.state[p] = {"step": count.clone(),
                        "exp_avg": torch.from_numpy(st.exp_avg[name].copy()).to(p.device),
                        "exp_avg_sq": torch.from_numpy(st.exp_avg_sq[name].copy()).to(p.device)}
    return st.step


def due(state_every: int, step: int, last: int) -> bool:
    """Whether the state after 1-based step `step` is written (every N steps and after the last)."""
    return state_every > 0 and (step % state_every == 0 or step == last)


def save(ctx, model, opt, named, step: int) -> str:
    """Write the state after 1-based step `step` to `<out>/state/<step>/` (worker 0 only)."""
    from torchref.model import hf_state_dict, lr_at

    path = os.path.join(ctx.job.out, STATE_DIR, str(step))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    mu, nu = {}, {}
    for name, p in named:
        s = opt.state[p]
        mu[name] = s["exp_avg"].detach().float().cpu().numpy().copy()
        nu[name] = s["exp_avg_sq"].detach().float().cpu().numpy().copy()
    count = int(opt.state[named[0][1]]["step"])
    data = {"train_tokens": int(len(ctx.ds.train)), "vocab_size": ctx.ds.vocab_size}
    m = fmt.manifest_dict(written_by="torchref", model=ctx.cfg.model, train=ctx.t, seed=ctx.cfg.seed, step=step,
                          adam_count=count, schedule_count=step, lr_next=lr_at(ctx.t, step), data=data)
    fmt.write_state(path, m, hf_state_dict(model), mu, nu, ctx.hf_config())
    return path
