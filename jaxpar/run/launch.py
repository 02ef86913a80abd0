"""`jaxpar launch nprocs=N [port=P] [grace=S] -- <command ...>`: run N local processes as one job.

Each child runs `python -m jaxpar.cli <command ...>` with JAXPAR_COORDINATOR /
JAXPAR_NUM_PROCESSES / JAXPAR_PROCESS_ID set; `jaxpar.parallel.mesh.maybe_initialize_distributed`
turns those into `jax.distributed.initialize` with gloo CPU collectives, and each child
emulates mesh-size / N CPU devices. Example (4 devices as 2 processes × 2):

    jaxpar launch nprocs=2 -- train model=gpt2-tiny mesh.data=4 train.steps=5 out=runs/mp

Failure handling: if any child exits non-zero (or is killed), the others get SIGTERM and,
after `grace` seconds, SIGKILL; the launcher exits with the failed child's code (128+signal
for a signal). So a dead rank never leaves the rest hanging in a collective. The ranks die with
the launcher (`die_with_launcher`), so a killed launcher never leaves them training unwatched.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

from gpt2common.grammar import given_twice, parse_kv
from jaxpar.config import ConfigError

KEYS = {"nprocs", "port", "grace"}
MULTI_PROCESS = ("train", "inspect", "eval", "sample", "mesh")  # the commands that join a multi-process job
SETTLE_S = 3.0  # after a rank fails, how long the others get to exit by themselves
LOST_PEER_EXIT = 3  # a rank that cannot reach its peers (jaxpar.run.loop, jaxpar.parallel.mesh): a consequence, not a cause


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    """ConfigError when something already listens on `port` (rank 0's coordinator would die on
    it with a segfault, exit 139, and no word about the port)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ConfigError(f"launch: port={port} cannot be used ({e.strerror}); choose another "
                              "or leave port= out for a free one") from None


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    if "--" not in argv:
        raise ConfigError("launch needs `--` before the command, e.g. jaxpar launch nprocs=2 -- train ...")
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1:]
    raw: dict[str, str] = {}
    for a in opts:
        k, sep, v = a.partition("=")
        if not sep or k not in KEYS:
            raise ConfigError(f"launch: unknown argument {a!r} (valid: nprocs=N, port=P, grace=SECONDS)")
        if k in raw:  # nprocs= twice: the first would be dropped
            raise ConfigError(f"launch: {given_twice(k, raw[k], v)}")
        raw[k] = v
    kv = {}
    for k, v in raw.items():
        try:
            kv[k] = int(v)
        except ValueError:
            raise ConfigError(f"launch: {k}={v!r} is not an integer") from None
    n = kv.get("nprocs", 0)
    if n < 1:
        raise ConfigError(f"launch: nprocs={n} must be >= 1")
    if not 0 <= kv.get("port", 0) <= 65535:
        raise ConfigError(f"launch: port={kv['port']} must be in 1..65535 (0 or none: a free one)")
    if kv.get("grace", 0) < 0:  # a negative wait was taken: the ranks got SIGKILL at once
        raise ConfigError(f"launch: grace={kv['grace']} must be >= 0")
    if not cmd:
        raise ConfigError("launch: no command after `--`")
    if cmd[0] not in MULTI_PROCESS:  # `prepare` would race its ranks on one out; `launch`, a fork bomb
        raise ConfigError(f"launch: {cmd[0]!r} does not run as several processes "
                          f"(launch runs {', '.join(MULTI_PROCESS)})")
    return kv, cmd


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ENV_LAUNCHER_PID = "JAXPAR_LAUNCHER_PID"  # set by `launch` in each rank's environment


