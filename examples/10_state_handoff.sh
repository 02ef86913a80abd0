#!/usr/bin/env bash
# Move a training run between jaxpar and torchref mid-way, both directions, and check that the
# continued steps are the steps of a run that never moved (docs/state_format.md).
#   jaxpar -> torchref: a 2x2 (data, tensor) jaxpar run's step-N checkpoint, gathered to the host
#                       as a state dir, continued by torchref for M steps;
#   torchref -> jaxpar: torchref's own step-N state, continued by jaxpar on the 2x2 mesh.
#   bash examples/10_state_handoff.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-runs/10_state_handoff}
N=${N:-5}
M=${M:-5}
export JAX_PLATFORMS=cpu
rm -rf "$OUT" && mkdir -p "$OUT"
jaxpar prepare out="$OUT/data" > /dev/null  # the built-in corpus, byte tokens
# One run's settings on both sides: the same model, batches and N+M-step schedule (seed 0 also
# gives both the same initial weights).
KEYS=(model=gpt2-tiny train.seq_len=32 train.batch_size=8 train.steps=$((N + M)) train.warmup_steps=2
      train.lr=1e-3 seed=0 data="$OUT/data")
JAX=(precision=fp32 train.eval_every=0 progress=none mesh.data=2 mesh.tensor=2)  # 4 emulated CPU devices
TORCH=(train.log_every=0)

# 1) jaxpar, N+M steps with a checkpoint at step N: the run that stays in jaxpar.
jaxpar train "${KEYS[@]}" "${JAX[@]}" train.ckpt_every="$N" out="$OUT/jaxpar" > /dev/null
# 2) jaxpar -> torchref: its step-N state, continued by torchref for steps N+1..N+M.
jaxpar convert checkpoint="$OUT/jaxpar" step="$N" to_state="$OUT/state_from_jaxpar"
torchref train "${KEYS[@]}" "${TORCH[@]}" init_state="$OUT/state_from_jaxpar" out="$OUT/jaxpar_to_torchref" > /dev/null
# 3) torchref, N+M steps, writing its state at step N (and N+M): the run that stays in torchref.
torchref train "${KEYS[@]}" "${TORCH[@]}" state_every="$N" out="$OUT/torchref" > /dev/null
# 4) torchref -> jaxpar: that state, continued by jaxpar on the 2x2 mesh.
jaxpar train "${KEYS[@]}" "${JAX[@]}" init_state="$OUT/torchref/state/$N" out="$OUT/torchref_to_jaxpar" > /dev/null

# 5) Step by step: each continued run against the run that stayed in the framework it came from.
python - "$OUT" <<'PY'
import json, os, sys

out = sys.argv[1]
def steps(run):
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}

rel = lambda a, b: abs(a - b) / abs(b)
res = {}
for moved, stayed in (("jaxpar_to_torchref", "jaxpar"), ("torchref_to_jaxpar", "torchref")):
    a, b = steps(moved), steps(stayed)
    print(f"{moved} vs {stayed}\n| step | loss | loss ({stayed}) | grad_norm | grad_norm ({stayed}) |\n|---|---|---|---|---|")
    for s in sorted(a):
        print(f"| {s} | {a[s]['loss']:.7f} | {b[s]['loss']:.7f} | {a[s]['grad_norm']:.7f} | {b[s]['grad_norm']:.7f} |")
    res[moved] = {"steps": sorted(a), "max_loss_rel": max(rel(a[s]["loss"], b[s]["loss"]) for s in a),
                  "max_grad_norm_rel": max(rel(a[s]["grad_norm"], b[s]["grad_norm"]) for s in a)}
print(json.dumps(res))
PY
