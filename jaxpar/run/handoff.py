"""A jaxpar run's training state in the shared format (`gpt2common.state`), both ways:
`jaxpar convert checkpoint=<run> to_state=<dir> [step=K]` writes it, `jaxpar train init_state=<dir>`
continues from it (as `torchref train init_state=` does, and torchref's `state_every=` writes it).

Export gathers to the host: the checkpoint is restored onto one device whatever mesh wrote it
(orbax reassembles the shards), then converted from jaxpar's stacked layout to HF names. Import
converts back on the host and places params and moments with the trainer's shardings, so a state
continues on any mesh (data / fsdp / tensor / pipe).
"""

from __future__ import annotations

import os

import numpy as np

from gpt2common import data as data_lib
from gpt2common import hf
from gpt2common import state as fmt
from jaxpar.config import Config, ConfigError

KEY = "init_state"


def _data_meta(cfg: Config, run_dir: str) -> dict:
    """What identifies the run's token stream: train.bin's length (when its prepared dir is found)."""
    for d in (cfg.data, os.path.join(run_dir, "data")):
        if d and data_lib.is_prepared(d):
            meta = data_lib.read_meta(d)
            return {"train_tokens": meta.get("train_tokens"), "vocab_size": meta.get("vocab_size"),
                    "tokenizer": meta.get("tokenizer")}
    return {}


def export_state(checkpoint: str, to_state: str, cfg: Config, step: int | None) -> dict:
    """Write step `step` (default: the newest) of run `checkpoint` (its config `cfg`) as a state
    dir `to_state` (checked by `gpt2common.state.check_target`). Returns the manifest."""
    import jax

    from jaxpar import optim
    from jaxpar.models import gpt2
    from jaxpar.run.checkpoint import restore
    from jaxpar.train import lr_schedule, make_optimizer

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_one = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), t)  # noqa: E731
    abstract = gpt2.abstract_params(cfg.model)
    tx = make_optimizer(cfg.train)
    r = restore(checkpoint, on_one(abstract), on_one(jax.eval_shape(tx.init, abstract)), step=step)
    if r.opt_state is None:
        raise ConfigError(f"checkpoint={checkpoint!r} step {r.step} holds no optimizer state (an imported HF model)")
    adam, sched = optim.adam_states(r.opt_state)
    host = jax.device_get({"params": r.params, "mu": adam.mu, "nu": adam.nu})
    mc = cfg.model
    m = fmt.manifest_dict(written_by="jaxpar", model=mc, train=cfg.train, seed=cfg.seed, step=r.step,
                          adam_count=int(adam.count), schedule_count=int(sched.count),
                          lr_next=float(lr_schedule(cfg.train)(int(sched.count))), data=_data_meta(cfg, checkpoint))
    m["nonfinite_skipped"] = int(r.meta.get("nonfinite_skipped", 0))
    fmt.write_state(to_state, m, hf.to_hf_state_dict(mc, host["params"]), hf.to_hf_state_dict(mc, host["mu"]),
                    hf.to_hf_state_dict(mc, host["nu"]), hf.hf_config_dict(mc), key="to_state")
    return m


def check_init_state(cfg: Config) -> dict | None:
    """The manifest of `init_state=`, checked against the run's settings before any write."""
    if not cfg.init_state:
        return None
    if cfg.init:
        raise ConfigError(f"init={cfg.init!r} cannot be combined with init_state= (the state holds the weights)")
    m = fmt.read_manifest(cfg.init_state, KEY)
    fmt.check_compatible(m, cfg.init_state, KEY, cfg.model, cfg.train, cfg.seed)
    fmt.load_state(cfg.init_state, KEY, m)  # checked whole (finite, fp32, no extra tensors) before any write
    return m


def initial_state(cfg: Config, trainer, manifest: dict, ds: data_lib.Dataset) -> tuple[dict, int, int]:
    """(state placed with the trainer's shardings, start step, non-finite steps skipped so far)."""
    import jax

    from jaxpar import optim

    fmt.check_data(manifest, cfg.init_state, KEY, len(ds.train))
    st = fmt.load_state(cfg.init_state, KEY, manifest)
    mc = cfg.model
    try:
        params, mu, nu = (hf.from_hf_state_dict(mc, sd) for sd in (st.params, st.exp_avg, st.exp_avg_sq))
    except ConfigError as e:
        raise ConfigError(f"{KEY}={cfg.init_state!r}: {e}") from None
    opt = manifest["optimizer"]
    target = trainer.abstract_state()
    # The abstract tree supplies the structure (optax's nested NamedTuples); the leaves become host
    # arrays (params: stacked (L, ...) float32; counts: int32 scalars) placed per leaf sharding.
    host_opt = optim.with_adam_states(target["opt_state"], np.int32(opt["adam_count"]), mu, nu,
                                      np.int32(opt["schedule_count"]))
    sh = trainer.state_shardings
    state = {"step": jax.device_put(np.int32(st.step), sh["step"]),
             "params": jax.device_put(params, sh["params"]),
             "opt_state": jax.device_put(host_opt, sh["opt_state"])}
    fmt.forget_loaded()
    return state, st.step, int(manifest.get("nonfinite_skipped", 0))
