"""`jaxpar train`: the training loop around `train.build_trainer`.

Order matters for "nothing lost or overwritten": every check that can fail on bad
input (run dir, model, mesh, data) happens before the first byte is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpt2common import data as data_lib
from gpt2common import hf
from gpt2common.outdir import hold
from gpt2common.writes import WriteFailed, memory_line, remedy, write_atomic
from jaxpar.config import Config, ConfigError, dumps, settings_of, validate
from jaxpar.models import gpt2
from jaxpar.parallel.layout import ParallelLayout
from jaxpar.run import handoff, rundir
from jaxpar.run.checkpoint import Checkpointer, restore
from jaxpar.run.ckpt_clock import CheckpointClock
from jaxpar.run.evaluation import mean_loss
from jaxpar.run.launch import LOST_PEER_EXIT
from jaxpar.run.metrics import METRICS_FILE, WANDB_ID_FILE, MetricsLogger, start_wandb, truncate_after
from jaxpar.train import build_trainer, device_peak_flops, resolve_layout


class _StopFlag:
    """SIGTERM/SIGINT -> stop at the next step boundary (checkpoint, then exit 0)."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        # a SIGINT the CLI's handler noted whose KeyboardInterrupt was lost (jaxpar.cli._Interrupt)
        self.signum = next(iter(getattr(self._old[signal.SIGINT], "received", [])), None)
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def shaped_by_init(cfg: Config, model_cfg) -> Config:
    """cfg with the model of its `init=` weights. The shape comes from the weights; dropout is a
    training choice (nanoGPT's from_pretrained override): model.dropout (default 0), never the HF
    config's resid_pdrop (0.1 in OpenAI's GPT-2). model.attention (which core computes attention,
    not in an HF config) is the run's choice too. The model section's checks run once more."""
    model_cfg = dataclasses.replace(model_cfg, dropout=cfg.model.dropout, attention=cfg.model.attention)
    return validate(dataclasses.replace(cfg, model=model_cfg, model_name=f"hf:{cfg.init}"))


def prepare_config(cfg: Config) -> tuple[Config, ParallelLayout, dict | None]:
    """Resolve what depends on the machine and inputs: HF init weights, the layout. No writes."""
    init_params = None
    if cfg.init:
        model_cfg, init_params = hf.load_hf(cfg.init, "init")
        cfg = shaped_by_init(cfg, model_cfg)
    handoff.check_init_state(cfg)  # a state that cannot continue this run is refused before any write
    layout = resolve_layout(cfg, jax.device_count())  # every parallel decision, validated once
    for w in layout.warnings:
        print(w, file=sys.stderr)
    return layout.cfg, layout, init_params


def _latest_step(out: str) -> int | None:
    ck = Checkpointer(out, create=False)
    try:
        return ck.latest_step()
    finally:
        ck.close()


def evaluate(trainer, params, ds: data_lib.Dataset, cfg: Config) -> float:
    """Mean loss over `train.eval_batches` fixed validation batches (jaxpar.run.evaluation, as `jaxpar eval`)."""
    tc = cfg.train
    batches = (data_lib.val_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, i) for i in range(tc.eval_batches))
    total, n = mean_loss(trainer.eval_fn, trainer.put_batch, params, batches, tc.batch_size)
    return total / n


def _fault_injection() -> tuple[int, int] | None:
    """`JAXPAR_FAULT_SIGNAL=<SIGNAL>@<step>[@<rank>]`: this process sends itself the signal once
    step <step>'s metrics are written, or with step 0 once the step is compiled, before the first
    step (tests: a kill -9 or SIGTERM at an exact step, race-free)."""
    spec = os.environ.get("JAXPAR_FAULT_SIGNAL")
    if not spec:
        return None
    parts = spec.split("@")
    try:
        sig = getattr(signal, parts[0], None) if parts[0].startswith("SIG") else None
        if len(parts) not in (2, 3) or not isinstance(sig, signal.Signals):
            raise ValueError
        step, rank = int(parts[1]), int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ConfigError(f"JAXPAR_FAULT_SIGNAL={spec!r} must be <SIGNAL>@<step>[@<rank>], e.g. SIGTERM@5") from None
    if rank is not None and rank != jax.process_index():
        return None
    return step, int(sig)


