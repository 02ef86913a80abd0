"""The learning-rate schedule: jaxpar (optax parts, `jaxpar.train.lr_schedule`) against torchref's
independent implementation (`torchref.model.lr_at`, numpy from the written definition), value by
value at every step of every run on a grid of (train.steps, train.warmup_steps, train.min_lr_ratio).

Default run: every steps in 1..300 against the warmups where the definition has its edges
(0, 1, steps-1, steps, steps+1, 100) plus a strided sweep of the rest (~6k runs, a few
seconds). `-m slow`: the whole grid, steps 1..300 x warmup 0..400 x min_lr_ratio {0, 0.1, 1}.

Bound: optax evaluates in fp32, torchref in fp64; 1 + cos(.) near the end of a cosine to 0 loses
relative precision, so the error is bounded relative to the peak lr: 1e-6 * lr (~17 fp32 ulps of
the peak). A schedule bug moves a value by at least lr / 400 (one warmup step) = 2.5e-3 * lr.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import TrainConfig
from jaxpar.train import lr_schedule
from torchref.model import lr_at

LR = 6e-4
RATIOS = (0.0, 0.1, 1.0)
MAX_STEPS = 300
BOUND = 1e-6 * LR
COUNTS = jnp.arange(MAX_STEPS)  # one padded shape, so the eager ops compile once


def _compare(grid) -> int:
    """Max |jaxpar - torchref| over each run's steps 0..steps-1; asserts BOUND. Returns runs checked."""
    n = 0
    for steps, warmup, ratio in grid:
        tc = TrainConfig(steps=steps, warmup_steps=warmup, min_lr_ratio=ratio, lr=LR)
        want = np.asarray(lr_schedule(tc)(COUNTS), np.float64)[:steps]
        got = lr_at(tc, np.arange(steps))
        err = np.abs(got - want)
        assert err.max() <= BOUND, (dataclasses.asdict(tc), int(err.argmax()), got[err.argmax()], want[err.argmax()])
        n += 1
    return n


def _edges():
    for steps in range(1, MAX_STEPS + 1):
        for warmup in sorted({0, 1, max(steps - 1, 0), steps, steps + 1, 100}):
            for ratio in RATIOS:
                yield steps, warmup, ratio
    for steps in range(1, MAX_STEPS + 1, 13):
        for warmup in range(0, 401, 29):
            for ratio in RATIOS:
                yield steps, warmup, ratio


def test_schedules_agree_on_the_edges_of_the_grid():
    assert _compare(_edges()) > 5_000


@pytest.mark.slow
def test_schedules_agree_on_the_whole_grid():
    grid = ((s, w, r) for s in range(1, MAX_STEPS + 1) for w in range(0, 401) for r in RATIOS)
    assert _compare(grid) == 300 * 401 * 3


def test_the_definition_by_hand():
    """The documented definition's landmarks, in both implementations (numbers, not a comparison)."""
    short = TrainConfig(steps=5, warmup_steps=100, lr=LR)  # the run: warmup over min(100, 5) = 5
    assert lr_at(short, 2) == pytest.approx(LR * 3 / 6, rel=1e-12)
    assert float(lr_schedule(short)(2)) == pytest.approx(LR * 3 / 6, rel=1e-6)
    one = TrainConfig(steps=1, lr=LR)  # default warmup: the one update of a 1-step run is not a no-op
    assert lr_at(one, 0) == pytest.approx(LR / 2, rel=1e-12)
    assert float(lr_schedule(one)(0)) == pytest.approx(LR / 2, rel=1e-6)
    long = TrainConfig(steps=300, warmup_steps=100, lr=LR, min_lr_ratio=0.1)
    for s, want in ((0, LR / 101), (50, LR * 51 / 101), (99, LR * 100 / 101), (100, LR), (200, LR * 0.55), (299, LR * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 199 / 200))))):
        assert lr_at(long, s) == pytest.approx(want, rel=1e-12, abs=1e-18)
        assert float(lr_schedule(long)(s)) == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert lr_at(TrainConfig(steps=10, warmup_steps=0, lr=LR), 0) == LR  # no warmup: start at the peak
