"""`jaxpar <command> [--config FILE.yaml] [key=value ...]`.

Exit codes: 0 success; 2 invalid configuration or input (one line `error: ...` on
stderr, no traceback); 3 a rank lost its peers (jaxpar.run.launch); 4 a write the storage
refused (disk full, a quota, a permission or descriptor limit: any errno) or memory the
machine refused (host or device out of memory), one `error:` line, gpt2common/writes.py; 130
interrupted (Ctrl-C); anything else is an internal fault. JAX is imported only after
the arguments are parsed, so emulated CPU devices can be requested first.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from gpt2common import writes
from gpt2common.grammar import one_line
from gpt2common.versions import version_line
from gpt2common.writes import WriteFailed
from jaxpar.config import ConfigError
from jaxpar.run import help as help_text
from jaxpar.run import host_memory, launch, xla_flags

USAGE = help_text.usage()

# command -> "module:function"; each function takes argv (after the command) and returns an exit code.
COMMANDS = {
    "train": "jaxpar.run.commands:train",
    "inspect": "jaxpar.run.commands:inspect",
    "prepare": "jaxpar.run.commands:prepare",
    "eval": "jaxpar.run.commands:evaluate",
    "sample": "jaxpar.run.commands:sample",
    "convert": "jaxpar.run.commands:convert",
    "plot": "jaxpar.run.commands:plot",
    "mesh": "jaxpar.run.commands:mesh",
    "bisect": "jaxpar.run.bisection:main",
    "launch": "jaxpar.run.launch:main",
    "plan": "jaxpar.planner.cli:main",
}


def main(argv: list[str] | None = None) -> int:
    """The CLI (see the module docstring). In a process of a multi-process job, a failure ends
    the process at once (os._exit, its traceback or error line already written): a normal exit
    runs JAX's shutdown barrier, which waits for peers that wait on this process in turn, so a
    rank that failed at start (a CPU backend set-up refused by `ulimit -n`) printed its
    traceback and never exited, and its peers and the launcher waited forever."""
    entry = argv is None  # the process's own entry (the `jaxpar` script, python -m): not a call from Python
    try:
        code = _main(argv)
    except BaseException as e:
        if not (entry and _in_job()):
            raise
        if isinstance(e, SystemExit):
            code = e.code if isinstance(e.code, int) else 1
        else:
            import traceback

            traceback.print_exc()
            code = 1
    # A job's rank, or the process's own entry (argv None: the `jaxpar` script, python -m) that was
    # interrupted: out without the interpreter's teardown (JAX's shutdown barrier; XLA / torch
    # threads still running segfaulted it after "error: interrupted", exit 139 instead of 130).
    if entry and (code and _in_job() or code == 130):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code


def _in_job() -> bool:
    from jaxpar.parallel.mesh import detect_cluster

    return detect_cluster() is not None


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not isinstance(sys.stdout, _ClosedStdoutIgnored):  # help too: `jaxpar --help | true`
        sys.stdout = _ClosedStdoutIgnored(sys.stdout)
    if not argv:  # a command is required: usage on stderr, exit 2 (as an unknown command)
        sys.stderr.write(f"{USAGE.splitlines()[0]}\n")
        _error_line(f"no command given (choose from {', '.join(COMMANDS)}; jaxpar --help)")
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        print(version_line("jaxpar"))
        return 0
    launch.die_with_launcher()  # a rank of `jaxpar launch` ends with it
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        _error_line(f"unknown command {cmd!r} (choose from {', '.join(COMMANDS)})")
        return 2
    own = rest[:rest.index("--")] if "--" in rest else rest  # launch: what follows `--` is the child's
    if any(a in ("-h", "--help") for a in own):
        print(help_text.command_help(cmd))
        return 0
    # XLA's C++ logs: no INFO / WARNING lines; in a multi-process job no ERROR lines either. Those are
    # the coordination service's reports of a dead peer (a page of them, racing our one
    # `lost contact` line, jaxpar.run.loop); their content reaches Python as the failed
    # collective's error. Set TF_CPP_MIN_LOG_LEVEL=0 to see them all.
    from jaxpar.parallel.mesh import detect_cluster

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3" if detect_cluster() else "2")
    xla_flags.apply_gpu_defaults()  # collective-overlap flags on GPU, before JAX starts
    host_memory.keep_freed_memory()  # no per-step page faults on XLA:CPU's buffers, before JAX starts
    module, func = COMMANDS[cmd].split(":")
    restore = _note_interrupts(cmd in READ_ONLY)
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except ConfigError as e:
        _error_line(str(e))
        return 2
    except (WriteFailed, OSError, MemoryError) as e:  # any storage errno, out of memory: gpt2common/writes.py
        if (msg := writes.failure_line(e)) is None:
            raise
        writes.silence_orphaned_writes()
        _error_line(msg)
        return writes.WRITE_FAILED_EXIT
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED: settings that pass validation may still not fit
        if (msg := writes.memory_line(e)) is None:
            raise
        _error_line(msg)
        return writes.WRITE_FAILED_EXIT
    except KeyboardInterrupt:
        _error_line("interrupted")
        return 130
    finally:
        restore()


# Commands that write nothing a Ctrl-C could leave half done: interrupted, they end at once
# (exit 130, `_interrupted_now`). A KeyboardInterrupt instead was lost inside a gc callback (eval
# ran to its end, exit 0) or unwound into interpreter teardown under live XLA / torch threads
# (sample, bisect: "error: interrupted", then a segfault, exit 139).
READ_ONLY = ("eval", "sample", "bisect", "mesh", "inspect")


def _interrupted_now(signum, frame):
    """SIGINT handler of a READ_ONLY command: one line, exit 130, nothing else runs."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.write(2, b"error: interrupted\n")
    os._exit(130)