def die_with_launcher(env=os.environ) -> None:
    """In a rank started by `launch` (the CLI calls this first): have the kernel SIGKILL this
    process when the launcher dies, by any signal, kill -9 included (Linux prctl
    PR_SET_PDEATHSIG). Otherwise ranks whose launcher was killed go on training under init, and
    the next `resume=true` of their run is a second writer. SIGKILL, not SIGTERM: nobody is left
    to end a rank that a SIGTERM does not stop (one waiting in a collective); orbax's temporary
    dirs keep the last complete checkpoint intact. Set at startup, not in a preexec_fn (Python
    run between fork and exec); a launcher already gone by then ends the rank at once."""
    launcher = env.pop(ENV_LAUNCHER_PID, None)  # not for the rank's own children
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if str(os.getppid()) != launcher:  # the launcher died before the prctl: no signal will come
        os._exit(128 + signal.SIGKILL)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def precheck(cmd: list[str], n: int) -> None:
    """Settings and input errors of a command, found here once, before any process starts:
    otherwise every rank would report the same error (or none would start right)."""
    from gpt2common import hf
    from jaxpar import config as C
    from jaxpar.config import split_config_flag
    from jaxpar.parallel.mesh import mesh_size
    from jaxpar.run.rundir import resolve_train, run_config

    path, rest = split_config_flag(cmd[1:])
    if cmd[0] in ("eval", "sample"):  # the model to load: a run dir's config.json, an HF dir's
        from jaxpar.run.options import ONCE_KEYS

        kv = parse_kv(rest, once=ONCE_KEYS[cmd[0]])
        if kv.get("checkpoint"):
            run_config(kv["checkpoint"])
        if kv.get("hf"):
            hf.load_hf_config(kv["hf"], "hf")
        return
    if cmd[0] not in ("train", "inspect", "mesh"):
        return
    cfg = C.resolve(rest, path) if cmd[0] == "mesh" else resolve_train(parse_kv(rest), path, cmd[0] == "train")
    if cfg.init and cmd[0] != "mesh":
        hf.load_hf_config(cfg.init, "init")
    if cmd[0] == "train":
        _check_inputs(cfg)
    sizes = dataclasses.asdict(cfg.mesh)
    if -1 not in sizes.values() and mesh_size(cfg.mesh) % n:
        shown = "×".join(f"{k}={v}" for k, v in sizes.items())
        raise ConfigError(f"mesh {shown} ({mesh_size(cfg.mesh)} devices) cannot be split evenly over {n} processes")


def _check_inputs(cfg) -> None:
    """The inputs a train reads besides init=, checked without reading them whole: each rank would
    report the same error (plan=, init_state=), or process 0 alone while the others wait on it (data=)."""
    from gpt2common import data as data_lib
    from gpt2common.state import forget_loaded
    from jaxpar.planner.plan import load_plan
    from jaxpar.run.handoff import check_init_state

    data_lib.check_data(cfg.data, cfg.tokenizer, cfg.out)
    if cfg.plan and cfg.plan != "auto":
        load_plan(cfg.plan)
    check_init_state(cfg)
    forget_loaded()  # the ranks read the state themselves


def main(argv: list[str]) -> int:
    kv, cmd = parse(argv)
    n, grace = kv["nprocs"], kv.get("grace", 10)
    precheck(cmd, n)
    if kv.get("port"):
        check_port_free(kv["port"])
    port = kv.get("port") or free_port()
    procs: list[subprocess.Popen] = []
    for rank in range(n):
        env = dict(os.environ, JAXPAR_COORDINATOR=f"127.0.0.1:{port}", JAXPAR_NUM_PROCESSES=str(n),
                   JAXPAR_PROCESS_ID=str(rank), **{ENV_LAUNCHER_PID: str(os.getpid())})
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxpar.cli", *cmd], env=env))

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    forwarded = []

    def forward(signum, frame):  # Ctrl-C / SIGTERM: every child stops at its next step (checkpoint)
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for s in old:
        signal.signal(s, forward)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and not forwarded:
                # Ranks that fail together (a bad input all of them see, a non-finite step) exit
                # on their own within moments, each having decided alone; a rank that lost a
                # dead peer exits with LOST_PEER_EXIT. Only a rank still running needs stopping.
                settle = time.monotonic() + min(grace, SETTLE_S)
                while time.monotonic() < settle and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                codes = [p.poll() for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                rank, code = min(failed, key=lambda rc: rc[1] == LOST_PEER_EXIT)  # the root cause first
                alive = [r for r, c in enumerate(codes) if c is None]
                # Exit code 2 is a user error its rank has already put in one line; say nothing more.
                if alive or _exit_code(code) != 2:
                    sys.stderr.write(f"error: process {rank} exited with code {_exit_code(code)}"
                                     + (f"; stopping processes {', '.join(map(str, alive))}" if alive else "") + "\n")
                    sys.stderr.flush()
                stop_all()
                return _exit_code(code) or 1
            if all(c is not None for c in codes):
                return max((_exit_code(c) for c in codes), default=0)
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if any(p.poll() is None for p in procs):
            stop_all(signal.SIGKILL)
