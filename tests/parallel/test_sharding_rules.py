"""Rules tables as data: the golden snapshot of every gpt2 parameter's resolved PartitionSpec
per strategy, plus properties each strategy must have (no devices needed)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from jaxpar.config import PRESETS, MeshConfig
from jaxpar.parallel import sharding as S

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "gpt2_param_specs.json")


def _current() -> dict:
    return {name: {"mesh": dataclasses.asdict(mc), "specs": S.resolved_param_specs(PRESETS["gpt2"], mc)}
            for name, mc in S.NAMED_MESHES.items()}


def test_golden_snapshot_of_every_gpt2_param_spec():
    # Regenerate deliberately with: python -c "import json,tests.test_sharding_rules as t; ..." (see _current)
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert _current() == golden


def test_dp_replicates_everything():
    assert all(all(e is None for e in s) for s in S.resolved_param_specs(PRESETS["gpt2"], MeshConfig(data=8)).values())


def test_fsdp_shards_every_param_on_embed():
    specs = S.resolved_param_specs(PRESETS["gpt2"], MeshConfig(fsdp=8))
    # every tensor with an embed dim is split; only the two column biases (no embed dim) are whole
    whole = sorted(k for k, s in specs.items() if "fsdp" not in s)
    assert whole == ["h.attn.c_attn.bias", "h.mlp.c_fc.bias"]
    m = PRESETS["gpt2"]
    biases = m.n_layer * 7 * m.n_embd  # (L, 3D) + (L, 4D) = 64,512 of 124M params
    assert S.local_shard_elements(m, MeshConfig(fsdp=8)) == (m.num_params() - biases) // 8 + biases


def test_megatron_layout():
    specs = S.resolved_param_specs(PRESETS["gpt2"], MeshConfig(tensor=4))
    assert specs["h.attn.c_attn.weight"] == [None, None, None, "tensor", None]  # column-parallel (heads)
    assert specs["h.attn.c_proj.weight"] == [None, "tensor", None, None]  # row-parallel
    assert specs["h.mlp.c_fc.weight"] == [None, None, "tensor"]  # column-parallel
    assert specs["h.mlp.c_proj.weight"] == [None, "tensor", None]  # row-parallel
    assert specs["wte.weight"] == ["tensor", None]  # vocab-parallel embedding / logits
    assert specs["h.attn.c_proj.bias"] == [None, None]  # added after the all-reduce: replicated


def test_pipe_axis_is_never_used_by_rules():
    for mc in [*S.NAMED_MESHES.values(), MeshConfig(data=2, fsdp=2, tensor=2, pipe=2)]:
        for s in S.resolved_param_specs(PRESETS["gpt2"], mc).values():
            assert "pipe" not in json.dumps(s)
    assert "pipe" not in json.dumps(S.ACTIVATION_RULES)


@pytest.mark.parametrize("mc,elements", [
    (MeshConfig(), 124_439_808 + 1024 * 768 - 1024 * 768),  # HF count (tied) incl. wpe
    (MeshConfig(tensor=4, data=2), None),
])
def test_local_shard_elements(mc, elements):
    m = PRESETS["gpt2"]
    n = S.local_shard_elements(m, mc)
    if elements is not None:
        assert n == elements == m.num_params()
    else:
        # vocab-parallel wte and head/mlp-split weights are 1/4; LayerNorms, wpe and row biases stay whole
        L, D = m.n_layer, m.n_embd
        whole = m.n_positions * D + L * (4 * D + 2 * D) + 2 * D
        assert n == (m.num_params() - whole) // 4 + whole


def test_osdp_replicated_groups_skip_fsdp():
    """sharding.replicate=embed,mlp: those groups keep the data-parallel specs, attn stays ZeRO-3."""
    import jax
    from jax.sharding import PartitionSpec

    from jaxpar.config import PRESETS, Config, MeshConfig, ShardingConfig, TrainConfig
    from jaxpar.models import gpt2
    from jaxpar.parallel.layout import build_layout
    from jaxpar.parallel.sharding import param_rules, param_specs, spec_to_json

    mc, m = MeshConfig(data=2, fsdp=4), PRESETS["gpt2-tiny"]
    axes = gpt2.param_axes(m)
    flat = lambda t: {".".join(k.key for k in p): spec_to_json(s) for p, s in  # noqa: E731
                      jax.tree_util.tree_flatten_with_path(t, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}
    def grouped(replicate=()):
        cfg = Config(model=m, mesh=mc, sharding=ShardingConfig(replicate=replicate), train=TrainConfig(batch_size=8))
        return build_layout(cfg, 8).param_specs(axes)

    got = flat(grouped(("embed", "mlp")))
    sharded, repl = flat(param_specs(axes, param_rules(mc))), flat(param_specs(axes, {}))
    assert got == {k: (sharded[k] if k.startswith(("h.ln_1", "h.attn")) else repl[k]) for k in got}
    assert got["h.attn.c_attn.weight"] == [None, "fsdp", None, None, None] and got["wte.weight"] == [None, None]
    assert flat(grouped()) == sharded  # default: every group sharded
