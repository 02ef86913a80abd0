"""GPU lane: `jaxpar train` takes the GPU untold and trains gpt2-tiny and the gpt2 preset a few steps.

Every run is a CLI subprocess with `gpu_env()`: jax's own platform choice, the GPU, as for a user.
"""

from __future__ import annotations

import json
import math

import pytest
from support.gpu import TINY, gpu_env, jaxpar, losses, require_gpu

pytestmark = pytest.mark.gpu

@pytest.fixture(autouse=True, scope="module")
def _gpu():
    require_gpu()


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
