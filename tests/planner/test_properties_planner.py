"""Property-based tests (hypothesis) of the planner's and the pipeline partition's README claims
over random model shapes, batches, device counts and memory limits (jaxpar/planner/README.md:
"returning the fastest that fits memory", "the smallest need reported is exact"; `jaxpar train
plan=auto|<plan.json>` runs what the plan says). Pure Python (the planner imports no JAX; the
layout check compiles nothing): ~20 ms per plan, so ~100 examples in < 3 s.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from jaxpar import config as C
from jaxpar.config import ConfigError, ModelConfig
from jaxpar.parallel.layout import build_layout, make_stage_layout
from jaxpar.parallel.partition import partition_layers, stage_bounds, validate_layers_per_stage
from jaxpar.planner.cost import Workload
from jaxpar.planner.devices import get_device
from jaxpar.planner.plan import plan_for, plan_to_overrides
from jaxpar.planner.search import meshes, search


@st.composite
def workloads(draw):
    n_head = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    m = ModelConfig(n_layer=draw(st.integers(1, 8)), n_embd=n_head * draw(st.sampled_from([8, 16, 24, 32])),
                    n_head=n_head, vocab_size=draw(st.sampled_from([64, 96, 100, 128, 250, 256, 512])),
                    n_positions=64)
    # batches with many divisors, so that most draws have a mesh (the rest test the no-mesh line)
    return Workload(m, draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 48])), draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from(["bf16", "fp32"])))


def _fits_line(msg: str) -> int:
    """The bytes figure of `no plan fits ...: the smallest per-device memory any plan needs is X GiB (N bytes)`."""
    return int(re.search(r"needs is [0-9.]+ GiB \((\d+) bytes\) per device: ", msg).group(1))


@settings(max_examples=60, deadline=None)
@example(w=Workload(ModelConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64), 16, 32, "fp32"),
         n=8, device="cpu", log_limit=6.5)
@given(w=workloads(), n=st.integers(1, 16), device=st.sampled_from(["h100", "cpu"]), log_limit=st.floats(5.0, 9.0))
def test_a_plan_fits_its_limit_and_is_a_config_train_accepts(w, n, device, log_limit):
    """For any model / batch / device count / memory limit, `plan_for` either returns a plan that
    (a) fits the limit (it and every candidate), (b) uses exactly n devices, (c) splits the batch
    evenly over data×fsdp and then into its microbatches, (d) cuts a pipeline's layers into
    pipe×repeats non-empty stages covering every layer once, and (e) is a config `jaxpar train`
    accepts (plan_to_overrides -> config.resolve -> build_layout, the same mesh and stages) --
    or one error line: no mesh at all (then the mesh enumeration is empty), or nothing fits, where
    the smallest need it names is exact: a plan exists at that limit, and none below it."""
    limit = 10.0**log_limit
    try:
        plan, _ = plan_for(w, n, device, limit)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg
        if msg.startswith(f"devices={n} has no mesh that divides train.batch_size={w.batch_size}"):
            assert meshes(w, n) == []
            event("no mesh")
            return
        assert msg.startswith(f"no plan fits memory_limit={limit / 2**30:.2f} GiB on {n} × {device}: "), msg
        need = search(w, n, get_device(device), limit).min_memory
        assert need > limit and _fits_line(msg) == int(need)
        at, _ = plan_for(w, n, device, need)  # the need is reachable ...
        assert at.data["memory_per_device_bytes"] == int(need)
        with pytest.raises(ConfigError):  # ... and nothing needs less
            plan_for(w, n, device, need * (1 - 1e-9))
        event("nothing fits")
        return
    d = plan.data
    mesh = d["mesh"]
    event(f"plan, pipe > 1: {mesh['pipe'] > 1}")
    assert all(c["memory_per_device_bytes"] <= limit for c in [d, *d["candidates"]])
    assert math.prod(mesh.values()) == n == plan.devices and list(mesh) == ["data", "fsdp", "tensor", "pipe"]
    rows = w.batch_size // (mesh["data"] * mesh["fsdp"])
    assert rows * mesh["data"] * mesh["fsdp"] == w.batch_size and rows % d["microbatches"] == 0
    lps = d["layers_per_stage"]
    if mesh["pipe"] > 1:
        assert len(lps) == mesh["pipe"] * d["repeats"] and min(lps) >= 1 and sum(lps) == w.model.n_layer
    # (e): what `jaxpar train plan=<plan.json>` does with it
    m = w.model
    base = [f"model.{k}={getattr(m, k)}" for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")]
    base += [f"train.batch_size={w.batch_size}", f"train.seq_len={w.seq_len}", f"precision={w.precision}"]
    cfg = C.resolve(base)
    over = plan_to_overrides(plan, n, cfg)
    cfg = C.resolve(base + [f"{k}={v}" for k, v in over.items()])
    lay = build_layout(cfg, n)
    assert lay.mesh.tensor == mesh["tensor"] and lay.mesh.pipe == mesh["pipe"]
    assert lay.mesh.data * lay.mesh.fsdp == mesh["data"] * mesh["fsdp"]  # fsdp folds into data when all groups replicate
    if mesh["pipe"] > 1:
        assert lay.stages.layers_per_stage == tuple(lps) and lay.stages.repeats == d["repeats"]


@settings(max_examples=300, deadline=None)
@example(L=48, S=8, R=1)
@given(L=st.integers(1, 64), S=st.integers(1, 16), R=st.integers(1, 4))
def test_an_even_chain_splits_into_stages_a_layer_apart_placed_once_each(L, S, R):
    """partition.py: among the splits with the least slowest stage, the most even; for L equal
    layers over V = S·R virtual stages that is every stage holding floor(L/V) or ceil(L/V) layers,
    the larger ones first (ties: the first found). layout.make_stage_layout places virtual stage
    v = r·S + s on device s at repeat r: every layer exactly once, in order, padded with its
    stage's last layer (marked invalid). Reference: the arithmetic and np.arange."""
    V = S * R
    if V > L:
        with pytest.raises(ValueError, match=f"cannot cut {L} layers into {V} stages"):
            partition_layers([1.0] * L, V)
        return
    lps = partition_layers([1.0] * L, V)
    assert len(lps) == V and sum(lps) == L and set(lps) <= {L // V, -(-L // V)}
    lay = make_stage_layout(lps, S, R)
    assert lay.index.shape == lay.valid.shape == (R, S, max(lps))
    order = [lay.index[v // S, v % S][lay.valid[v // S, v % S]] for v in range(V)]
    assert np.array_equal(np.concatenate(order), np.arange(L))
    for v, (a, b) in enumerate(stage_bounds(lps)):
        row, ok = lay.index[v // S, v % S], lay.valid[v // S, v % S]
        assert ok.sum() == b - a and ok[: b - a].all() and (row[b - a:] == b - 1).all()


@settings(max_examples=300, deadline=None)
@example(lps=[2, 0, 2], L=4, S=3)
@given(lps=st.lists(st.integers(-2, 9), min_size=0, max_size=8), L=st.integers(1, 40), S=st.integers(1, 8))
def test_a_manual_split_is_taken_as_written_or_named_in_one_line(lps, L, S):
    """validate_layers_per_stage (README `pipeline.layers_per_stage`): accepted exactly when it has
    S entries, each >= 1, summing to L; otherwise the first broken rule, in that order, naming the
    list. Reference: the three rules."""
    if len(lps) != S:
        want = f"pipeline.layers_per_stage={lps} has {len(lps)} entries, not mesh.pipe={S}"
    elif bad := [v for v in lps if v < 1]:
        want = f"pipeline.layers_per_stage={lps} has a stage with {bad[0]} layers; every stage needs >= 1"
    elif sum(lps) != L:
        want = f"pipeline.layers_per_stage={lps} sums to {sum(lps)}, not model.n_layer={L}"
    else:
        assert validate_layers_per_stage(lps, L, S) == tuple(lps)
        return
    with pytest.raises(ConfigError) as e:
        validate_layers_per_stage(lps, L, S)
    assert str(e.value) == want
