"""A warm, clean process that forks the ranks of the fork strategies.

Why not fork the launcher itself: the launcher may have started threads (JAX, a torch thread
pool, e.g. inside a pytest process that ran jaxpar first) and forking a multithreaded process can
deadlock the child. Why not `multiprocessing` spawn/forkserver: they re-import the caller's
`__main__` in every child. Why not a fresh interpreter per rank: importing torch + transformers
costs ~7 s of CPU per rank. So the launcher starts this module once (`python -m torchref.zygote
REPLY_FD`, a fresh exec), it imports torch + transformers and nothing else runs in it; each
request on stdin (`{"job": <job.json>, "world": W}`) is answered on REPLY_FD after the W forked
ranks have finished:
    {"status": "ok"}  or  {"status": "died", "rank": r, "code": c}   (c < 0: killed by signal -c)
As soon as one rank exits non-zero the others get SIGTERM, then SIGKILL after GRACE_S: a dead
worker never leaves the rest hanging. EOF on stdin (the launcher went away) or SIGTERM stops
the running ranks and the zygote.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

GRACE_S = 5.0
POLL_S = 0.05
_children: dict[int, int] = {}  # pid -> rank


def _kill_all(sig=signal.SIGTERM) -> None:
    for pid in list(_children):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap_all(deadline: float) -> None:
    while _children:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            _children.pop(pid, None)
            continue
        if time.monotonic() > deadline:
            _kill_all(signal.SIGKILL)
            deadline = float("inf")
        time.sleep(POLL_S)


def _shutdown(*_):
    _kill_all()
    _reap_all(time.monotonic() + GRACE_S)
    os._exit(0)


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(job_path: str, world: int, reply_fd: int) -> dict:
    from torchref.launch import _child
    from torchref.runtime import Job

    with open(job_path) as f:
        job = Job.from_json(f.read())
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.close(reply_fd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _child(job, rank, world)  # never returns (os._exit)
        _children[pid] = rank
    result = {"status": "ok"}
    while _children:
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.buffer.peek(1):
            _shutdown()  # the launcher is gone
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            time.sleep(POLL_S)
            continue
        rank, code = _children.pop(pid), _code(status)
        if code != 0 and result["status"] == "ok":
            result = _root_cause({rank: code})
            _kill_all()
            _reap_all(time.monotonic() + GRACE_S)
    return result


def _root_cause(dead: dict[int, int], window_s: float = 0.5) -> dict:
    """The death to report. A rank whose collective fails because a peer is gone exits with 1
    (an exception), so when several ranks die within `window_s` prefer one that exited otherwise
    (a signal or its own exit code): that is the cause, the 1s are its consequences."""
    deadline = time.monotonic() + window_s
    while _children and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            r, c = _children.pop(pid), _code(status)
            if c != 0:
                dead[r] = c
        else:
            time.sleep(POLL_S)
    rank = min(dead, key=lambda r: (dead[r] == 1, r))
    return {"status": "died", "rank": rank, "code": dead[rank]}


def main() -> None:
    reply_fd = int(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides
    signal.signal(signal.SIGTERM, _shutdown)
    import torch  # noqa: F401  (warm imports shared by every forked rank)
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    import torchref.launch
    import torchref.strategies.base
    import torchref.worker  # noqa: F401

    reply = os.fdopen(reply_fd, "w")
    for line in sys.stdin:
        req = json.loads(line)
        reply.write(json.dumps(serve(req["job"], int(req["world"]), reply_fd)) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
