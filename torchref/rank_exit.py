"""How a torchref rank that fails tells the launcher why (standard library only: the launcher
and every rank, forked or under mpiexec, import it).

A rank whose write the storage refuses (disk full, quota, file-size limit: gpt2common/writes.py)
exits with WRITE_FAILED_EXIT and writes its one-line reason, marked, into its log; the launcher
finds that line after the job died and reports it (CLI: one `error:` line, exit 4) instead of a
plain worker death (exit 2). A rank that stops at a non-finite step (`NonFinite`) marks its
reason the same way; the launcher reports it as jaxpar reports its own (one line, exit 2)."""

from __future__ import annotations

import math
import os
import sys

# Starts the line a rank's log ends with when the storage refused one of its writes (`storage_failure`).
STORAGE_LOG_PREFIX = "storage failure: "
NONFINITE_LOG_PREFIX = "non-finite step: "  # ... when it stopped at a non-finite step (`nonfinite_failure`)


class NonFinite(Exception):
    """A step's loss or gradient norm was not finite: its update was not applied, and the run stops
    there as `jaxpar train` does (torchref has no train.skip_nonfinite)."""


def check_finite(step: int, loss: float, grad_norm: float, norm_counts: bool = True) -> None:
    """NonFinite naming step `step` (1-based) unless its mean loss and global gradient norm (before
    clipping) are both finite. Called where the update is about to be applied. `norm_counts=False`:
    fp16's GradScaler, which skips a step whose scaled grads overflowed (and lowers the scale)."""
    if not (math.isfinite(loss) and (math.isfinite(grad_norm) or not norm_counts)):
        raise NonFinite(f"step {step}: non-finite loss or gradient norm (loss={loss}, grad_norm={grad_norm}); the "
                        "update was not applied and the run stopped; lower train.lr")


def end_rank(e: BaseException) -> int:
    """The exit code of a rank that failed with `e`, whose traceback is already in its log. A storage
    failure (gpt2common.writes) also gets its one-line reason at the end of its log, for the launcher."""
    from gpt2common.writes import WRITE_FAILED_EXIT, failure_line

    if isinstance(e, NonFinite):
        sys.stderr.write(f"{NONFINITE_LOG_PREFIX}{e}\n")
        sys.stderr.flush()
        return 1
    if (line := failure_line(e)) is None:
        return 1
    try:  # the log may sit on the full disk itself: then the launcher says less, but still exit 4
        sys.stderr.write(f"{STORAGE_LOG_PREFIX}{line}\n")
        sys.stderr.flush()
    except OSError:
        pass
    return WRITE_FAILED_EXIT


def storage_failure(out: str, world: int) -> str | None:
    """`rank r: <reason>` for the first rank whose log holds a storage failure line (`end_rank`), else None."""
    return _marked(out, world, STORAGE_LOG_PREFIX, "rank {r}: ")


def nonfinite_failure(out: str, world: int) -> str | None:
    """The non-finite step line (`NonFinite`) of the first rank whose log holds one, else None. Every
    rank that saw the step wrote the same line."""
    return _marked(out, world, NONFINITE_LOG_PREFIX, "")


def _marked(out: str, world: int, prefix: str, label: str) -> str | None:
    for r in range(world):
        try:
            with open(os.path.join(out, "logs", f"rank{r}.log")) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        # not always the very last line: MPI_Abort writes its own after it
        if found := [ln for ln in lines if ln.startswith(prefix)]:
            return label.format(r=r) + found[-1][len(prefix):]
    return None