class _Interrupt:
    """The CLI's SIGINT handler until a run installs its own (jaxpar.run.loop._StopFlag): Python's
    KeyboardInterrupt, plus a note of the signal in `received`. A KeyboardInterrupt raised while
    a gc callback runs (JAX's `_xla_gc_callback`, at any collection after JAX is imported) is
    printed as "Exception ignored" and lost, and the run went on to its last step; the run's
    handler finds the note and stops at the first step boundary instead."""

    def __init__(self):
        self.received: list[int] = []

    def __call__(self, signum, frame):
        self.received.append(signum)
        raise KeyboardInterrupt


def _note_interrupts(read_only: bool = False):
    """Install a fresh _Interrupt for this command (main thread, Python's own handler in place), and
    an unraisable hook that drops the lost KeyboardInterrupt's "Exception ignored" traceback (the
    note carries it); a `read_only` command gets `_interrupted_now` instead. Returns the function
    that puts both back."""
    import threading

    old, old_hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    if threading.current_thread() is not threading.main_thread() or \
            (old not in (signal.default_int_handler, _interrupted_now) and not isinstance(old, _Interrupt)):
        return lambda: None

    def unraisable(u):
        if not issubclass(u.exc_type, KeyboardInterrupt):
            old_hook(u)

    signal.signal(signal.SIGINT, _interrupted_now if read_only else _Interrupt())
    sys.unraisablehook = unraisable

    def restore():
        signal.signal(signal.SIGINT, old)
        if sys.unraisablehook is unraisable:  # not a filter installed on top for the rest of the process
            sys.unraisablehook = old_hook
    return restore


class _ClosedStdoutIgnored:
    """sys.stdout whose reader may go away (`jaxpar train ... | head`): the first write that finds
    the pipe closed points fd 1 at /dev/null, so progress goes nowhere and the run goes on to its
    checkpoint (a BrokenPipeError would end it, losing every step since the last one)."""

    def __init__(self, stream):
        self._stream = stream

    def retarget(self, stream) -> None:
        """Guard `stream` from now on (a process joining a job moves its stdout to a new fd)."""
        self._stream = stream

    def _closed(self) -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._stream.fileno())
        os.close(null)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed()
            self._stream.flush()  # what the pipe refused, now to /dev/null

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self._stream, name)


def _error_line(msg: str) -> None:
    """One write per line: under PYTHONUNBUFFERED, print() writes the text and its newline
    separately, and two processes sharing a stderr then join their lines."""
    sys.stderr.write(f"error: {one_line(msg)}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
