"""How a torchref rank that fails tells the launcher why (standard library only: the launcher
and every rank, forked or under mpiexec, import it).

A rank whose write the storage refuses (disk full, quota, file-size limit: gpt2common/writes.py)
exits with WRITE_FAILED_EXIT and writes its one-line reason, marked, into its log; the launcher
finds that line after the job died and reports it (CLI: one `error:` line, exit 4) instead of a
plain worker death (exit 2)."""

from __future__ import annotations

import os
import sys

# Starts the line a rank's log ends with when the storage refused one of its writes (`storage_failure`).
STORAGE_LOG_PREFIX = "storage failure: "


def end_rank(e: BaseException) -> int:
    """The exit code of a rank that failed with `e`, whose traceback is already in its log. A storage
    failure (gpt2common.writes) also gets its one-line reason at the end of its log, for the launcher."""
    from gpt2common.writes import WRITE_FAILED_EXIT, failure_line

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
    for r in range(world):
        try:
            with open(os.path.join(out, "logs", f"rank{r}.log")) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        # not always the very last line: MPI_Abort writes its own after it
        if found := [ln for ln in lines if ln.startswith(STORAGE_LOG_PREFIX)]:
            return f"rank {r}: {found[-1][len(STORAGE_LOG_PREFIX):]}"
    return None
