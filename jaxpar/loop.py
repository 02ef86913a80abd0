"""`jaxpar train`: the training loop around `train.build_trainer`.

Order matters for "nothing lost or overwritten": every check that can fail on bad
input (run dir, model, mesh, data) happens before the first byte is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import jax
import numpy as np

from jaxpar import data as data_lib
from jaxpar.checkpoint import Checkpointer, restore
from jaxpar.config import Config, ConfigError, dumps, validate
from jaxpar.mesh import resolve_mesh_config
from jaxpar.metrics import METRICS_FILE, MetricsLogger, truncate_after
from jaxpar.models import gpt2, hf
from jaxpar.train import build_trainer, check_model_vs_mesh, device_peak_flops


class _StopFlag:
    """SIGTERM/SIGINT -> stop at the next step boundary (checkpoint, then exit 0)."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def prepare_config(cfg: Config) -> tuple[Config, dict | None]:
    """Resolve what depends on the machine and inputs: HF init weights, the mesh. No writes."""
    init_params = None
    if cfg.init:
        model_cfg, init_params = hf.load_hf(cfg.init)
        cfg = dataclasses.replace(cfg, model=model_cfg, model_name=f"hf:{cfg.init}")
    cfg = dataclasses.replace(cfg, mesh=resolve_mesh_config(cfg.mesh, jax.device_count()))
    validate(cfg)
    check_model_vs_mesh(cfg.model, cfg)
    return cfg, init_params


def check_out_dir(cfg: Config) -> int | None:
    """Returns the step to resume from (None for a fresh run)."""
    out = cfg.out
    if cfg.resume:
        if not os.path.isdir(out):
            raise ConfigError(f"resume=true but out={out!r} does not exist")
        step = Checkpointer(out, create=False).latest_step() if os.path.isdir(os.path.join(out, "ckpt")) else None
        if step is None:
            raise ConfigError(f"resume=true but out={out!r} holds no complete checkpoint")
        return step
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"out={out!r} is not empty; pass resume=true to continue it or choose another out")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"out={out!r} exists and is not a directory")
    return None


def evaluate(trainer, params, ds: data_lib.Dataset, cfg: Config) -> float:
    """Mean loss over `train.eval_batches` fixed validation batches."""
    tc = cfg.train
    total, count = 0.0, 0.0
    for i in range(tc.eval_batches):
        x, y = data_lib.val_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, i)
        s, n = trainer.eval_fn(params, trainer.put_batch(x), trainer.put_batch(y))
        total, count = total + float(s), count + float(n)
    return total / count


def run_train(cfg: Config) -> int:
    cfg, init_params = prepare_config(cfg)
    resume_step = check_out_dir(cfg)
    tc, is_main = cfg.train, jax.process_index() == 0
    # Raw text is tokenized into the run dir (process 0 writes; the others wait for it).
    if is_main:
        os.makedirs(cfg.out, exist_ok=True)
        data_path = data_lib.resolve_data(cfg.data, cfg.tokenizer, cfg.out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxpar:data")
    if not is_main:
        data_path = data_lib.resolve_data(cfg.data, cfg.tokenizer, cfg.out)
    ds = data_lib.Dataset.open(data_path, cfg.model.vocab_size, tc.seq_len)

    if is_main:
        print(f"jaxpar train: {cfg.model_name} ({cfg.model.num_params():,} params), mesh {dataclasses.asdict(cfg.mesh)}, "
              f"{jax.device_count()} devices / {jax.process_count()} processes, precision {cfg.precision}")
        print("config: " + json.dumps(dataclasses.asdict(cfg), separators=(",", ":")))
        with open(os.path.join(cfg.out, "config.json"), "w") as f:
            f.write(dumps(cfg))

    trainer = build_trainer(cfg)
    if resume_step is not None:  # the newest intact step, resharded onto this mesh; damaged ones skipped
        target = trainer.abstract_state()
        r = restore(cfg.out, target["params"], target["opt_state"], quarantine=True, key="out")
        state = {"step": jax.device_put(np.int32(r.step), trainer.state_shardings["step"]),
                 "params": r.params, "opt_state": r.opt_state}
        start = r.step
        if is_main:
            truncate_after(os.path.join(cfg.out, METRICS_FILE), start)
    else:
        params = init_params if init_params is not None else gpt2.init_params(cfg.model, cfg.seed)
        state, start = trainer.init_state(params), 0
    ckpt = Checkpointer(cfg.out)

    tokens_per_step = tc.batch_size * tc.seq_len
    flops_tok = cfg.model.flops_per_token(tc.seq_len)
    peak = device_peak_flops(cfg) * jax.device_count()
    logger = MetricsLogger(cfg.out, tc.steps, start, cfg.progress, enabled=is_main, print_every=tc.log_every)
    if resume_step is not None:
        logger.message(f"resumed from step {start} ({os.path.join(cfg.out, 'ckpt')})")

    def save(step):
        ckpt.save(step, state, {"step": step, "seed": cfg.seed})

    # Compile ahead of time so step 1's time and MFU exclude compilation. Multi-process runs
    # then line up: gloo gives a peer only 30 s to join a collective's first use, and compile
    # times differ per process.
    x, y = data_lib.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, start)
    step_fn = trainer.step_fn.lower(state, trainer.put_batch(x), trainer.put_batch(y)).compile()
    if jax.process_count() > 1:
        from jaxpar.mesh import barrier

        barrier("jaxpar:first-step")

    stopped = None
    with _StopFlag() as stop:
        for step in range(start, tc.steps):
            x, y = data_lib.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, step)
            t0 = time.perf_counter()
            state, m = step_fn(state, trainer.put_batch(x), trainer.put_batch(y))
            loss = float(m["loss"])  # blocks until the step is done
            dt = time.perf_counter() - t0
            rec = {"step": step + 1, "loss": loss, "grad_norm": float(m["grad_norm"]),
                   "lr": float(trainer.schedule(step)), "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                   "mfu": flops_tok * tokens_per_step / dt / peak}
            if tc.eval_every and (step + 1) % tc.eval_every == 0:
                rec["val_loss"] = evaluate(trainer, state["params"], ds, cfg)
            logger.log(rec)
            if not np.isfinite(loss):
                logger.close()
                raise FloatingPointError(f"loss is {loss} at step {step + 1}")
            done = step + 1
            if stop.signum is not None:
                stopped = stop.signum
                break
            if tc.ckpt_every and done % tc.ckpt_every == 0 and done < tc.steps:
                save(done)
        else:
            done = tc.steps
    if done > start or resume_step is None:
        save(done)
    ckpt.close()
    if stopped is not None:
        logger.message(f"stopped by {signal.Signals(stopped).name} after step {done}; checkpoint saved to "
                       f"{os.path.join(cfg.out, 'ckpt', str(done))}; continue with resume=true")
    else:
        logger.message(f"done: {done} steps, checkpoint {os.path.join(cfg.out, 'ckpt', str(done))}")
    logger.close()
    return 0
