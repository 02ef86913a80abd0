"""What every torchref process shares: the job description, the data shard of each step,
metrics writing, the torch.distributed process group, fault injection and the per-process
summary (peak memory, bytes) that `compare` reads.

A `Job` is written to `<out>/job.json` by the launcher; forked workers get it in memory,
mpiexec-launched ones read the file (`python -m torchref.worker <out>/job.json`).
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import time
from dataclasses import dataclass

import numpy as np
import torch

from gpt2common.writes import open_new, refused_write, write_atomic
from torchref.config import RefConfig, ref_from_dict, ref_to_dict
from torchref.run_config import RunConfig, run_from_dict, run_to_dict


@dataclass(frozen=True)
class Job:
    cfg: RunConfig
    ref: RefConfig
    data_dir: str  # prepared dir (train.bin/val.bin/meta.json)
    init_dir: str  # HF dir with the initial weights
    out: str
    port: int = 0  # TCP port of the torch.distributed rendezvous

    def to_json(self) -> str:
        return json.dumps({"cfg": run_to_dict(self.cfg), "ref": ref_to_dict(self.ref), "data_dir": self.data_dir,
                           "init_dir": self.init_dir, "out": self.out, "port": self.port}, indent=2)

    @staticmethod
    def from_json(s: str) -> Job:
        d = json.loads(s)
        return Job(run_from_dict(d["cfg"]), ref_from_dict(d["ref"]), d["data_dir"], d["init_dir"], d["out"], d["port"])


RENDEZVOUS_HOST = "127.0.0.1"  # every rank of a torchref job runs on this host


class Context:
    """One process's view of the job: its rank, the data, the initial weights."""

    def __init__(self, job: Job, rank: int, world: int):
        from gpt2common.data import Dataset

        self.job, self.rank, self.world = job, rank, world
        self.cfg, self.ref, self.t = job.cfg, job.ref, job.cfg.train
        self.ds = Dataset.open(job.data_dir, job.cfg.model.vocab_size, job.cfg.train.seq_len)
        torch.set_num_threads(int(os.environ.get("TORCHREF_THREADS", "1")))
        torch.manual_seed(job.cfg.seed)
        # The device the config names (CPU unless device=cuda: one GPU per process), never CUDA
        # because it exists: a GPU machine runs the same CPU job as any other unless asked.
        self.backend = job.ref.dist_backend
        if job.ref.device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    # ---------------------------------------------------------------- data
    def global_batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The global batch of 0-based step `step`, identical to jaxpar's: int32 (B, T) each."""
        from gpt2common.data import train_batch

        return train_batch(self.ds, self.t.seq_len, self.t.batch_size, self.cfg.seed, step)

    def shard(self, step: int, worker: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows worker*B/n .. (worker+1)*B/n of the global batch, as int64 (B/n, T) tensors."""
        x, y = self.global_batch(step)
        b = self.t.batch_size // n
        sl = slice(worker * b, (worker + 1) * b)
        return (torch.from_numpy(x[sl].astype(np.int64)).to(self.device),
                torch.from_numpy(y[sl].astype(np.int64)).to(self.device))

    def microbatches(self, step: int, worker: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`train.grad_accum` = A microbatches of this worker's shard, rows a, a+A, a+2A, ... for
        microbatch a (jaxpar strides the same way). Each is (B/(n*A), T); the mean of the A
        microbatch means is the shard's mean because they all hold the same number of rows."""
        x, y = self.shard(step, worker, n)
        a = self.t.grad_accum
        return [(x[i::a], y[i::a]) for i in range(a)]

    def hf_config(self) -> dict:
        with open(os.path.join(self.job.init_dir, "config.json")) as f:
            return json.load(f)

    def init_state_dict(self) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(os.path.join(self.job.init_dir, "model.safetensors"))

    def maybe_crash(self, worker: int, step: int) -> None:
        """Fault injection for the dying-worker test: `debug.crash_rank=w debug.crash_step=s`."""
        d = self.ref.debug
        if d.crash_rank == worker and d.crash_step == step:
            os._exit(17)

    # ---------------------------------------------------------------- torch.distributed
    def init_process_group(self) -> None:
        """Rendezvous through a TCPStore on 127.0.0.1 only. torch's own store (init_method=tcp://)
        listens on every interface, whatever host it is given, so any host that reaches this one
        could join the job: rank 0 binds the socket itself and hands it to the store."""
        import socket

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.ref.timeout_s)
        host, port = RENDEZVOUS_HOST, self.job.port
        listen_fd = None
        if self.rank == 0:
            self._store_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._store_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._store_socket.bind((host, port))
            self._store_socket.listen()
            listen_fd = self._store_socket.fileno()
        store = dist.TCPStore(host, port, self.world, self.rank == 0, timeout, master_listen_fd=listen_fd)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)

    def amp_context(self):
        """autocast for the -amp strategies (Apex AMP O1's successor); a no-op otherwise."""
        import contextlib

        if not self.ref.is_amp:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.ref.amp.dtype == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def grad_scaler(self):
        """GradScaler (dynamic loss scaling) for amp.dtype=fp16; None otherwise."""
        if self.ref.is_amp and self.ref.amp.dtype == "fp16":
            return torch.amp.GradScaler(self.device.type)
        return None

    # ---------------------------------------------------------------- outputs
    def save_grads(self, step: int, named_grads: dict[str, torch.Tensor]) -> None:
        """`debug.grad_step=K`: the averaged (pre-clip) gradient of step K, HF names, float32."""
        if self.ref.debug.grad_step != step:
            return
        from safetensors.numpy import save

        # serialised here, written by write_atomic: a refused write names its file (save_file does not)
        write_atomic(os.path.join(self.job.out, f"grads_step{step}.safetensors"),
                     save({n: g.detach().float().cpu().numpy().copy() for n, g in named_grads.items()}))

    def write_summary(self, role: str, **extra) -> None:
        """Per-process summary: peak RSS and totals; `compare` and the launcher read these."""
        os.makedirs(os.path.join(self.job.out, "procs"), exist_ok=True)
        d = {"rank": self.rank, "role": role, "device": str(self.device),
             "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            d["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        d.update(extra)
        write_atomic(os.path.join(self.job.out, "procs", f"rank{self.rank}.json"), json.dumps(d))


class Metrics:
    """Appends one JSON object per step to <out>/metrics.jsonl (only the writer process owns one)."""

    def __init__(self, ctx: Context, **static):
        self.ctx, self.static = ctx, static
        self.path = os.path.join(ctx.job.out, "metrics.jsonl")
        self.f = open_new(self.path, append=True)  # never through a link; closed by close()
        self.tokens = ctx.t.batch_size * ctx.t.seq_len

    def log(self, step: int, loss: float, step_time: float, **fields) -> None:
        rec = {"step": step, "loss": float(loss), "tokens_per_s": self.tokens / max(step_time, 1e-12),
               "step_time_s": step_time}
        rec.update(fields)
        rec.update(self.static)
        # a full disk or a file-size limit: the rank ends with one line (rank_exit.end_rank)
        with refused_write(self.path, step):
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
        t = self.ctx.t
        if t.log_every and (step % t.log_every == 0 or step == t.steps):
            print(f"step {step}/{t.steps}  loss {loss:.4f}  {rec['tokens_per_s']:.0f} tok/s  "
                  f"{step_time * 1e3:.0f} ms", flush=True)

    def close(self) -> None:
        self.f.close()


def timer() -> float:
    return time.perf_counter()
