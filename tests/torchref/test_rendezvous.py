"""torchref's rendezvous listens on 127.0.0.1 only (torch's tcp:// store listens on every
interface whatever host it is given): two real processes meet through
`Context.init_process_group`, and rank 0's listening sockets are read from /proc.

Independent reference: the kernel's socket table."""

from __future__ import annotations

import json
import subprocess
import sys

from support.cli_helpers import clean_env

from torchref.launch import free_port

# One rank: Context.init_process_group with only the attributes it reads, then an all-reduce
# (gloo's own connections up too) and rank 0's listening sockets as JSON.
RANK = """
import json, os, sys, types
sys.path.insert(0, "tests")
import torch, torch.distributed as dist
from support.cli_helpers import listening
from torchref.runtime import Context
rank, port = int(sys.argv[1]), int(sys.argv[2])
ctx = types.SimpleNamespace(rank=rank, world=2, backend="gloo", job=types.SimpleNamespace(port=port),
                            ref=types.SimpleNamespace(timeout_s=60))
Context.init_process_group(ctx)
t = torch.ones(1)
dist.all_reduce(t)
if rank == 0:
    print(json.dumps(sorted(listening(os.getpid()))))
dist.barrier()
dist.destroy_process_group()
"""


def test_the_store_listens_on_localhost_only():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=clean_env()) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    found = {tuple(x) for x in json.loads(outs[0][0])}
    assert ("127.0.0.1", port) in found
    assert {a for a, _ in found} == {"127.0.0.1"}, found
