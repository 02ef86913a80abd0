"""Import watch for tests/torchref/test_torchref_no_jax.py, active only where that test puts this folder
on PYTHONPATH (Python imports `sitecustomize` from sys.path at start-up).

In a process whose `sys.argv[0]` ends with one of $JAXFREE_WATCH (comma-separated, e.g.
`torchref/zygote.py,torchref/worker.py`), it writes into $JAXFREE_DIR:
  watched.<pid>            once per process, at its first import: proof the watch ran there
  forbidden.<pid>          at the first import of a package in $JAXFREE_FORBID: its name and the
                           Python stack that asked for it (what the test prints on failure)
It records, never blocks: a blocked import could be swallowed by an `except ImportError`.
A forked child has a new pid, so it writes its own `watched` file at its first new import;
modules it inherited from its parent were checked in the parent.
"""

import os
import sys
import traceback

_DIR = os.environ.get("JAXFREE_DIR", "")
_WATCH = tuple(s for s in os.environ.get("JAXFREE_WATCH", "").split(",") if s)
_FORBID = frozenset(s for s in os.environ.get("JAXFREE_FORBID", "jax,jaxlib").split(",") if s)
_seen: set[int] = set()
_reported: set[int] = set()


class _ImportWatch:
    """A meta-path finder that only looks: returns None so the normal finders do the import."""

    def find_spec(self, name, path=None, target=None):
        argv0 = sys.argv[0] if sys.argv else ""
        if not argv0.endswith(_WATCH):
            return None
        pid = os.getpid()
        if pid not in _seen:
            _seen.add(pid)
            with open(os.path.join(_DIR, f"watched.{pid}"), "w") as f:
                f.write(argv0)
        if name.partition(".")[0] in _FORBID and pid not in _reported:
            _reported.add(pid)
            with open(os.path.join(_DIR, f"forbidden.{pid}"), "w") as f:
                f.write(f"{argv0} (pid {pid}) imported {name}:\n" + "".join(traceback.format_stack()[:-1]))
        return None


if _DIR and _WATCH:
    sys.meta_path.insert(0, _ImportWatch())
