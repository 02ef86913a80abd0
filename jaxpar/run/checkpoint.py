"""Checkpoints with orbax: `<run>/ckpt/<step>/{params,opt_state,meta}`, and the one path
that reads them back.

Writing. Orbax writes each step into a temporary dir and renames it when complete, so a
half-written step is never listed. Saves are synchronous: the step's donated buffers are
reused right after, and CPU runs gain nothing from async. The data position and dropout RNG
are pure functions of (seed, step), so `step` in `meta` is all a resumed run needs besides
params and optimizer state. `meta` also holds one checksum per array (`checksums`), because
a zero-filled or bit-rotted data file can decode without any error from tensorstore.

Reading (`restore`, used by train resume, eval, sample and convert). Params are stored in the
model's canonical layout whatever wrote them: single device, data/fsdp/tensor sharding, a
GPipe or circular pipeline (the pipeline re-lays the stacked `layers` dim out to stage order
inside the step, never on disk) or several processes. Orbax reassembles each array from its
shards and places it with the shardings of the abstract target it is given, so any
checkpoint restores onto any mesh. (Restoring without shardings is what fails: orbax then
tries to reuse the writer's device topology.) Steps are tried newest first; a step that
cannot be read or fails its checksums is skipped with a one-line warning naming it, and a
run with no readable step is a ConfigError (one `error:` line, exit 2).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from gpt2common.writes import WriteFailed, describe, drop_closed_loop_reports, write_errno
from jaxpar.config import ConfigError

CKPT_DIR = "ckpt"
QUARANTINE_DIR = "ckpt.corrupt"  # resume moves unreadable steps here, out of orbax's sight


# ----------------------------------------------------------------------------- checksums


@jax.jit
def _leaf_checksums(leaves: list) -> list:
    """One uint32 per array: the wrapping sum of its elements' bit patterns. Integer addition
    is associative, so the value is exact whatever the sharding or reduction order (a
    checkpoint written on 8 devices checks against one restored on 1)."""
    out = []
    for x in leaves:
        if x.dtype.itemsize == 4:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif x.dtype.itemsize == 2:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        else:  # bool / int8: the values themselves
            bits = x.astype(jnp.uint32)
        out.append(jnp.sum(bits, dtype=jnp.uint32))
    return out


def checksums(tree) -> list[int]:
    """Checksums of the array leaves of `tree`, in tree-flatten order (all processes must call)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    return [int(np.asarray(c)) for c in _leaf_checksums(leaves)]


# ----------------------------------------------------------------------------- writing


