"""`jaxpar bisect` across meshes on 8 emulated CPU devices: jaxpar on one device vs data=2 fsdp=2
tensor=2 flags nothing, and three bugs only a mesh has are named where they first show.

The device count must be set before JAX starts, so the runs happen in subprocesses: first the CLI
itself on the clean pair (the one CLI test: exit 0 and the table), then this file's worker mode,
which plants each bug by monkeypatching one product function and runs bisect in-process, jitted as
the CLI runs it. Both share the test run's compilation cache (tests/support/cli_helpers.py), so
the worker's one-device reference and its transposed shard (a placement bug: the programs of the
clean 2x2x2 run) compile nothing. The two bugs that change the mesh's programs compile their own
and run under -m slow.
"""

from __future__ import annotations

import contextlib
import json
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
    """This file's worker on 8 emulated devices with the CLI runs' environment and compilation cache."""
    import subprocess

    from tests.support.cli_helpers import clean_env

    out = tmp_path_factory.mktemp("bisect_mesh") / "bisect_mesh.json"
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, __file__, "bisect_mesh", str(out), *names], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_cli_one_device_vs_2x2x2_is_clean_and_prints_the_table():
    from tests.support.cli_helpers import run

    r = run(["bisect", f"jaxpar {SMALL} {MESH3}", f"jaxpar {SMALL}"])
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-3000:]
    lines = r.stdout.splitlines()
    assert lines[:2] == [f"a: jaxpar {SMALL} {MESH3}", f"b: jaxpar {SMALL}"]
    assert lines[3].split() == ["tensor", "shape", "max", "abs", "max", "rel", "bound", "verdict"]
    rows = [ln.split() for ln in lines[4:-1]]
    assert len(rows) == 142 and all(r[-1] == "ok" for r in rows)  # 29 intermediates (scores too), loss, 4 x 28
    assert rows[0][:2] == ["transformer.wte", "8x16x32"] and rows[-1][:2] == ["update/transformer.wte.weight", "64x32"]
    assert lines[-1] == "clean: all 142 tensors within their bounds"


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
