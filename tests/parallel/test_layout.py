"""The one resolved ParallelLayout (jaxpar.parallel.layout): what it decides, and that the planner and
`jaxpar train` agree on which meshes exist because they ask the same predicate. No devices, no JAX."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar.config import (
    PRESETS,
    Config,
    ConfigError,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    ShardingConfig,
    TrainConfig,
)
from jaxpar.parallel.layout import build_layout
from jaxpar.planner.cost import Workload
from jaxpar.planner.search import divisors, meshes

TINY = PRESETS["gpt2-tiny"]  # L=2, D=128, H=4, V=256


def _cfg(model=TINY, batch=8, replicate=(), microbatches=1, **mesh):
    return Config(model=model, mesh=MeshConfig(**mesh), train=TrainConfig(batch_size=batch, seq_len=32),
                  pipeline=PipelineConfig(microbatches=microbatches), sharding=ShardingConfig(replicate=replicate))


@settings(max_examples=60, deadline=None)
@given(n_layer=st.integers(1, 6), n_head=st.sampled_from([1, 2, 3, 4, 6]), head_dim=st.sampled_from([4, 6, 8]),
       vocab=st.sampled_from([48, 50, 64, 96]), batch=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
       n_devices=st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
def test_planner_meshes_are_exactly_the_meshes_the_layout_accepts(n_layer, n_head, head_dim, vocab, batch, n_devices):
    """Reference: brute force over every factorisation, asking build_layout (what `jaxpar train`
    validates with). The planner must propose exactly those meshes: no fewer, no more."""
    m = ModelConfig(n_layer=n_layer, n_embd=n_head * head_dim, n_head=n_head, vocab_size=vocab, n_positions=64)
    accepted = set()
    for t in divisors(n_devices):
        for p in divisors(n_devices // t):
            for f in divisors(n_devices // (t * p)):
                d = n_devices // (t * p * f)
                try:
                    build_layout(_cfg(m, batch, data=d, fsdp=f, tensor=t, pipe=p), n_devices)
                except ConfigError:
                    continue
                accepted.add((d, f, t, p))
    assert set(meshes(Workload(m, batch, 32), n_devices)) == accepted


def test_layout_owns_every_rule_table():
    """Reference: the rules documented in jaxpar.parallel.sharding / parallel.pipeline, written out."""
    lay = build_layout(_cfg(data=2, tensor=2, pipe=2, microbatches=2), 8)
    assert lay.pipelined and lay.stages.layers_per_stage == (1, 1) and lay.warnings == ()
    # every group: tensor rules + layers over pipe (L=2 splits over pipe=2); no fsdp table
    assert all(r == {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "layers": "pipe"}
               for r in lay.group_param_rules.values())
    # outside the pipeline the batch also splits over pipe (8 rows % (2·2) == 0); inside, tensor only
    assert lay.activation_rules["batch"] == ("data", "fsdp", "pipe")
    assert lay.pipeline_rules == {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    assert lay.manual_axes == ("data", "fsdp", "pipe") and lay.batch_axes == ("data", "fsdp")
    # 3 layers do not split over pipe=2: the stacked dim stays whole (stages are then gathered)
    odd = build_layout(_cfg(model=ModelConfig(n_layer=3, n_embd=128, n_head=4, vocab_size=256), pipe=2), 2)
    assert "layers" not in odd.group_param_rules["attn"] and odd.stages.layers_per_stage in {(1, 2), (2, 1)}
    assert odd.activation_rules["batch"] == ("data", "fsdp", "pipe")
    # no pipeline: no stages, batch over the data-parallel axes only
    flat = build_layout(_cfg(data=2, fsdp=4, replicate=("embed", "mlp")), 8)
    assert flat.stages is None and flat.activation_rules["batch"] == ("data", "fsdp")
    assert flat.group_param_rules == {"embed": {}, "attn": {"embed": "fsdp"}, "mlp": {}}
    assert flat.block_rules() == {"ln_1": {"embed": "fsdp"}, "attn": {"embed": "fsdp"}, "ln_2": {}, "mlp": {}}
    assert flat.rules_for("ln_f.weight") == {} and flat.rules_for("h.attn.c_proj.weight") == {"embed": "fsdp"}


def test_layout_resolves_the_wildcard():
    assert build_layout(_cfg(data=-1, tensor=2), 8).mesh == MeshConfig(data=4, tensor=2)


@pytest.mark.parametrize("mesh,n,batch,msg", [
    ({"data": 3}, 8, 8, "mesh data=3×fsdp=1×tensor=1×pipe=1 needs 3 devices but 8 are available "
                        "(the product of mesh sizes must equal the device count)"),
    ({"tensor": 8}, 8, 8, "model.n_head=4 is not divisible by mesh.tensor=8"),  # the first failing rule
    ({"fsdp": 3}, 3, 3, "model.n_embd=128 is not divisible by mesh.fsdp=3"),
    ({"pipe": 4}, 4, 8, "mesh.pipe=4 stages exceed model.n_layer=2 layers"),
    ({"data": 8}, 8, 4, "train.batch_size=4 is not divisible by mesh.data×mesh.fsdp×train.grad_accum=8×1×1"),
])
def test_layout_errors_name_the_values(mesh, n, batch, msg):
    with pytest.raises(ConfigError) as e:
        build_layout(_cfg(batch=batch, **mesh), n)
    assert str(e.value) == msg


def test_layout_and_planner_import_no_jax():
    """The planner (3072-device searches in seconds) and the config checks use the layout before
    JAX starts: importing them must not import jax."""
    code = ("import sys, jaxpar.parallel.layout, jaxpar.planner.search, jaxpar.planner.cli; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