class Checkpointer:
    def __init__(self, run_dir: str, max_to_keep: int = 2, create: bool = True):
        self.dir = os.path.abspath(os.path.join(run_dir, CKPT_DIR))
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                            enable_async_checkpointing=False)
        # Handlers named up front (not just item names) so `item_metadata` can read the stored
        # shapes before a restore.
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self.mngr = ocp.CheckpointManager(self.dir, options=opts, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def steps(self) -> list[int]:
        """Complete steps, newest first."""
        return sorted(self.mngr.all_steps(), reverse=True)

    def save(self, step: int, state: dict, meta: dict) -> None:
        items = {"params": ocp.args.StandardSave(state["params"])}
        sums = {"params": checksums(state["params"])}
        if state.get("opt_state") is not None:
            items["opt_state"] = ocp.args.StandardSave(state["opt_state"])
            sums["opt_state"] = checksums(state["opt_state"])
        items["meta"] = ocp.args.JsonSave({**meta, "checksums": sums})
        drop_closed_loop_reports()  # before the save: a failed write's siblings report during it
        absl_log, held = logging.getLogger("absl"), _Hold()
        absl_log.addFilter(held)  # orbax logs a write thread's error, then raises it here: log it once
        try:
            self.mngr.save(step, args=ocp.args.Composite(**items), force=True)
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore wrap OS errors in ValueError
            code = write_errno(e)
            if code is None:
                held.release(absl_log)
                raise
            if jax.process_index() == 0:  # give the partial step's space back; it was never listed
                _remove_partial(self.dir, step)
            # `held` stays on: the step's other write threads may still log the same error.
            raise WriteFailed(f"cannot write checkpoint {os.path.join(self.dir, str(step))}: {describe(code)}") from None
        held.release(absl_log)

    def close(self) -> None:
        self.mngr.close()


PARTIAL_SETTLE_S = 1.0  # a failed step's temporary dir must stay gone this long before save gives up on it
PARTIAL_LIMIT_S = 10.0


def _remove_partial(ckpt_dir: str, step: int, settle_s: float = PARTIAL_SETTLE_S,
                    limit_s: float = PARTIAL_LIMIT_S) -> None:
    """Remove step `step`'s orbax temporary dirs, again whenever they come back, until none has
    come back for `settle_s` (at most `limit_s`). Orbax raises at the first failed write while the
    step's other tensorstore writes are still in flight, and those re-create the dirs they write
    into: on a loaded host one removal left `4.orbax-checkpoint-tmp/params.orbax-checkpoint-tmp/
    ocdbt.process_0/d` behind (test_failures_disk and its command by hand: 3 runs in 6 at load 7-9)."""
    pattern = os.path.join(ckpt_dir, f"{step}.orbax-checkpoint-tmp*")
    now = time.monotonic()
    deadline, quiet_until = now + limit_s, now + settle_s
    while now < deadline:
        found = glob.glob(pattern)
        for tmp in found:
            shutil.rmtree(tmp, ignore_errors=True)
        if found:
            quiet_until = time.monotonic() + settle_s
        elif now >= quiet_until:
            return
        time.sleep(0.05)
        now = time.monotonic()


class _Hold(logging.Filter):
    """Holds a logger's records back; `release` passes them on, unless a failed write (reported
    as one `error:` line) means they only repeat it."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record):
        self.records.append(record)
        return False

    def release(self, log: logging.Logger) -> None:
        log.removeFilter(self)
        for r in self.records:
            log.handle(r)


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any | None  # None unless asked for, and for a weights-only step (`weights_only`)
    meta: dict


def _one_line(e: BaseException, limit: int = 160) -> str:
    """First line of an exception, shortened: tensorstore/orbax messages run to many lines."""
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_shapes(stored, target, item: str, where: str) -> None:
    """ConfigError naming the first array whose stored shape differs from the model's:
    a different model, not a damaged file, so no fallback to an older step."""
    flat_s = dict(jax.tree_util.tree_flatten_with_path(stored)[0])
    for path, t in jax.tree_util.tree_flatten_with_path(target)[0]:
        s = flat_s.get(path)
        name = f"{item}{jax.tree_util.keystr(path)}"
        if s is None:
            raise ConfigError(f"{where} has no {name} (the checkpoint does not match this model)")
        if tuple(s.shape) != tuple(t.shape):
            raise ConfigError(f"{where} holds {name} of shape {tuple(s.shape)} but the model needs "
                              f"{tuple(t.shape)} (model.* differs from the run that wrote it)")


class _Corrupt(Exception):
    """A step whose bytes are wrong though orbax read them (checksum mismatch)."""


def weights_only(meta: dict) -> bool:
    """Whether a step with this meta was saved without an optimizer state on purpose (`jaxpar
    convert hf=`): it lists the checksums of params alone. A step whose opt_state went missing
    later still lists it, and fails its restore as damaged."""
    return set(meta.get("checksums", {})) == {"params"}


def _restore_step(ck: Checkpointer, step: int, abstract_params, abstract_opt_state, where: str) -> Restored:
    stored = ck.mngr.item_metadata(step)["params"]
    if stored is None:
        raise _Corrupt("params metadata missing")
    # Params only: their paths are plain dict keys. (opt_state's optax tuples come back from
    # the metadata with other key types; a mismatch there still fails the restore itself.)
    _check_shapes(stored, abstract_params, "params", where)
    # meta first: it says whether the step holds an optimizer state at all
    meta = dict(ck.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    items = {"params": ocp.args.StandardRestore(abstract_params)}
    if abstract_opt_state is not None and not weights_only(meta):
        items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
    r = ck.mngr.restore(step, args=ocp.args.Composite(**items))
    want = meta.get("checksums", {})  # absent in checkpoints written before checksums existed
    for item in ("params", "opt_state"):
        if item in want and item in items and checksums(r[item]) != want[item]:
            raise _Corrupt(f"{item} fail their checksums")
    return Restored(int(meta.get("step", step)), r["params"], r.get("opt_state"), meta)


ORBAX_SRC = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"  # in the file names of orbax's code


def _orbax_read_failure(exc) -> bool:
    """A read that failed in orbax's code: orbax's "Encountered error while reading array index"
    or tensorstore's "Error reading ..." (a write's failure never says "reading"), raised through
    a frame of orbax."""
    if exc is None or "reading" not in str(exc):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if ORBAX_SRC in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _orphaned_read_error(u) -> bool:
    """An unraisable exception of a failed restore's other reads (see _drop_orphaned_read_errors)."""
    if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
        return True
    return _orbax_read_failure(u.exc_value)  # one of orbax's coroutines, finalised with its error


