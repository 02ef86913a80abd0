"""07: automatic parallel plan.

1. Plans GPT-2 XL (1.6B) for 64 H100s, global batch 512 × 1024 tokens, and prints the top
   candidates: mesh, per-group sharding (ZeRO-3 or replicated), microbatches, remat, op
   splitting, predicted memory, step time, MFU and pipeline bubble.
2. Plans gpt2-tiny for 8 emulated CPU devices within what `jaxpar train` can apply
   (plan=auto), shows the config overrides the plan turns into, and trains 3 steps with them.

    python examples/07_plan.py [--steps 3] [--out runs/07_plan]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxpar.parallel.mesh import emulate_host_devices

# 8 emulated CPU devices for part 2, before JAX initialises; keeps the user's other XLA_FLAGS
# (a setdefault left a user's own XLA_FLAGS without the device count: "needs 8 devices but 1").
emulate_host_devices(8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs/07_plan")
    args = ap.parse_args(argv)

    from jaxpar.config import PRESETS, Config, apply_overrides, validate
    from jaxpar.planner.cli import print_table
    from jaxpar.planner.cost import Workload
    from jaxpar.planner.plan import plan_for, plan_to_overrides, save_plan

    # --- 1. GPT-2 XL on 64 H100s
    w = Workload(PRESETS["gpt2-xl"], batch_size=512, seq_len=1024, precision="bf16")
    plan, res = plan_for(w, 64, "h100", top_k=5)
    print_table([plan.data] + plan.data["candidates"], "gpt2-xl · 64 × h100 · B=512 T=1024 bf16")
    print(f"searched {res.evaluated} strategies over {res.meshes} meshes in {res.seconds:.2f} s")
    path = save_plan(plan, os.path.join(args.out, "plan_gpt2-xl_64xh100.json"))
    print(f"wrote {path}")

    # --- 2. a small plan applied on 8 emulated CPU devices
    cfg = validate(apply_overrides(Config(), {
        "model": "gpt2-tiny", "train.batch_size": "16", "train.seq_len": "64", "precision": "fp32",
        "train.steps": str(args.steps), "train.eval_every": "0", "train.warmup_steps": "1", "progress": "none",
        "out": os.path.join(args.out, "run")}))
    from jaxpar.planner.plan import plan_auto

    small = plan_auto(cfg, 8, "cpu")
    overrides = plan_to_overrides(small, 8, cfg)
    print("small plan for gpt2-tiny on 8 cpu devices:", json.dumps(small.mesh),
          f"predicted {small.data['memory_per_device_bytes'] / 2**20:.1f} MiB/device")
    print("overrides:", " ".join(f"{k}={v}" for k, v in overrides.items()))
    run_cfg = validate(apply_overrides(cfg, overrides))

    from jaxpar.run.loop import run_train

    rc = run_train(run_cfg)
    metrics = os.path.join(run_cfg.out, "metrics.jsonl")
    with open(metrics) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    train_rows = [r for r in rows if "loss" in r and "step" in r]
    print("losses:", [round(r["loss"], 4) for r in train_rows])
    return rc


if __name__ == "__main__":
    sys.exit(main())
