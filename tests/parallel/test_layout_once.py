"""The layout is the whole plan: one `jaxpar train` run resolves it once and everything reads it.

Counted in a fresh process (a run of its own, 4 emulated CPU devices, mesh data=2 x tensor=2 with
one -1 to fill, a YAML file) by profiling calls to the functions' code objects, so every
binding of a name (`from ... import build_layout`) is counted too."""

import json

from support.cli_helpers import run_probe

from jaxpar.parallel import layout as L

PROBE = r"""
import json, sys, threading
from gpt2common import grammar
from jaxpar import cli, config
from jaxpar.parallel import layout
arg = json.loads(sys.argv[1])
watched = {f.__code__: name for name, f in [("build_layout", layout.build_layout),
           ("resolve_mesh_config", layout.resolve_mesh_config), ("validate", config.validate),
           ("load_yaml", grammar.load_yaml)]}
counts = dict.fromkeys(watched.values(), 0)
def prof(frame, event, _):
    if event == "call" and frame.f_code in watched:
        counts[watched[frame.f_code]] += 1
sys.setprofile(prof); threading.setprofile(prof)
rc = cli.main(["train", "--config", arg["yaml"], *arg["args"]])
sys.setprofile(None); threading.setprofile(None)
print(json.dumps({"rc": rc, **counts}))
"""


def test_one_train_run_resolves_the_layout_once(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model: gpt2-tiny\nmesh:\n  data: -1\n  tensor: 2\n")
    args = ["train.steps=2", "train.batch_size=4", "train.seq_len=16", "train.eval_every=2",
            f"out={tmp_path / 'run'}"]
    got = run_probe(PROBE, {"yaml": str(yaml), "args": args}, devices=4)
    # one YAML read, one validation, one layout, and its one mesh resolution (build_mesh reads it)
    assert got == {"rc": 0, "build_layout": 1, "resolve_mesh_config": 1, "validate": 1, "load_yaml": 1}
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2, "pipe": 1}


def _cfg(**mesh):
    from jaxpar.config import Config, MeshConfig, ModelConfig, PipelineConfig, TrainConfig

    return Config(model=ModelConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256),
                  mesh=MeshConfig(**mesh), train=TrainConfig(batch_size=8, seq_len=16),
                  pipeline=PipelineConfig(microbatches=2))


def test_the_layout_names_the_parallel_program():
    """Which loss runs is the layout's `loss_path`, one of LOSS_PATHS; train maps each to a builder."""
    from jaxpar.train import LOSS_PATHS

    assert set(LOSS_PATHS) == set(L.LOSS_PATHS)
    cases = [({}, "auto", 1), ({"data": 4}, "tied", 4), ({"data": 2, "tensor": 2}, "tied", 2),
             ({"fsdp": 4}, "zero3", 1), ({"data": 2, "fsdp": 2}, "zero3", 1), ({"tensor": 4}, "auto", 1),
             ({"pipe": 2}, "gpipe", 1), ({"pipe": 2, "data": 2}, "gpipe", 1)]
    for mesh, path, groups in cases:
        n = 1
        for v in mesh.values():
            n *= v
        lay = L.build_layout(_cfg(**mesh), n)
        assert (lay.loss_path, lay.tied_groups) == (path, groups), mesh
        assert lay.cfg.mesh == lay.mesh
    import dataclasses

    one_f = L.build_layout(dataclasses.replace(_cfg(pipe=2), pipeline=dataclasses.replace(
        _cfg(pipe=2).pipeline, schedule="1f1b")), 2)
    assert one_f.loss_path == "1f1b"
    # ZeRO-3's shard_map path gives way to the auto-sharded step for dropout / selective remat / MLP chunks
    for change in ({"model": {"dropout": 0.1}}, {"train": {"remat": "selective"}}, {"train": {"mlp_chunks": 2}}):
        (section, kv), = change.items()
        base = _cfg(fsdp=4)
        cfg = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **kv)})
        assert L.build_layout(cfg, 4).loss_path == "auto", change


def test_the_tensor_rules_are_written_once():
    assert L.TP_PARAM_RULES is L.TENSOR_RULES and L.PIPELINE_INNER_RULES is L.TENSOR_RULES
    assert L.ACTIVATION_RULES == {"batch": ("data", "fsdp"), "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