class _OrphanedReadTasks(logging.Filter):
    """asyncio's "<Task or _GatheringFuture> exception was never retrieved" record for a read of
    orbax's that failed: the other forms the same orphaned failure takes (_drop_orphaned_read_errors)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in record.getMessage() and _orbax_read_failure(exc))


def _drop_orphaned_read_errors() -> None:
    """When a restore fails, tensorstore reads of the step's other arrays are still in flight.
    orbax has already closed the event loop they report to, so each completion raises
    RuntimeError('Event loop is closed') inside a callback; and each of orbax's read coroutines
    that failed too is finalised with its error unretrieved, or asyncio logs its task or gathering
    future as never retrieved. Each is printed with its traceback (up to 860 lines for one damaged
    gpt2-tiny step). The failure is already the step's one-line reason: drop exactly these (for
    the rest of the process, as the callbacks can fire at any time) and pass on the rest."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrphanedReadTasks) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrphanedReadTasks())
    prev = sys.unraisablehook
    if getattr(prev, "_jaxpar_filter", False):
        return

    def hook(u):
        if not _orphaned_read_error(u):
            prev(u)

    hook._jaxpar_filter = True
    sys.unraisablehook = hook


def _warn(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {msg}", file=sys.stderr, flush=True)


def _quarantine(run_dir: str, step: int) -> str:
    """Move an unreadable step out of ckpt/ (process 0), so the resumed run can write that step
    again; the bytes are kept for inspection, and so are those of an earlier move of the same
    step (`<step>.1`, `<step>.2`, ...: never removed, a later run did not create them). Returns
    the new location (process 0's: the one the warning names)."""
    dst = base = os.path.join(run_dir, QUARANTINE_DIR, str(step))
    if jax.process_index() == 0:
        n = 0
        while os.path.lexists(dst):
            n += 1
            dst = f"{base}.{n}"
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.move(os.path.join(run_dir, CKPT_DIR, str(step)), dst)
    return dst


def restore(run_dir: str, abstract_params, abstract_opt_state=None, quarantine: bool = False,
            key: str = "checkpoint", accept: Callable[[int], None] | None = None, step: int | None = None) -> Restored:
    """The newest readable step of `run_dir`, placed with the shardings in the abstract targets
    (trees of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`); opt_state only if its target
    is given. Unreadable steps are skipped with a warning (and, with `quarantine`, moved to
    `<run>/ckpt.corrupt/`). ConfigError when the run has no checkpoint, no readable step, or
    its arrays do not fit the model. `key` names the CLI argument in messages. `accept(step)` may
    refuse the restored step with a ConfigError before anything is quarantined (a refused
    command moves nothing). `step`: that step only (no fallback to an older one)."""
    if not os.path.isdir(os.path.join(run_dir, CKPT_DIR)):
        raise ConfigError(f"{key}={run_dir!r} has no {CKPT_DIR}/ directory (not a jaxpar run dir)")
    try:
        ck = Checkpointer(run_dir, create=False)
    except Exception as e:  # noqa: BLE001 - orbax raises many types for an unreadable dir
        raise ConfigError(f"{key}={run_dir!r}: cannot read {CKPT_DIR}/ ({_one_line(e)})") from None
    failed: list[tuple[int, str]] = []  # (step, one-line reason) per unreadable step
    _drop_orphaned_read_errors()  # before any read: the callbacks can fire before an except clause runs
    try:
        steps = ck.steps()
        if not steps:
            raise ConfigError(f"{key}={run_dir!r} holds no complete checkpoint")
        if step is not None:
            if step not in steps:
                raise ConfigError(f"{key}={run_dir!r} has no checkpoint step {step} (steps: "
                                  f"{', '.join(map(str, sorted(steps)))})")
            steps = [step]
        for s in steps:
            where = f"{key}={run_dir!r} step {s}"
            try:
                r = _restore_step(ck, s, abstract_params, abstract_opt_state, where)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - tensorstore/orbax/json errors of a damaged step
                failed.append((s, _one_line(e)))
                continue
            break
        else:  # nothing readable: the one error line lists every step's reason, no warnings
            tried = "; ".join(f"{s} ({why})" for s, why in failed)
            raise ConfigError(f"{key}={run_dir!r}: no readable checkpoint step (tried {tried})")
    finally:
        ck.close()
    if accept is not None:
        accept(r.step)
    for s, why in failed:  # never silently: one line per skipped step, naming it
        # quarantine only once a step was restored: a command that fails writes nothing
        moved = f"; moved it to {_quarantine(run_dir, s)}" if quarantine else ""
        _warn(f"skipped unreadable checkpoint step {s} in {ck.dir} ({why}); using step {r.step}{moved}")
    if quarantine and failed and jax.process_count() > 1:
        from jaxpar.parallel.mesh import barrier

        barrier("jaxpar:ckpt-quarantine")
    return r
