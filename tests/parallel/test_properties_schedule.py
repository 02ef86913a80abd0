"""Property-based test (hypothesis) of the learning-rate schedule's README claim over its whole
domain: any run length (to 10**7 steps), warmup (longer than the run included), peak lr and
min_lr_ratio, not only parity_tests/test_schedule.py's grid (steps <= 300 at lr 6e-4).

The definition (gpt2common/optim.py, torchref.model.lr_at): W = min(warmup_steps, steps),
lr(s) = lr·(s+1)/(W+1) for s < W, then a cosine from lr to lr·min_lr_ratio over max(steps-W, 1).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxpar.config import TrainConfig
from jaxpar.train import lr_schedule

pytest.importorskip("torch")  # torchref.model imports torch (the [torch] extra)
from torchref.model import lr_at  # noqa: E402

N_STEPS = 16  # steps evaluated per drawn run: one padded int32 shape, so jaxpar's eager ops compile once


def _closed_form(t: TrainConfig, s: int) -> float:
    """The written definition, in Python floats (fp64), step by step."""
    W = min(t.warmup_steps, t.steps)
    if s < W:
        return t.lr * (s + 1) / (W + 1)
    D = max(t.steps - W, 1)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * min(s - W, D) / D)) / 2)


@st.composite
def runs(draw):
    steps = draw(st.integers(1, 10**7) | st.integers(1, 50))
    warmup = draw(st.sampled_from([0, 1, steps - 1, steps, steps + 1]) | st.integers(0, 2 * steps))
    t = TrainConfig(steps=steps, warmup_steps=warmup, lr=draw(st.floats(1e-6, 1.0)),
                    min_lr_ratio=draw(st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)))
    W = min(warmup, steps)
    # the run's landmarks (first step, the last warmup step, the peak, the last step) and any others
    edges = [0, W - 1, W, W + 1, steps - 1]
    ss = draw(st.lists(st.integers(0, steps - 1), min_size=N_STEPS, max_size=N_STEPS))
    return t, sorted({s for s in edges if 0 <= s < steps} | set(ss[: N_STEPS - 5]))


@settings(max_examples=100, deadline=None)
@example(run=(TrainConfig(steps=5, warmup_steps=100, lr=6e-4), [0, 2, 4]))  # warmup over min(100, 5) = 5
@example(run=(TrainConfig(steps=10_000_000, warmup_steps=2000, lr=1.0, min_lr_ratio=0.0), [1999, 2000, 9_999_999]))
@given(run=runs())
def test_the_schedule_is_its_definition_in_both_frameworks(run):
    """torchref's lr_at is the closed form to fp64 rounding; jaxpar's optax-built schedule (fp32)
    agrees with it within 1e-6·lr, parity_tests/test_schedule.py's bound; every value lies in
    [lr·min_lr_ratio, lr] after the warmup and rises by lr/(W+1) per step inside it."""
    t, steps = run
    s = np.asarray(steps)
    want = np.array([_closed_form(t, int(k)) for k in s])
    got_t = lr_at(t, s)
    np.testing.assert_allclose(got_t, want, rtol=1e-12, atol=1e-15 * t.lr)
    counts = np.zeros(N_STEPS, np.int32)
    counts[: len(s)] = s
    got_j = np.asarray(lr_schedule(t)(jnp.asarray(counts)), np.float64)[: len(s)]
    assert np.abs(got_j - got_t).max() <= 1e-6 * t.lr, (t, s, got_j, got_t)
    W = min(t.warmup_steps, t.steps)
    warm, after = s < W, s >= W
    assert np.all(got_t[warm] == t.lr * (s[warm] + 1) / (W + 1))
    assert np.all(got_t[after] <= t.lr * (1 + 1e-15)) and np.all(got_t[after] >= t.lr * t.min_lr_ratio * (1 - 1e-15))
