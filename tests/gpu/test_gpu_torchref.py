"""GPU lane: torchref's `single` strategy on CUDA against jaxpar on the GPU, fp32, gpt2-tiny: the
10 losses and every step-1 gradient (the parity row users read first: one GPU, each framework).

torchref runs with `device=cuda` (it never moves there on its own); jaxpar's side is
tests/support/jaxpar_reference.py on the GPU. Bounds: parity.fp32.* (jaxpar/tolerances.py: the
two frameworks' fp32 sums in different orders), the same table as the CPU parity rows.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from support.gpu import cpu_env, gpu_env, require_gpu, require_torch_cuda

from jaxpar.tolerances import TRAJECTORY

pytestmark = pytest.mark.gpu

STEPS = 10
BASE = ["model=gpt2-tiny", "train.seq_len=32", "train.batch_size=8", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.lr=1e-3"]


@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()
    require_torch_cuda()


def test_torchref_single_on_cuda_equals_jaxpar_on_the_gpu(tmp_path):
    from safetensors.numpy import load_file
    from support import jaxpar_reference

    out = tmp_path / "torchref"
    r = subprocess.run([sys.executable, "-m", "torchref", "train", *BASE, "strategy=single", "device=cuda",
                        "debug.grad_step=1", "train.log_every=0", f"out={out}"], capture_output=True, text=True,
                       env=cpu_env(), timeout=300)  # torch needs no jax platform; CUDA by device=cuda
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "procs" / "rank0.json").read_text())["device"] == "cuda:0"
    losses = np.array([json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()])
    grads = load_file(str(out / "grads_step1.safetensors"))
    ref = jaxpar_reference.run(str(out / "data"), str(tmp_path / "jaxpar.npz"), BASE, gpu_env())
    tol = TRAJECTORY["fp32"]
    assert len(losses) == len(ref["losses"]) == STEPS
    worst_loss = float(np.max(np.abs(losses - ref["losses"]) / ref["losses"]))
    assert worst_loss <= tol["loss_rel"], (losses, ref["losses"])
    assert grads.keys() == ref["grads"].keys() and len(grads) == 4 + 12 * 2
    worst = max((float(np.max(np.abs(grads[k] - ref["grads"][k])) / np.max(np.abs(ref["grads"][k]))), k)
                for k in grads)
    assert worst[0] <= tol["grad_rel"], worst
