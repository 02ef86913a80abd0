"""`jaxpar bisect` across meshes on 8 emulated CPU devices: jaxpar on one device vs data=2 fsdp=2
tensor=2 flags nothing, and three bugs only a mesh has are named where they first show.

The device count must be set before JAX starts, so the runs happen in a subprocess (this file's
worker mode), jitted as the CLI runs them; the one-device side is computed once per worker and is
the reference of every pair, and the worker keeps a compilation cache, so the transposed shard
(a placement bug: the programs of the clean 2x2x2 run) compiles nothing. The two bugs that change
the mesh's programs compile their own and run under -m slow. Bugs are planted by monkeypatching
one product function in the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from unittest import mock

import pytest

from jaxpar import tolerances as T

SMALL = "model=gpt2-tiny model.n_embd=32 model.n_head=2 model.vocab_size=64 train.seq_len=16"
MESH3 = "mesh.data=2 mesh.fsdp=2 mesh.tensor=2"
# name -> (run a, the first tensor bisect must name, or None: clean)
CASES = {
    "clean 2x2x2": (f"jaxpar {SMALL} {MESH3}", None),
    "one tensor-parallel shard of c_fc transposed": (f"jaxpar {SMALL} {MESH3}", "transformer.h.0.mlp.c_fc"),
    "gradient average over data missing": (f"jaxpar {SMALL} {MESH3}", "grad/transformer.ln_f.bias"),
    "pipeline microbatches out of order": (f"jaxpar {SMALL} mesh.pipe=2 pipeline.microbatches=2", "loss"),
}
DEFAULT = ["clean 2x2x2", "one tensor-parallel shard of c_fc transposed"]


def _transposed_tensor_shard(orig):
    """Trainer.init_state placing layer 0's c_fc weight (L, D, F), F split over tensor, with the
    leading square block of tensor shard 1's local piece transposed."""
    import jax
    import numpy as np

    def init_state(self, params):
        state = orig(self, params)
        w = state["params"]["h"]["mlp"]["c_fc"]["weight"]
        width = w.shape[2] // self.mesh.shape["tensor"]
        pieces = []
        for s in w.addressable_shards:
            data = np.array(s.data)  # (L, D/fsdp, F/tensor)
            if (s.index[2].start or 0) // width == 1:
                k = min(data.shape[1:])
                data[0, :k, :k] = data[0, :k, :k].T.copy()
            pieces.append(jax.device_put(data, s.device))
        state["params"]["h"]["mlp"]["c_fc"]["weight"] = jax.make_array_from_single_device_arrays(
            w.shape, w.sharding, pieces)
        return state

    return init_state


def _plant(name: str):
    import jax
    import jax.numpy as jnp

    from jaxpar.parallel import pipeline
    from jaxpar.train import Trainer

    if name == "one tensor-parallel shard of c_fc transposed":
        return mock.patch.object(Trainer, "init_state", _transposed_tensor_shard(Trainer.init_state))
    if name == "gradient average over data missing":
        pmean = jax.lax.pmean

        def value_mean_gradient_sum(x, axis_name, **kw):  # ZeRO-3's loss mean: right value, backward a sum
            total = jax.lax.psum(x, axis_name, **kw)
            return total - jax.lax.stop_gradient(total - pmean(x, axis_name, **kw))

        return mock.patch.object(jax.lax, "pmean", value_mean_gradient_sum)
    if name == "pipeline microbatches out of order":
        blocks = pipeline.pipeline_blocks

        def rolled(mc, policy, mesh, lay, w, x, M, *args, **kw):  # (B, T, D) rows of microbatch m -> m+1
            y = blocks(mc, policy, mesh, lay, w, x, M, *args, **kw)
            return jnp.roll(y.reshape(y.shape[0] // M, M, *y.shape[1:]), 1, axis=1).reshape(y.shape)

        return mock.patch.object(pipeline, "pipeline_blocks", rolled)
    return contextlib.nullcontext()


def _worker(out: str, names: list[str]) -> None:
    import tempfile

    import jax

    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(dir=os.path.dirname(out)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxpar.run import bisection as bisect
    from jaxpar.run.bisect_compare import compare, report

    reference, results = None, {}
    for name in names:
        a_text = CASES[name][0]
        a, b, params = bisect.resolve_sides(a_text, f"jaxpar {SMALL}")
        x, y = bisect.batch(a.cfg)
        reference = reference or bisect.run_side(b, params, x, y)
        with _plant(name):
            ra = bisect.run_side(a, params, x, y)
        rows, one_sided = compare(ra, reference, a.cfg, b.cfg, (a.kind, b.kind))
        text, first = report(rows, one_sided, a.text, b.text)
        acts = [r.max_rel for r in rows if "/" not in r.name and r.name != "loss"]
        results[name] = {"first": first and first.name, "first_rel": first and first.max_rel,
                         "first_bound": first and first.bound, "clean_before": first is None or not any(
                             r.over for r in rows[:rows.index(first)]),
                         "act_max": max(acts), "one_sided": one_sided, "text": text}
    with open(out, "w") as f:
        json.dump(results, f)


def _results(tmp_path_factory, names):
    from tests.support.cli_helpers import run_worker

    return run_worker(__file__, tmp_path_factory.mktemp("bisect_mesh"), "bisect_mesh", *names)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _results(tmp_path_factory, DEFAULT)


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    return _results(tmp_path_factory, [c for c in CASES if c not in DEFAULT])


@pytest.mark.parametrize("case", DEFAULT)
def test_mesh_pairs(results, case):
    _check(results[case], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c not in DEFAULT])
def test_mesh_bugs_that_change_the_programs(slow_results, case):
    _check(slow_results[case], case)


def _check(r: dict, case: str) -> None:
    where = CASES[case][1]
    assert r["first"] == where, r["text"]
    assert r["one_sided"] == [] and r["clean_before"], r["text"]
    if where is None:
        assert r["act_max"] <= T.TABLE["bisect.fp32.activation"].value
    else:
        assert r["first_rel"] > r["first_bound"]


if __name__ == "__main__":
    _worker(sys.argv[2], sys.argv[3:])