def _prepare_data(cfg: Config, is_main: bool) -> data_lib.Dataset:
    """Raw text is tokenized into the run dir after its checks pass (process 0 writes; the
    others wait for it); a prepared dir is used in place. Token ids are checked against the vocab."""
    tc = cfg.train
    failed = None
    if is_main:
        try:
            path = data_lib.resolve_data(cfg.data, cfg.tokenizer, cfg.out, tc.seq_len, cfg.model.vocab_size)
        except ConfigError as e:
            failed = e
    # The others wait for process 0 and learn whether it failed: it prints the reason, they leave
    # quietly (exit 2) rather than wait on a peer that is gone until a timeout's traceback.
    if jax.process_count() > 1 and _agree(int(failed is not None)) and not is_main:
        raise SystemExit(2)
    if failed is not None:
        raise failed
    if not is_main:
        path = data_lib.resolve_data(cfg.data, cfg.tokenizer, cfg.out, tc.seq_len, cfg.model.vocab_size)
    return data_lib.Dataset.open(path, cfg.model.vocab_size, tc.seq_len)


class _LrTable:
    """lrs[i]: the learning rate of 0-based update i, computed LR_CHUNK steps at a time (one
    compile): a table of every step would take 4 bytes per step (400 TB for 1e14 steps)."""

    LR_CHUNK = 4096

    def __init__(self, schedule):
        self._fn = jax.jit(jax.vmap(schedule))
        self._start, self._chunk = -1, None

    def __getitem__(self, i: int) -> float:
        start = i - i % self.LR_CHUNK
        if start != self._start:
            self._chunk = np.asarray(self._fn(jnp.arange(start, start + self.LR_CHUNK)))
            self._start = start
        return float(self._chunk[i - start])


class NonFinite(Exception):
    """A step's loss or gradient norm was not finite (its update was not applied)."""


def nonfinite_message(n: int, loss: float, gnorm: float, out: str) -> str:
    """The error line of a run stopped at non-finite step `n`, naming the newest checkpoint step
    dir in `out` (the one `resume=true` would continue from)."""
    last = rundir.checkpoint_steps(out)  # ascending
    return (f"step {n}: non-finite loss or gradient norm (loss={loss}, grad_norm={gnorm}); the update was not "
            f"applied and the run stopped (last checkpoint: {'step ' + str(last[-1]) if last else 'none'}); "
            f"lower train.lr, or pass train.skip_nonfinite=true to skip such batches")


def run_train(cfg: Config) -> int:
    cfg, layout, init_params = prepare_config(cfg)
    _fault_injection()  # a malformed spec is refused before the run's first write
    resume_step, restart = rundir.check_out_dir(cfg, _latest_step)  # writes nothing
    is_main = jax.process_index() == 0
    # Signals from here on stop the run at a step boundary: one before the first step is
    # carried by step 1, so all processes agree and a checkpoint is written.
    with _StopFlag() as stop, _holding_out(cfg.out, is_main):
        if is_main:  # again under the lock: another run may have started meanwhile
            resume_step, restart = rundir.check_out_dir(cfg, _latest_step)
        ds = _prepare_data(cfg, is_main)
        trainer = build_trainer(layout)
        state, start, skipped, origin = _initial_state(cfg, trainer, init_params, resume_step, ds)
        # after the restore, which may have moved damaged steps aside
        ckpt = Checkpointer(cfg.out, max_to_keep=cfg.train.keep_checkpoints)
        try:
            return _train(cfg, trainer, ckpt, ds, (state, start, skipped, origin), resume_step, restart, stop, is_main)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            if jax.process_count() == 1 or not _peer_lost(e):
                raise
            _lost_peer(e)
        finally:
            ckpt.close()


