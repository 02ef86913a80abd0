"""Per-step metrics: `<out>/metrics.jsonl`, console progress, TensorBoard and optional W&B.

Only process 0 writes. Console: a rich progress bar on a TTY, plain lines otherwise.

A resumed run continues the curves of the run it resumes in all three sinks. metrics.jsonl
drops the lines after the checkpoint (`truncate_after`). TensorBoard gets `purge_step`: the new
event file starts with a SessionLog START at the first replayed step, and TensorBoard drops the
older files' events from that step on. W&B resumes the same run id (kept in `<out>/wandb_id`)
and plots against the logged `step`, so the replayed steps (bit-identical on resume) land on the
same points instead of being dropped as W&B drops an internal step that goes backwards.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import statistics
import sys
import uuid

from gpt2common.writes import WriteFailed, open_new, refused_write, write_atomic

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"


def _step_of(line: str) -> int | None:
    """The step of one metrics line; None for a torn or foreign line (a kill -9 mid-write
    leaves the last line cut short). Foreign lines include `{"step": Infinity}` (json reads it as
    float inf: int() raises OverflowError) and nesting deeper than json's recursion limit."""
    try:
        rec = json.loads(line)
        return int(rec["step"])
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError):
        return None


def truncate_after(path: str, step: int) -> None:
    """Keep the lines of steps <= `step` (a resumed run rewrites what came after its checkpoint;
    a fresh run, step 0, starts the file over). Torn lines are dropped. Atomic: the kept lines
    go to a temporary file that replaces the old one."""
    if not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        keep = [ln if ln.endswith("\n") else ln + "\n" for ln in f if (s := _step_of(ln)) is not None and s <= step]
    write_atomic(path, "".join(keep))


def _import_summary_writer():
    """tensorboardX's SummaryWriter without torch. tensorboardX imports torch at module level
    when it is installed (4 s on these hosts, every `jaxpar train` start) only so that it can
    accept torch tensors; jaxpar logs Python floats. Hiding torch for the import (a None entry in
    sys.modules makes `import torch` raise ImportError, which tensorboardX handles) skips that."""
    if "torch" in sys.modules:  # already paid for (e.g. a test process that imported torch)
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def flops_text(flops_per_s: float) -> str:
    """'42.1 GFLOP/s': three significant digits in the largest unit below the value."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.3g} {unit}FLOP/s"
    return f"{flops_per_s:.3g} FLOP/s"


def start_wandb(out_dir: str, log, start_step: int, config: dict):
    """A W&B run under `<out>/wandb`: a fresh run (start_step 0) gets a new id, a resume the one
    in `<out>/wandb_id`. `log` is config.LogConfig."""
    import wandb

    id_path = os.path.join(out_dir, WANDB_ID_FILE)
    run_id = None
    if start_step > 0 and os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip() or None
    if run_id is None:
        run_id = uuid.uuid4().hex[:8]  # W&B run ids: lowercase letters and digits
        write_atomic(id_path, run_id + "\n")
    run = wandb.init(project=log.wandb_project, id=run_id, resume="allow", dir=out_dir, mode=log.wandb_mode,
                     config=config, settings=wandb.Settings(silent=True, console="off"))
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


def eta_text(seconds: float) -> str:
    """'12s', '4m05s', '2h07m': the time left, rounded up."""
    s = math.ceil(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class MetricsLogger:
    def __init__(self, out_dir: str, total_steps: int, start_step: int, progress: str = "auto", enabled=True,
                 print_every: int = 1, wandb_run=None):
        self.enabled, self.total, self.print_every = enabled, total_steps, max(print_every, 1)
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.tb_dir = os.path.join(out_dir, "tb")
        self.write_failed = False
        self.tb = None
        self.wandb = wandb_run
        # the last step times, for the plain lines' ETA (their median: compile and eval steps do not skew it)
        self.recent = collections.deque(maxlen=20)
        self.bar = None
        if not enabled:
            return
        self.file = open_new(self.path, append=True)  # never through a link
        try:
            SummaryWriter = _import_summary_writer()
            # purge_step: TensorBoard drops the earlier files' events from the first replayed step on.
            # The suffix keeps a resume in the same second from reusing the file name
            # (events.out.tfevents.<seconds>.<host>) and truncating the earlier run's file.
            self.tb = SummaryWriter(self.tb_dir, purge_step=start_step + 1 if start_step else None,
                                    filename_suffix=f".{os.getpid()}.{start_step}")
        except ImportError:
            pass
        mode = progress if progress != "auto" else ("bar" if sys.stdout.isatty() else "plain")
        self.mode = mode
        if mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.fields[info]}"))
            self.bar.start()
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, info="")

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        try:
            with refused_write(self.path, rec["step"]):
                self.file.write(json.dumps(rec) + "\n")
                self.file.flush()
        except WriteFailed:
            self.write_failed = True
            raise
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if isinstance(v, (int, float))})
        loss = "non-finite" if rec["loss"] is None else f"{rec['loss']:.4f}"  # None: NaN/inf (JSON has none)
        # MFU only against a known peak (jaxpar.train.device_peak_flops); otherwise the FLOP/s reached
        rate = f"mfu {rec['mfu'] * 100:.2f}%" if "mfu" in rec else flops_text(rec["flops_per_s"])
        info = f"loss {loss} | {rec['tokens_per_s']:,.0f} tok/s | {rec['step_time_s'] * 1e3:.1f} ms | {rate}"
        if "val_loss" in rec:
            info += f" | val {rec['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], info=info)
            return
        self.recent.append(rec["step_time_s"])
        if self.mode == "plain" and (rec["step"] % self.print_every == 0 or rec["step"] == self.total
                                     or "val_loss" in rec):
            if rec["step"] < self.total:
                info += f" | eta {eta_text(statistics.median(self.recent) * (self.total - rec['step']))}"
            print(f"step {rec['step']:>6}/{self.total} | {info}", flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        elif self.mode != "none":
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.stop()
        if self.wandb is not None:
            self.wandb.finish()
        tb_failed = None
        if self.tb is not None:
            try:
                with refused_write(self.tb_dir):  # the events still buffered are written now
                    self.tb.close()
            except WriteFailed as e:
                _abandon(self.tb)
                tb_failed = e
        try:
            self.file.close()
        except OSError:  # the unwritten tail of a failed write: already reported by log()
            if not self.write_failed:
                raise
        if tb_failed is not None and not self.write_failed:  # else the same full disk, already reported
            raise tb_failed


def _abandon(tb) -> None:
    """A tensorboardX writer whose last flush failed: marked closed and its worker thread stopped,
    else its atexit hook retries the flush and the thread dies on its closed queue at exit, two
    tracebacks repeating a failure already reported in one line. Its event file is closed here too, its
    unwritten tail dropped: left open, Python 3.13's io finalizer reports the failing flush at garbage
    collection ("Exception ignored in: <_io.BufferedWriter ...>"; 3.11 stayed silent)."""
    for w in getattr(tb, "all_writers", {}).values():
        ew = getattr(w, "event_writer", None)
        if ew is None:
            continue
        ew._closed = True
        if getattr(ew, "_worker", None) is not None:
            ew._worker.stop()
        file = getattr(getattr(getattr(ew, "_ev_writer", None), "_py_recordio_writer", None), "_writer", None)
        if file is not None:
            with contextlib.suppress(OSError):  # the flush fails again; the file is closed all the same
                file.close()
