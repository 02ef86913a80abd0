"""A file the run cannot write: the disk is full, a quota or a file-size limit is hit.
Shared by jaxpar and torchref (standard library only).

`jaxpar train` (and `torchref train`, for the files its launcher writes) then ends with one line and exit code 4 (`WRITE_FAILED_EXIT`), not a traceback:

    error: step 4: cannot write checkpoint /run/ckpt/4: No space left on device (errno 28);
    the last complete checkpoint is step 2: free space, then continue with resume=true

What is on disk stays usable: orbax writes a step into a temporary dir and renames it when
complete, so the failed step is never listed (its partial files are removed to give the space
back), and resume drops the metrics lines after the checkpoint it continues from.

Orbax does not raise OSError: tensorstore's failure reaches us as a ValueError whose text ends in
`[os_error_code='28']`, so `write_errno` reads the errno from either form.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import sys

WRITE_FAILED_EXIT = 4  # also out of memory (memory_line): the machine refused a resource
# Failures of the storage, not of the run: the fix is outside jaxpar (free space, raise a limit).
# Said "cannot write"; any other errno of a write is "cannot use" (write_errno takes every one).
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)
_TS_ERRNO = re.compile(r"os_error_code='?(\d+)")
_XLA_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|bad_alloc")


class WriteFailed(Exception):
    """A write of the run failed for a storage reason (`WRITE_ERRNOS`); the message is one line."""


def write_errno(e: BaseException) -> int | None:
    """The errno behind a failed write `e` (an OSError in its cause/context chain, tensorstore's
    `os_error_code` in a message, ENOMEM for a MemoryError), None when `e` holds none. Any errno:
    besides WRITE_ERRNOS, a permission taken away mid-run (EACCES on a rename), a descriptor limit
    (EMFILE), an allocation refused inside the write (ENOMEM) are the storage's refusals too."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else errno.ENOMEM if isinstance(e, MemoryError) else None
        if code is None and (m := _TS_ERRNO.search(str(e))):
            code = int(m.group(1))
        if code is None and _XLA_OOM.search(str(e)):  # tensorstore's allocation failure under `ulimit -v`
            code = errno.ENOMEM
        if code:
            return code
        e = e.__cause__ or e.__context__
    return None


def describe(code: int) -> str:
    return f"{os.strerror(code)} (errno {code})"


def remedy(line: str) -> str:
    """What the user does about the failure `line` says: free space for a full disk, a quota or a
    file-size limit (WRITE_ERRNOS); otherwise the storage's permissions and limits."""
    if any(f"(errno {c})" in line for c in WRITE_ERRNOS):
        return "free space"
    return "fix the storage (permissions, open-file or memory limits)"


def failure_line(e: BaseException) -> str | None:
    """The one-line message for a storage failure (a WriteFailed, or an OSError `write_errno`
    recognises, from a write made outside write_atomic), None for anything else. Both CLIs use it."""
    if isinstance(e, WriteFailed):
        return str(e)
    if isinstance(e, OSError) and (code := write_errno(e)) is not None:
        return f"cannot {'write' if code in WRITE_ERRNOS else 'use'} {e.filename or 'a file'}: {describe(code)}"
    return memory_line(e)


def memory_line(e: BaseException) -> str | None:
    """The one-line message for memory the machine refused (a host MemoryError, XLA's
    RESOURCE_EXHAUSTED), None for anything else: settings that pass validation may still not fit."""
    if isinstance(e, MemoryError):
        what = str(e) or "a host allocation failed"
    elif type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and _XLA_OOM.search(str(e)):
        what = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "RESOURCE_EXHAUSTED")[:300]
    else:
        return None
    return (f"out of memory ({what}); lower train.batch_size (or raise train.grad_accum), the model size or "
            "the sequence length, or add devices")


def temp_name(path: str) -> str:
    """A name beside `path` that no other writer picks (two writers of one path never share a
    temporary, and a leftover of a killed one is never reused): `<path>.<pid>.<random>.tmp`."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def open_fd(path, append: bool = False) -> int:
    """The fd of a file the run writes, opened without following a symlink (O_NOFOLLOW: ELOOP)
    and never truncating a foreign file: unless `append`, an existing name (a link or a run's own
    old file) is unlinked and a new file created (O_EXCL); appended to, it must be a regular file
    of one name (a hard link would append to a foreign file)."""
    if not append:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the name only: a link's target is untouched
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_EXCL)
    fd = os.open(path, flags, 0o666)  # the umask applies, as for open()
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise OSError(errno.EEXIST, "not a regular file of one name (a run never writes a foreign file)", path)
    return fd


def open_new(path, text: bool = True, append: bool = False):
    """`open_fd` as a file object (text or binary)."""
    return os.fdopen(open_fd(path, append), ("a" if append else "w") + ("" if text else "b"))


def write_atomic(path, data: str | bytes) -> None:
    """`path` holds `data` or, when the write fails, its old content (or nothing): the data goes
    to a temporary file of its own (`temp_name`, created new: never through a symlink, never a
    foreign file) renamed over `path` (a symlink there is replaced, not followed); a failed write
    removes the temporary file and, for a storage failure, raises WriteFailed naming `path`."""
    path = os.fspath(path)
    tmp = temp_name(path)
    with refused_write(path):
        try:
            with open_new(tmp, text=not isinstance(data, bytes)) as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise


@contextlib.contextmanager
def refused_write(path, step: int | None = None):
    """Writes to `path` inside: a storage OSError becomes WriteFailed naming `path` (and the
    run's `step`, when given); any other error passes unchanged. At a step (mid-run) every errno
    is the storage's (a permission taken away, EMFILE); without one only WRITE_ERRNOS: a path
    that cannot be written at all (ENOENT, EACCES on an output the user named) is the caller's to
    refuse as bad input, or the CLI's one `cannot use` line."""
    try:
        yield
    except OSError as e:
        if (code := write_errno(e)) is None or step is None and code not in WRITE_ERRNOS:
            raise
        at = "" if step is None else f"step {step}: "
        verb = "write" if code in WRITE_ERRNOS else "use"
        raise WriteFailed(f"{at}cannot {verb} {os.fspath(path)}: {describe(code)}") from None


def silence_orphaned_writes() -> None:
    """After a failed save, orbax's other write tasks are still pending: asyncio logs each one's
    error ("Task exception was never retrieved") and interpreter shutdown reports the coroutines
    it destroys. They repeat the one error already reported; drop them for the rest of the process."""
    logging.getLogger("asyncio").disabled = True
    drop_closed_loop_reports()
    prev = sys.unraisablehook

    def hook(u):
        if getattr(u.object, "__qualname__", "").startswith("async_serialize"):
            return
        if u.object is not None and "coroutine" in type(u.object).__name__:
            return
        prev(u)

    sys.unraisablehook = hook


_CLOSED_LOOP = "Event loop is closed"


def drop_closed_loop_reports() -> None:
    """When one write of a checkpoint fails, orbax closes the save's event loop while the step's
    other tensorstore writes are still in flight; each one's completion callback then reports
    `RuntimeError: Event loop is closed` as unraisable, a traceback apiece (dozens on a real full
    disk, all before the save raises). Nothing else raises it: dropped for the whole process,
    installed before a save (idempotent)."""
    if getattr(sys.unraisablehook, "drops_closed_loop", False):
        return
    prev = sys.unraisablehook

    def hook(u):
        if u.exc_type is RuntimeError and str(u.exc_value) == _CLOSED_LOOP:
            return
        prev(u)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook

