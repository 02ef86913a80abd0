"""Mesh utilities as a library: build meshes, shard a params tree by logical axes, print the
layout, and the collective bytes of one compiled train step. Runs on a laptop CPU (8 emulated
devices), in well under a minute.

    python examples/02_mesh_utilities.py
"""

import os

# Emulated CPU devices must be requested before JAX initialises.
from jaxpar.parallel import mesh as M  # noqa: E402  (imports no JAX backend)

M.emulate_host_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxpar.config import PRESETS, Config, ConfigError, MeshConfig, TrainConfig  # noqa: E402
from jaxpar.models import gpt2  # noqa: E402
from jaxpar.parallel import sharding as S  # noqa: E402
from jaxpar.run.inspection import collective_bytes, compile_step, memory_per_device, theory_bytes  # noqa: E402

model = PRESETS["gpt2-tiny"]

# 1. A validating mesh: product must equal the device count; one axis may be -1.
mesh = M.build_mesh(MeshConfig(data=2, fsdp=2, tensor=-1))
print(M.describe(mesh))
try:
    M.build_mesh(MeshConfig(data=2))
except ConfigError as e:
    print(f"rejected: {e}")

# 2. Shard a params tree by its logical axis names with the composed rules tables.
rules = S.param_rules(MeshConfig(**mesh.shape))
params = M.shard_tree(gpt2.init_params(model, seed=0), mesh, gpt2.param_axes(model), rules)
print(f"\n{'parameter':<22}{'global shape':<22}{'spec':<40}{'per-device shard'}")
for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = ".".join(k.key for k in path)
    shard = x.sharding.shard_shape(x.shape)
    print(f"{name:<22}{str(x.shape):<22}{str(tuple(x.sharding.spec)):<40}{shard}")

# 3. Compile one train step (nothing runs) and read its collectives off the HLO.
cfg = Config(model=model, model_name="gpt2-tiny", mesh=MeshConfig(data=2, fsdp=2, tensor=2), precision="fp32",
             train=TrainConfig(batch_size=8, seq_len=32))
compiled, trainer = compile_step(cfg)
coll, th = collective_bytes(compiled.as_text()), theory_bytes(trainer.cfg)
print("\nstep collectives per device: " + ", ".join(
    f"{k} {coll[k]['wire_bytes'] / 1024:.1f} KiB" for k in ("all-reduce", "all-gather", "reduce-scatter",
                                                            "all-to-all", "collective-permute") if coll[k]["ops"]))
print(f"measured {coll['total_wire_bytes'] / 1024:.1f} KiB vs theory {th['total'] / 1024:.1f} KiB "
      f"(dp {th['dp'] / 1024:.1f} + fsdp {th['fsdp'] / 1024:.1f} + tp {th['tp'] / 1024:.1f})")
print(f"memory per device: {memory_per_device(compiled)['total'] / 2**20:.2f} MiB")
