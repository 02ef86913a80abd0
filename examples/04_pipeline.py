"""Pipeline parallelism: automatic stage partition, then a pipe×data×tensor = 2×2×2 run on 8
emulated CPU devices that prints the pipeline bubble.

    python examples/04_pipeline.py            # ~1 minute on a laptop CPU
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.parallel.mesh import emulate_host_devices  # noqa: E402

# 8 emulated CPU devices, before JAX initialises; the user's other XLA_FLAGS stay (they were overwritten)
emulate_host_devices(8)

import tempfile  # noqa: E402
import time  # noqa: E402

from gpt2common import data  # noqa: E402
from jaxpar import config as C  # noqa: E402
from jaxpar.models import gpt2  # noqa: E402
from jaxpar.parallel import pipeline as pp  # noqa: E402
from jaxpar.parallel.layout import layer_cost  # noqa: E402
from jaxpar.parallel.partition import partition_layers, stage_times  # noqa: E402
from jaxpar.train import build_trainer, check_model_vs_mesh  # noqa: E402

# 1. Automatic stage partition (exact DP: minimise the slowest stage). Costs in forward FLOPs per
#    token: one block, the embedding lookup (~free) and ln_f + tied logits (2·D·V: ~3.4 blocks
#    for GPT-2 small). If stage S-1 also computed the head it would get fewer layers:
mc = C.PRESETS["gpt2"]
layer = layer_cost(mc, 1024)
head = 2.0 * mc.n_embd * mc.vocab_size
for S in (4, 5):
    lps = partition_layers([layer] * mc.n_layer, S, first_extra=0.0, last_extra=head)
    slow = max(stage_times(lps, [layer] * mc.n_layer, 0.0, head)) / layer
    print(f"gpt2 S={S}, head on the last stage: layers_per_stage={list(lps)} (slowest stage {slow:.2f} blocks)")
# jaxpar runs the embedding and head outside the pipelined loop, split over all pipe ranks,
# so the blocks alone are balanced:
for S in (4, 5):
    print(f"gpt2 S={S}, as jaxpar runs it:   layers_per_stage={list(partition_layers([layer] * 12, S))}")

# 2. A 3-D run: 4-layer gpt2-tiny, mesh pipe=2 × data=2 × tensor=2, 4 microbatches (GPipe).
cfg = C.resolve(["model=gpt2-tiny", "model.n_layer=4", "mesh.pipe=2", "mesh.data=2", "mesh.tensor=2",
                 "pipeline.microbatches=4", "train.steps=8", "train.seq_len=32", "train.batch_size=16",
                 "train.lr=3e-3", "train.warmup_steps=0", "precision=fp32"])
layout = check_model_vs_mesh(cfg.model, cfg)  # the run's ParallelLayout: stages, rules, validated once
info = pp.describe(cfg, layout)
print(f"stages={info['stages']} layers_per_stage={info['layers_per_stage']} microbatches={info['microbatches']} "
      f"iterations={info['iterations']}")
ds = data.Dataset.open(data.resolve_data("", "byte", tempfile.mkdtemp()), cfg.model.vocab_size, cfg.train.seq_len)
trainer = build_trainer(layout)
state = trainer.init_state(gpt2.init_params(cfg.model, cfg.seed))
times = []
for step in range(cfg.train.steps):
    x, y = data.train_batch(ds, cfg.train.seq_len, cfg.train.batch_size, cfg.seed, step)
    t0 = time.perf_counter()
    state, m = trainer.step_fn(state, trainer.put_batch(x), trainer.put_batch(y))
    loss = float(m["loss"])
    times.append(time.perf_counter() - t0)
    print(f"step {step + 1}  loss {loss:.4f}  {times[-1] * 1e3:.0f} ms")

# 3. The bubble: idle stage-iterations of the schedule that just ran vs (S-1)/(R·M+S-1).
S, M, R = cfg.mesh.pipe, cfg.pipeline.microbatches, cfg.pipeline.repeats
tab = pp.schedule_table(S, M, R)
idle = int((tab[..., 0] < 0).sum())
print(f"bubble: theory {pp.bubble_theory(S, M, R):.4f}, counted {idle}/{tab.shape[0] * S} idle stage-iterations "
      f"= {idle / (tab.shape[0] * S):.4f}")
print("per-iteration timeline (stage: microbatch, . = idle):")
for s in range(S):
    print(f"  stage {s}: " + " ".join("." if v[0] < 0 else str(v[1]) for v in tab[:, s]))
