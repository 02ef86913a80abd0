"""Entry point of one mpiexec-launched process: `mpiexec -n N python -m torchref.worker JOB.json`.

(Forked strategies do not come through here; the launcher calls `run_process` directly.)
A failure on any rank calls MPI_Abort, so mpiexec tears the other ranks down at once.
"""

from __future__ import annotations

import os
import sys
import traceback

from gpt2common.writes import open_fd


def run_process(job, rank: int, world: int) -> None:
    from torchref import strategies
    from torchref.runtime import Context

    ctx = Context(job, rank, world)
    strategies.get(job.ref.strategy).run(ctx)


def main() -> None:
    from mpi4py import MPI

    from torchref.runtime import Job

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        with open(sys.argv[1]) as f:
            job = Job.from_json(f.read())
        log = os.path.join(job.out, "logs", f"rank{rank}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        # Only rank 0 talks on stdout (progress lines); everyone's stderr goes to its log.
        fd = open_fd(log)  # a new file: never through a link
        os.dup2(fd, 2)
        if rank != 0:
            os.dup2(fd, 1)
        run_process(job, rank, comm.Get_size())
    except BaseException as e:  # noqa: BLE001 - any failure must end this rank
        from torchref.rank_exit import end_rank

        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(end_rank(e))


if __name__ == "__main__":
    main()
