"""pipeline.schedule=1f1b's hand-written backward (jaxpar/parallel/pipeline_1f1b.py: a custom_vjp loss
whose gradient the schedule computes by per-stage jax.vjp) against autodiff of the GPipe forward, for
drawn (stages S, microbatches M, layers L, data replicas): M < S (only the last stage works both
ways in a tick), M = 2S - 1 (the ring exactly full), M > 2S - 1 (the ring wraps), L not a multiple
of S (masked pad layers).

The draws run inside one subprocess on 8 emulated CPU devices (the device count is fixed when JAX
starts), with hypothesis' own fixed-seed settings; a failing draw's smallest example is in the
assertion's stderr tail ("Falsifying example: ..."). Bound: jaxpar.tolerances SHARDED_VS_SINGLE
fp32 ("sharded.fp32.*": the two schedules compute the same products and reorder fp32 sums, the
microbatch accumulation and the cross-stage reductions), as tests/parallel/test_pipeline_1f1b.py.
"""

from __future__ import annotations

import json
import sys

import pytest

# Each example compiles two whole training gradients (GPipe and 1F1B, ~3 s CPU each without XLA's
# optimizations): the default suite runs one explicit example that meets most of the schedule's
# cases at once (a wrapping ring, a masked pad layer, data replicas); `-m slow` adds the M < S
# example and SLOW draws.
SLOW = 20
FAST_EXAMPLES = [{"S": 3, "M": 7, "L": 4, "data": 2}]  # M > 2S - 1: the ring of 5 slots wraps; stages of 2, 1, 1 layers
SLOW_EXAMPLES = [{"S": 2, "M": 1, "L": 3, "data": 1}]  # M < S; stage 1 holds one layer and a masked pad


def _property(n_examples: int) -> dict:
    """Runs the property over `n_examples` draws (plus the explicit ones); returns the cases run."""
    from hypothesis import strategies as st

    # the table-schedule property's check (a sibling file: this worker runs as a script from this
    # directory), with what this one does not draw fixed: no chunks, fsdp or dropout
    from test_properties_schedules import _setup, check_case, run_drawn

    _setup()
    ran = []
    cases = st.integers(2, 4).flatmap(lambda S: st.fixed_dictionaries({
        "S": st.just(S), "M": st.integers(1, 2 * S + 2), "L": st.integers(S, 2 * S),
        "data": st.sampled_from([1, 2] if 2 * S <= 8 else [1])}))

    def prop(c):
        check_case({"sched": "1f1b", "R": 1, "fsdp": 1, "dropout": 0.0, "gather": "step", **c})
        ran.append(c)

    run_drawn(prop, cases, FAST_EXAMPLES, SLOW_EXAMPLES, n_examples)
    return {"cases": ran}


def _run(tmp_path, n):
    from support.cli_helpers import run_worker

    return run_worker(__file__, tmp_path, "prop", str(n))


def test_1f1b_gradients_equal_autodiff_of_gpipe(tmp_path):
    r = _run(tmp_path, 0)
    assert r["cases"] == FAST_EXAMPLES


@pytest.mark.slow
def test_1f1b_gradients_equal_autodiff_of_gpipe_slow(tmp_path):
    r = _run(tmp_path, SLOW)
    assert len(r["cases"]) >= SLOW // 2  # hypothesis may stop early once the space is exhausted
    assert {(c["S"], c["M"]) for c in r["cases"]} >= {(3, 7), (2, 1)}


if __name__ == "__main__":
    kind, out_path, *args = sys.argv[1:]
    res = _property(int(args[0]))
    with open(out_path, "w") as f:
        json.dump(res, f)
