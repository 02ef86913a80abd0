"""GPU lane: `jaxpar train` on the GPU (gpt2-tiny and the gpt2 preset, a few steps), a checkpoint
written on the GPU evaluated and sampled on the CPU, and one written on the CPU resumed on the GPU.

Every run is a CLI subprocess: `gpu_env()` leaves jax its own platform choice (the GPU, as for a
user), `cpu_env()` pins the CPU. Bounds: the fp32 cross-implementation ones (parity.fp32.loss,
jaxpar/tolerances.py: fp32 sums in different orders), since GPU and CPU kernels sum differently.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
from support.gpu import cpu_env, gpu_env, require_gpu

from jaxpar.run.rundir import checkpoint_steps
from jaxpar.tolerances import TRAJECTORY

pytestmark = pytest.mark.gpu

FP32 = TRAJECTORY["fp32"]["loss_rel"]
TINY = ["model=gpt2-tiny", "train.batch_size=8", "train.seq_len=64", "train.eval_every=0", "progress=none",
        "train.log_every=1"]


@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()


def jaxpar(args: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "jaxpar.cli", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_cli_takes_the_gpu_without_being_told():
    """No JAX_PLATFORMS, no flag: `jaxpar mesh` lists the GPU (and the GPU XLA flags were accepted)."""
    r = jaxpar(["mesh"], gpu_env())
    assert "gpu:" in r.stdout or "cuda:" in r.stdout, r.stdout


def test_train_gpt2_tiny_on_the_gpu(tmp_path):
    out = tmp_path / "tiny"
    jaxpar(["train", *TINY, "train.steps=20", f"out={out}"], gpu_env())
    ls = losses(out)
    assert len(ls) == 20 and all(math.isfinite(x) for x in ls)
    assert ls[-1] < ls[0] - 0.5  # it learns on the built-in corpus


def test_train_the_gpt2_preset_a_few_steps_on_the_gpu(tmp_path):
    """GPT-2 124M, bf16, 3 steps of B4 x T256 on the byte-level corpus: finite, first loss at
    ln(50257) + s^2/2 (s^2 = 4e-4 * 768: the init's logit variance), MFU logged."""
    out = tmp_path / "gpt2"
    jaxpar(["train", "model=gpt2", "precision=bf16", "train.batch_size=4", "train.seq_len=256", "train.steps=3",
            "train.eval_every=0", "progress=none", f"out={out}"], gpu_env(), timeout=300)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert abs(recs[0]["loss"] - (math.log(50257) + 2e-4 * 768)) < 0.15, recs[0]
    assert all(math.isfinite(r["loss"]) and 0 < r["mfu"] < 1 for r in recs)


def test_a_gpu_checkpoint_evaluates_and_samples_on_the_cpu(tmp_path):
    out, data = tmp_path / "run", tmp_path / "data"
    jaxpar(["prepare", f"out={data}"], cpu_env())
    jaxpar(["train", *TINY, "precision=fp32", "train.steps=5", f"data={data}", f"out={out}"], gpu_env())
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
