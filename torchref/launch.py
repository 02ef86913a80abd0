"""`torchref train`: prepare once, then start the strategy's processes and watch them.

  * fork strategies (single, single-ps, distributed-ps[-amp]): each rank is forked from
    `torchref.zygote`, a clean process that imported torch + transformers once (~7 s on these
    CPUs) and never runs compute or threads (see its docstring for why not fork the launcher
    or use multiprocessing). It persists, so later runs from the same launcher start warm. Rendezvous over TCP on
    127.0.0.1 (gloo on CPU, NCCL when CUDA exists). Equivalent to
    `torchrun --nproc-per-node N` with one process per rank.
  * mpi strategies (horovod[-amp]): `mpiexec -n N python -m torchref.worker <out>/job.json`.

A dying worker never hangs the run: the zygote polls the ranks and, as soon as one exits
non-zero, terminates the others (SIGTERM, then SIGKILL after 5 s); under mpiexec the
failing rank calls MPI_Abort (or is reaped by Hydra), which kills every rank. Collectives also
carry `timeout_s`. Either way the launcher raises `WorkerDied` (CLI: one line, exit 2).
A rank whose write the storage refuses (disk full, quota, file-size limit) ends with exit code 4
and its one-line reason at the end of its log (torchref/rank_exit.py); the launcher raises that as
`WriteFailed` (CLI: one line, exit 4, as for the launcher's own writes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gpt2common.grammar import ConfigError
from gpt2common.writes import open_fd, open_new, write_atomic
from torchref.config import RefConfig, WorkerDied, ref_to_dict
from torchref.run_config import RunConfig, run_to_dict

GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_mpi() -> str:
    """Path of mpiexec; ConfigError saying how to install when mpiexec or mpi4py is missing."""
    missing = [name for name, ok in (("mpi4py", importlib.util.find_spec("mpi4py") is not None),
                                     ("mpiexec", shutil.which("mpiexec") is not None)) if not ok]
    if missing:
        raise ConfigError(f"strategy=horovod needs {' and '.join(missing)}: "
                          "pip install mpi4py mpich (or pip install -e '.[mpi]')")
    return shutil.which("mpiexec")


# What a torchref run writes into its out dir; a dir holding anything else is not ours to reuse.
RUN_ENTRIES = {"metrics.jsonl", "summary.json", "job.json", "config.json", "procs", "logs", "data", "init", "hf",
               "state"}


def check_out(out: Path) -> None:
    """A run goes into a missing or empty dir, or over a torchref run that did not finish (no
    summary.json); a finished run or a foreign dir is refused, never overwritten. Writes nothing."""
    from gpt2common.outdir import LOCK_FILE, check_free, check_writable

    check_writable(str(out))
    check_free(str(out))
    if not out.is_dir():
        return
    if (out / "summary.json").exists():
        raise ConfigError(f"out={str(out)!r} holds a finished torchref run (summary.json); choose another out")
    # A killed run's states (`state_every=`) are its only checkpoints: a restart would remove
    # them, so the out is refused and they stay (init_state= continues one in another out).
    states = sorted((e.name for e in (out / "state").iterdir()), key=lambda n: (len(n), n)) \
        if (out / "state").is_dir() else []
    if states:
        shown = ", ".join(f"state/{n}" for n in states[:3]) + (", ..." if len(states) > 3 else "")
        raise ConfigError(f"out={str(out)!r} holds the training states of an unfinished torchref run ({shown}); "
                          "continue one with init_state=<that dir> and another out, or choose another out")
    foreign = sorted(e.name for e in out.iterdir()
                     if e.name not in RUN_ENTRIES | {LOCK_FILE} and not e.name.startswith("grads_step"))
    if foreign:
        raise ConfigError(f"out={str(out)!r} is not empty and not a torchref run dir (holds {', '.join(foreign[:3])}); "
                          "choose another out")


def prepare(cfg: RunConfig, ref: RefConfig):
    """Everything that can fail with a user error, done once before any process starts."""
    from gpt2common.data import Dataset, resolve_data
    from gpt2common.hf import hf_config_dict, load_hf_config
    from gpt2common.outdir import make_out
    from torchref import handoff
    from torchref.model import initial_state_dict, save_weights
    from torchref.run_config import validate_run
    from torchref.runtime import Job

    out = Path(cfg.out)
    check_out(out)
    manifest = handoff.check(cfg, ref)
    if manifest is not None:  # workers read it after a chdir-free fork or under mpiexec: an absolute path
        cfg = replace(cfg, init_state=os.path.abspath(cfg.init_state))
    if cfg.init:  # the model shape comes from the weights, as in `jaxpar train init=`
        # dropout stays 0 (torchref rejects model.dropout > 0), not the HF config's resid_pdrop: as jaxpar train
        cfg = replace(cfg, model=load_hf_config(cfg.init, "init"))  # an HF dir, or a hub name's cached snapshot
        validate_run(cfg)  # its checks once more: train.seq_len against the weights' n_positions, ...
    # Raw text is tokenized into <out>/data only after its checks (length, vocab) pass, and
    # re-tokenized when data= names another source than the one prepared there.
    data_dir = resolve_data(cfg.data, cfg.tokenizer, str(out), cfg.train.seq_len, cfg.model.vocab_size)
    ds = Dataset.open(data_dir, cfg.model.vocab_size, cfg.train.seq_len)  # validates vocab / length
    if manifest is not None:
        from gpt2common.state import check_data

        check_data(manifest, cfg.init_state, handoff.KEY, len(ds.train))
        weights = handoff.weights(cfg.init_state, manifest)  # checksums checked before the first write
    make_out(str(out))
    for stale in ("metrics.jsonl", "summary.json"):  # a failed earlier attempt's leftovers
        (out / stale).unlink(missing_ok=True)
    for d in ("procs", "logs"):  # never state/: check_out refused an out holding states
        shutil.rmtree(out / d, ignore_errors=True)
    for g in out.glob("grads_step*.safetensors"):
        g.unlink()
    init_dir = str(out / "init")
    save_weights(init_dir, hf_config_dict(cfg.model), weights if manifest is not None else initial_state_dict(cfg))
    job = Job(cfg, ref, os.path.abspath(data_dir), os.path.abspath(init_dir), os.path.abspath(out), free_port())
    write_atomic(out / "job.json", job.to_json())  # never through a link
    write_atomic(out / "config.json", json.dumps({**run_to_dict(cfg), "torchref": ref_to_dict(ref)}, indent=2))
    return job


def _cause_or(job, world: int, died: WorkerDied) -> Exception:
    """What a worker death is reported as: the storage failure behind it (CLI exit 4), the
    non-finite step it stopped at (exit 2, as jaxpar's), else `died`."""
    from gpt2common.writes import WriteFailed
    from torchref.rank_exit import nonfinite_failure, storage_failure

    if (line := storage_failure(job.out, world)) is not None:
        others = f"; stopped the other {world - 1}" if world > 1 else ""
        return WriteFailed(f"strategy={job.ref.strategy}: {line}{others} (logs in {job.out}/logs)")
    if (line := nonfinite_failure(job.out, world)) is not None:
        return ConfigError(f"strategy={job.ref.strategy}: {line}")
    return died


def _child(job, rank: int, world: int) -> None:
    """Body of a forked rank: logs to <out>/logs/rank<r>.log; rank 0 keeps stdout for progress."""
    import traceback

    log = os.path.join(job.out, "logs", f"rank{rank}.log")
    fd = open_fd(log)  # a new file: never through a link
    os.dup2(fd, 2)
    if rank != 0:
        os.dup2(fd, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when ranks stop
    try:
        from torchref.worker import run_process

        run_process(job, rank, world)
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank
        traceback.print_exc()
        sys.stderr.flush()
        from torchref.rank_exit import end_rank

        os._exit(end_rank(e))
    sys.stdout.flush()
    os._exit(0)


_ZYGOTE: tuple | None = None


def _zygote():
    """The warm fork server (torchref.zygote), started once per launcher process."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE[0].poll() is not None:
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "torchref.zygote", str(w)], stdin=subprocess.PIPE,
                                pass_fds=(w,), text=True)
        os.close(w)
        _ZYGOTE = (proc, os.fdopen(r))
    return _ZYGOTE


def run_forked(job, world: int) -> None:
    proc, replies = _zygote()
    try:
        proc.stdin.write(json.dumps({"job": os.path.join(job.out, "job.json"), "world": world}) + "\n")
        proc.stdin.flush()
        line = replies.readline()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    if not line:
        raise RuntimeError("torchref.zygote exited unexpectedly")
    res = json.loads(line)
    if res["status"] != "ok":
        r, c = res["rank"], res["code"]
        why = f"signal {-c}" if c < 0 else f"exit code {c}"
        raise _cause_or(job, world, WorkerDied(f"strategy={job.ref.strategy}: process rank {r} of {world} died "
                                                 f"({why}); stopped the other {world - 1} (logs in {job.out}/logs)"))


def run_mpi(job, world: int) -> None:
    mpiexec = check_mpi()
    log = open_new(os.path.join(job.out, "logs", "mpiexec.log"))  # noqa: SIM115 - closed in finally
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [mpiexec, "-n", str(world), sys.executable, "-m", "torchref.worker", os.path.join(job.out, "job.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True, start_new_session=True)
    try:
        # Rank 0's progress lines come through mpiexec's stdout; Hydra's own banners go to the log.
        for line in proc.stdout:
            if line.startswith("step "):
                print(line, end="", flush=True)
            else:
                log.write(line)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    if rc != 0:
        died = [r for r in range(world) if not os.path.exists(os.path.join(job.out, "procs", f"rank{r}.json"))]
        raise _cause_or(job, world, WorkerDied(
            f"strategy={job.ref.strategy}: an MPI rank died (mpiexec exit code {rc}, unfinished ranks {died}); "
            f"mpiexec stopped the others (logs in {job.out}/logs)"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def train(cfg: RunConfig, ref: RefConfig, on_start: Callable[[], None] | None = None) -> dict:
    """Run one strategy end to end; returns the run summary (also written to <out>/summary.json).
    `on_start` runs once every check passed (`prepare`'s included) and out is held, before any
    worker starts: the CLI prints the config then, so a refused run prints only its `error:` line."""
    from torchref import strategies

    strategy = strategies.get(ref.strategy)
    if strategy.launcher == "mpi":
        check_mpi()
    if ref.ps.async_ and ref.dist_backend == "nccl":
        raise ConfigError("ps.async=true needs backend=gloo (NCCL cannot receive from any source)")
    if ref.device == "cuda" and not _cuda():
        raise ConfigError("device=cuda needs a CUDA GPU (torch.cuda.is_available() is False here)")
    from gpt2common.outdir import hold
    from torchref.handoff import check

    check_out(Path(cfg.out))
    check(cfg, ref)  # a state that cannot continue this run: refused before out is created
    lock = hold(cfg.out)  # this process holds out until the run ends (gpt2common/outdir.py)
    try:
        try:
            job = prepare(cfg, ref)
        except BaseException:  # refused before any worker: an out this run created goes, lock held
            lock.discard(RUN_ENTRIES)
            raise
        if on_start is not None:
            on_start()
        world = strategy.world_size(ref.workers)
        os.makedirs(os.path.join(job.out, "logs"), exist_ok=True)
        t0 = time.perf_counter()
        (run_mpi if strategy.launcher == "mpi" else run_forked)(job, world)
        return summarize(job, world, time.perf_counter() - t0)
    finally:
        lock.release()


def summarize(job, world: int, wall_s: float) -> dict:
    out = Path(job.out)
    procs = [json.loads((out / "procs" / f"rank{r}.json").read_text()) for r in range(world)]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    n_params = sum(int(v.size) for v in __import__("safetensors.numpy").numpy.load_file(
        os.path.join(job.init_dir, "model.safetensors")).values())
    s = {"strategy": job.ref.strategy, "workers": job.ref.workers, "processes": world, "wall_s": wall_s,
         "steps": len(rows), "final_loss": rows[-1]["loss"] if rows else None, "params": n_params,
         "param_bytes": 4 * n_params, "procs": procs, "out": job.out}
    write_atomic(out / "summary.json", json.dumps(s, indent=2))
    return s
