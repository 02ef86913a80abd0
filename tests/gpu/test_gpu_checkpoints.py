"""GPU lane: a checkpoint written on the GPU evaluated and sampled on the CPU, and one written on
the CPU resumed on the GPU, through the CLI.

`gpu_env()` leaves jax its own platform choice (the GPU), `cpu_env()` pins the CPU. Bounds: the fp32
cross-implementation ones (parity.fp32.loss, jaxpar/tolerances.py: fp32 sums in different orders),
since GPU and CPU kernels sum differently.
"""

from __future__ import annotations

import json
import shutil

import pytest
from support.gpu import TINY, cpu_env, gpu_env, jaxpar, losses, require_gpu

from jaxpar.run.rundir import checkpoint_steps
from jaxpar.tolerances import TRAJECTORY

pytestmark = pytest.mark.gpu

FP32 = TRAJECTORY["fp32"]["loss_rel"]


@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()


def test_a_gpu_checkpoint_evaluates_and_samples_on_the_cpu(tmp_path):
    out = tmp_path / "run"
    jaxpar(["train", *TINY, "precision=fp32", "train.steps=5", f"out={out}"], gpu_env())
    data = out / "data"  # the built-in corpus, prepared by the run
    ev = {name: json.loads(jaxpar(["eval", f"checkpoint={out}", f"data={data}", "eval.windows=32"], env).stdout)
          for name, env in (("cpu", cpu_env()), ("gpu", gpu_env()))}
    assert ev["cpu"].keys() == ev["gpu"].keys() and "loss" in ev["cpu"]
    assert abs(ev["cpu"]["loss"] - ev["gpu"]["loss"]) / ev["gpu"]["loss"] <= FP32, ev
    text = jaxpar(["sample", f"checkpoint={out}", "prompt=ROMEO:", "max_new_tokens=16", "seed=3"], cpu_env()).stdout
    assert text.startswith("ROMEO:") and len(text.rstrip("\n")) >= len("ROMEO:") + 1


def test_a_cpu_checkpoint_resumes_on_the_gpu(tmp_path):
    """3 steps on the CPU, then resume=true to step 5 on the GPU: steps 4 and 5 within the fp32
    cross-implementation bound of a copy of the same checkpoint resumed on the CPU (the lr schedule
    follows train.steps, so the reference resumes too)."""
    both, cpu_only = tmp_path / "both", tmp_path / "cpu"
    fp32 = [*TINY, "precision=fp32"]
    jaxpar(["train", *fp32, "train.steps=3", f"out={both}"], cpu_env())
    assert checkpoint_steps(str(both)) == [3]
    shutil.copytree(both, cpu_only)
    jaxpar(["train", *fp32, "train.steps=5", f"out={both}", "resume=true"], gpu_env())
    jaxpar(["train", *fp32, "train.steps=5", f"out={cpu_only}", "resume=true"], cpu_env())
    assert checkpoint_steps(str(both))[-1] == checkpoint_steps(str(cpu_only))[-1] == 5
    got, want = losses(both), losses(cpu_only)
    assert len(got) == len(want) == 5 and got[:3] == want[:3]  # steps 1-3: the one CPU run, copied
    worst = max(abs(a - b) / b for a, b in zip(got[3:], want[3:], strict=True))
    assert worst <= FP32, (got, want)