def _agree(value: int) -> int:
    """Process 0's `value` on every process (a checkpoint step all of them save at)."""
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


@contextlib.contextmanager
def _holding_out(out: str, is_main: bool):
    """Process 0 holds `out` for the run's lifetime (gpt2common/outdir.py), from its first write
    (creating it) until the run ends, however it ends. A start that fails before its first step
    (data missing or too short, a vocab too small, a compile that runs out of memory) leaves
    nothing behind that it created, removed while the lock is still held: the run's own entries
    of an out it created, then that out and each parent it created, each only while empty (a
    parent may hold another run's out by then). What existed before (a restartable run's
    leftovers, the parent of `out`) is kept."""
    lock = hold(out) if is_main else None
    try:
        yield
    except BaseException:
        metrics = os.path.join(out, METRICS_FILE)
        if lock is not None and not rundir.checkpoint_steps(out) and not (
                os.path.exists(metrics) and os.path.getsize(metrics)):
            lock.discard(rundir.RUN_ENTRIES | {"wandb", WANDB_ID_FILE})
        raise
    finally:
        if lock is not None:
            lock.release()


def _peer_lost(e: Exception) -> bool:
    """A failed collective (JaxRuntimeError), or gloo's failure inside a checkpoint save: orbax
    syncs the processes with an all-gather, whose `Connection reset by peer` reaches us as a
    ValueError (a 40-line traceback before). Not an out-of-memory (gpt2common.writes.memory_line):
    that is this process's own failure, said as such."""
    if memory_line(e) is not None:
        return False
    return isinstance(e, jax.errors.JaxRuntimeError) or "Gloo" in str(e)


def _lost_peer(e: Exception) -> None:
    """A collective failed because a peer died (gloo: connection reset). One line and out at
    once: JAX's exit handler would wait on a shutdown barrier the dead peer never reaches, then
    abort with pages of coordination-service logs."""
    msg = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    sys.stdout.flush()
    sys.stderr.write(f"error: process {jax.process_index()} lost contact with its peers ({msg}); "
                     f"resume=true continues from the last complete checkpoint\n")
    sys.stderr.flush()
    os._exit(LOST_PEER_EXIT)


def _initial_state(cfg, trainer, init_params, resume_step, ds) -> tuple[dict, int, int, str]:
    """(state, start step, non-finite steps skipped so far, the line that says where they came from,
    "" for a fresh start): fresh, from `init_state=`, or the newest intact checkpoint resharded onto
    this mesh (damaged steps skipped, see jaxpar.run.checkpoint.restore)."""
    if resume_step is None and cfg.init_state:  # the state's step, weights and moments, on this mesh
        state, start, skipped = handoff.initial_state(cfg, trainer, handoff.check_init_state(cfg), ds)
        return state, start, skipped, f"continuing the training state {cfg.init_state} from step {start}"
    if resume_step is None:
        params = init_params if init_params is not None else gpt2.init_params(cfg.model, cfg.seed)
        return trainer.init_state(params), 0, 0, ""
    target = trainer.abstract_state()

    def accept(step: int) -> None:  # checked before damaged steps are moved aside: a refusal moves nothing
        if step > cfg.train.steps:
            raise ConfigError(f"train.steps={cfg.train.steps} is below the step of the checkpoint to resume ({step})")

    r = restore(cfg.out, target["params"], target["opt_state"], quarantine=True, key="out", accept=accept)
    origin = f"resumed from step {r.step} ({os.path.join(cfg.out, 'ckpt')})"
    if r.opt_state is None:  # weights only (a run made by `jaxpar convert hf=`): fresh optimizer moments
        state, origin = trainer.init_state(r.params), f"{origin} with fresh optimizer moments: the step holds weights only"
    else:
        state = {"params": r.params, "opt_state": r.opt_state}
    state["step"] = jax.device_put(np.int32(r.step), trainer.state_shardings["step"])
    return state, r.step, int(r.meta.get("nonfinite_skipped", 0)), origin


