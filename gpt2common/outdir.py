"""The checks any run makes on `out=` before its first byte, that first write, and the lock a
run holds on its out for its lifetime; shared by `jaxpar train` (jaxpar/run/rundir.py adds its
own resume rules) and `torchref train`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import sys

from gpt2common.grammar import ConfigError


def check_writable(out: str, key: str = "out") -> None:
    """ConfigError unless `out` is (or can be created as) a writable directory. Writes nothing."""
    try:  # argv holds undecodable bytes as surrogates; the checkpoint writer takes UTF-8 paths only
        out.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{key}={out!r} is not valid UTF-8; choose a path that is") from None
    if not out:  # abspath would make it the current dir (prepare out= wrote there); the line make_out gives it
        raise ConfigError(f"{key}='' cannot be created ({os.strerror(errno.ENOENT)})")
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={out!r} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}={out!r} cannot be created: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={out!r} cannot be created or written: {parent!r} is not writable")


def make_out(out: str, key: str = "out", given: str | None = None) -> None:
    """Create the directory `out`, the first write of a run or an export. A refusal check_writable
    cannot foresee (a read-only mount, /proc, ...) is a one-line error naming `key` and the path as
    given (`given` where `out` stands in for it: a state dir is first written as `<given>.tmp`)."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{key}={(out if given is None else given)!r} cannot be created ({e.strerror})") from None


# ----------------------------------------------------------------------------- one writer per out
# A run holds an advisory lock (flock) on `<out>/.lock` from before its first write until it
# exits: a second writer (train, resume, torchref train) is refused instead of interleaving its
# checkpoints and metrics with the first's. The kernel drops the lock when the holder dies
# (kill -9 included), so a stale lock file never blocks anyone; readers (eval, sample, plot,
# convert checkpoint=) never look at it.

LOCK_FILE = ".lock"


def _held_by(fd: int) -> str:
    """The holder's pid as it wrote it into the lock file ('unknown' while it has not yet)."""
    os.lseek(fd, 0, os.SEEK_SET)
    pid = os.read(fd, 32).decode("ascii", "replace").strip()
    return pid if pid.isdigit() else "unknown"


def _refusal(out: str, pid: str) -> ConfigError:
    return ConfigError(f"out={out!r} is in use by a running process (pid {pid}); wait for it to finish, "
                       "stop it, or choose another out")


def check_free(out: str) -> None:
    """ConfigError naming the holder's pid when a live process holds `out`. Writes nothing."""
    try:  # O_NOFOLLOW: a `.lock` symlink is nobody's lock (`hold` refuses it)
        fd = os.open(os.path.join(out, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # no lock file (or no out): nobody holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _held_by(fd)
        if pid != str(os.getpid()):  # not this process re-checking the out it holds
            raise _refusal(out, pid) from None
    except OSError:  # a filesystem without flock (some network mounts): `hold` warns
        pass
    finally:
        os.close(fd)


class OutLock:
    """The lock of one run on its out dir; `release` (or process exit) gives it up. `created`:
    the directories this run made for `out`, `out` first, then each missing parent up to the
    topmost one (empty when out existed)."""

    def __init__(self, out: str, fd: int, path: str, created: list[str]):
        self.out, self.fd, self.path, self.created = out, fd, path, created

    def discard(self, names) -> None:
        """A start that failed before the run's first step: remove the entries `names` of an out
        this run created, while the lock is still held (no other run can have written there; a
        parent this run created may hold another run's out: `release` only rmdirs it when empty)."""
        if self.fd < 0 or not self.created:
            return
        for name in names:
            p = os.path.join(self.out, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(p)

    def release(self) -> None:
        """Remove the lock file, then unlock: whoever opens the path afterwards gets a new file
        (see `hold`), so a clean exit leaves no trace in out; an out this run created and left
        empty (it failed on its inputs) is removed too, then each parent it created, each only
        while empty (rmdir): never a directory another run has written into meanwhile."""
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        _remove_empty(self.created)


def _remove_empty(dirs: list[str]) -> None:
    for d in dirs:  # deepest first
        try:
            os.rmdir(d)  # only if empty
        except OSError:
            break


def _missing_dirs(out: str) -> list[str]:
    """The directories makedirs(out) would create, deepest (out) first."""
    path, missing = os.path.abspath(out), []
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _open_lock(out: str, path: str) -> int:
    """The lock file's fd: never through a symlink (O_NOFOLLOW) and never a file with other names
    (a hard link): the pid written into it would overwrite a foreign file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"out={out!r}: its lock file {LOCK_FILE} is a symlink; remove it (a run never "
                              "writes through a link)") from None
        raise ConfigError(f"out={out!r}: cannot create its lock file ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else "has other hard links"
        raise ConfigError(f"out={out!r}: its lock file {LOCK_FILE} {what}; remove it (a run never writes a "
                          "foreign file)")
    return fd


def hold(out: str) -> OutLock:
    """Create `out` if needed (the run's first write) and take its lock, or raise ConfigError
    naming the holder. The lock file is unlinked on release, so a lock taken on a file that was
    unlinked meanwhile is worthless: the inode is compared with the path's and the take retried."""
    created = _missing_dirs(out)
    make_out(out)
    path = os.path.join(out, LOCK_FILE)
    while True:
        try:
            fd = _open_lock(out, path)
        except ConfigError:
            _remove_empty(created)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _held_by(fd)
            os.close(fd)
            raise _refusal(out, pid) from None
        except OSError as e:  # ENOLCK / EOPNOTSUPP: the run goes on, unguarded, and says so
            sys.stderr.write(f"warning: out={out!r} cannot be locked ({e.strerror}); a second run into it "
                             "would not be detected\n")
            break
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return OutLock(out, fd, path, created)


def entries(out: str) -> list[str]:
    """What `out` holds besides a lock file (a stale one is left by a run that was killed)."""
    return [e for e in os.listdir(out) if e != LOCK_FILE]