def _train(cfg, trainer, ckpt, ds, initial, resume_step, restart, stop, is_main) -> int:
    """Train from `initial` = (state, start step, non-finite steps skipped, origin line) of _initial_state."""
    tc = cfg.train
    state, start, skipped, origin = initial
    # Written only now, after the config, data and checkpoint checked out.
    wandb_run = None
    if is_main:
        print(f"jaxpar train: {cfg.model_name} ({cfg.model.num_params():,} params), mesh {dataclasses.asdict(cfg.mesh)}, "
              f"{jax.device_count()} devices / {jax.process_count()} processes, precision {cfg.precision}")
        settings = settings_of(cfg)  # no resume/plan/dry_run: config.json is a valid --config
        print("config: " + json.dumps(dataclasses.asdict(settings), separators=(",", ":")))
        write_atomic(os.path.join(cfg.out, "config.json"), dumps(settings))  # a resume's old one survives a failure
        truncate_after(os.path.join(cfg.out, METRICS_FILE), start)  # a resume rewrites what came after
        if cfg.log.wandb:
            wandb_run = start_wandb(cfg.out, cfg.log, start, dataclasses.asdict(settings))

    tokens_per_step = tc.batch_size * tc.seq_len
    flops_tok = cfg.model.flops_per_token(tc.seq_len)
    peak = device_peak_flops(cfg)  # None: no MFU (the metrics carry FLOP/s only)
    peak = peak * jax.device_count() if peak else None
    logger = MetricsLogger(cfg.out, tc.steps, start, cfg.progress, enabled=is_main, print_every=tc.log_every,
                           wandb_run=wandb_run)
    if origin:
        logger.message(origin)
    elif restart:
        logger.message(f"out={cfg.out} held a run that failed before its first checkpoint; starting it over")
    fault = _fault_injection()

    clock = CheckpointClock(tc.ckpt_minutes, start, _agree if jax.process_count() > 1 else lambda v: v)
    saved = set()

    def save(step):
        # A signal during a periodic checkpoint stops the run at the next step boundary, before
        # another step ran: the stop path's save is then the one just written (orbax would raise
        # StepAlreadyExistsError on a second save of it).
        if step in saved:
            return
        t0 = time.perf_counter()
        try:
            ckpt.save(step, state, {"step": step, "seed": cfg.seed, "nonfinite_skipped": skipped})
        except WriteFailed as e:
            raise WriteFailed(f"step {step}: {e}") from None
        saved.add(step)
        clock.saved(step, time.perf_counter() - t0)

    def put(step):  # host gather + transfer of step `step`'s batch
        x, y = data_lib.train_batch(ds, tc.seq_len, tc.batch_size, cfg.seed, step)
        return trainer.put_batch(x), trainer.put_batch(y)

    # Compile ahead of time so step 1's time and MFU exclude compilation. Multi-process runs
    # then line up: gloo gives a peer only 30 s to join a collective's first use, and compile
    # times differ per process.
    batch = put(start)
    step_fn = trainer.loop_step_fn.lower(state, *batch, trainer.put_flag(False)).compile()
    if fault is not None and fault[0] == 0:
        os.kill(os.getpid(), fault[1])
    if jax.process_count() > 1:
        from jaxpar.parallel.mesh import barrier

        barrier("jaxpar:first-step")

    # Host-side tables, so reading a step's metrics seldom dispatches a JAX op: the lr of each
    # step (_LrTable) and the two stop-flag arrays (inputs, not donated, so reused every step).
    lrs = _LrTable(trainer.schedule)
    flags = {False: trainer.put_flag(False), True: trainer.put_flag(True)}
    t_prev = time.perf_counter()

    def read(n, m) -> tuple[dict, bool]:
        """Step n's metrics record (blocks until step n is done) and the all-process stop flag."""
        nonlocal t_prev, skipped
        host = jax.device_get(m)
        now = time.perf_counter()
        dt, t_prev = now - t_prev, now
        loss, gnorm = float(host["loss"]), float(host["grad_norm"])
        # the lr step n's update applies: the schedule counts applied updates (a skipped step adds none)
        rec = {"step": n, "loss": loss, "grad_norm": gnorm, "lr": float(lrs[n - 1 - skipped]),
               "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
               "flops_per_s": flops_tok * tokens_per_step / dt}
        if peak:
            rec["mfu"] = rec["flops_per_s"] / peak
        if not bool(host["finite"]):
            rec.update(loss=loss if np.isfinite(loss) else None, grad_norm=gnorm if np.isfinite(gnorm) else None,
                       nonfinite=True)  # JSON has no NaN
            if not tc.skip_nonfinite:
                logger.log(rec)
                raise NonFinite(nonfinite_message(n, loss, gnorm, cfg.out))
            skipped += 1
        if tc.skip_nonfinite:
            rec["nonfinite_skipped"] = skipped
        return rec, bool(host["stop"])

    def log(rec):
        logger.log(rec)
        clock.observe(rec["step_time_s"])
        if fault is not None and rec["step"] == fault[0]:
            os.kill(os.getpid(), fault[1])

    # Asynchronous: step n+1 is dispatched (and step n+2's batch put on the devices) before
    # step n's metrics are read, so host work overlaps device work; the host waits on the
    # device only at eval / checkpoint / stop boundaries. Every decision (stop, non-finite)
    # comes from replicated step outputs, so all processes take it at the same step.
    pending, stop_seen, done, stopped = None, False, start, None
    alone = jax.process_count() == 1
    try:
        for step in range(start, tc.steps):
            n = step + 1
            if alone and stop.signum is not None:
                # No peer to agree with: stop after the step in flight (several processes wait
                # for the flag to come back from the step they all ran, see below).
                if pending is not None:
                    log(read(*pending)[0])
                stopped = signal.Signals(stop.signum).name
                break
            state, m = step_fn(state, *batch, flags[stop.signum is not None])
            if n < tc.steps:
                batch = put(n)
            if pending is not None:
                rec, flag = read(*pending)
                log(rec)
                stop_seen |= flag
            pending, done = (n, m), n
            ckpt_now = ((tc.ckpt_every and n % tc.ckpt_every == 0) or clock.due(n)) and n < tc.steps
            eval_now = tc.eval_every and n % tc.eval_every == 0
            if not (stop_seen or ckpt_now or eval_now or clock.boundary(n) or n == tc.steps):
                continue
            rec, flag = read(*pending)  # a boundary: wait for step n
            pending, stop_seen = None, stop_seen or flag
            if eval_now:
                rec["val_loss"] = evaluate(trainer, state["params"], ds, cfg)
            log(rec)
            clock.at_boundary(n)
            if stop_seen:
                stopped = signal.Signals(stop.signum).name if stop.signum else "a signal to another process"
                break
            if ckpt_now:
                save(n)
            t_prev = time.perf_counter()  # eval and checkpoint time is not step time
        if done > start or resume_step is None:
            save(done)
    except NonFinite as e:
        logger.close()
        if not is_main:
            raise SystemExit(2) from None
        raise ConfigError(str(e)) from None
    except WriteFailed as e:
        logger.close()
        last = ckpt.latest_step()
        fix = remedy(str(e))
        raise WriteFailed(f"{e}; " + (f"the last complete checkpoint is step {last}: {fix}, then continue "
                                      "with resume=true" if last is not None else
                                      f"no checkpoint is complete: {fix}, then run again")) from None
    if stopped is not None:
        logger.message(f"stopped by {stopped} after step {done}; checkpoint saved to "
                       f"{os.path.join(cfg.out, 'ckpt', str(done))}; continue with resume=true")
    else:
        logger.message(f"done: {done} steps, checkpoint {os.path.join(cfg.out, 'ckpt', str(done))}")
    logger.close()
    return 0
