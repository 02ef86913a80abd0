#!/usr/bin/env bash
# Train in parallel, then evaluate, sample and export. Every command after training reads the
# sharded checkpoint onto whatever devices it runs on: one CPU device by default, or any mesh
# given with mesh.* (through the pipeline when mesh.pipe > 1), with the same numbers.
#   bash examples/09_parallel_then_eval.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-runs/09_parallel_then_eval}
STEPS=${STEPS:-20}
export JAX_PLATFORMS=cpu
rm -rf "$OUT" && mkdir -p "$OUT"
RUN="$OUT/run"
MESH=(mesh.data=2 mesh.fsdp=2 mesh.tensor=2)  # 8 emulated CPU devices

# 1) Train gpt2-tiny on the built-in corpus, 2-way data x 2-way FSDP x 2-way tensor parallel.
jaxpar train model=gpt2-tiny train.seq_len=64 train.batch_size=8 train.steps="$STEPS" precision=fp32 \
  train.warmup_steps=5 train.eval_every=0 progress=plain "${MESH[@]}" out="$RUN"

# 2) Validation loss: on one device, on the training mesh, and through a 2-stage GPipe pipeline.
EVAL=(checkpoint="$RUN" data="$RUN/data" eval.windows=64)
jaxpar eval "${EVAL[@]}" > "$OUT/eval_one_device.json"
jaxpar eval "${EVAL[@]}" "${MESH[@]}" > "$OUT/eval_training_mesh.json"
jaxpar eval "${EVAL[@]}" mesh.pipe=2 pipeline.microbatches=2 > "$OUT/eval_pipeline.json"

# 3) Sample with a fixed seed: one device and the training mesh give the same text.
SAMPLE=(checkpoint="$RUN" prompt="ROMEO:" max_new_tokens=60 temperature=0.8 top_k=40 seed=0)
jaxpar sample "${SAMPLE[@]}" > "$OUT/sample_one_device.txt"
jaxpar sample "${SAMPLE[@]}" "${MESH[@]}" > "$OUT/sample_training_mesh.txt"

# 4) Export for transformers, and score the same windows there.
jaxpar convert checkpoint="$RUN" to_hf="$OUT/hf"
python - "$OUT" <<'PY'
import json, os, sys

import numpy as np
import torch
import transformers

from gpt2common import data

out = sys.argv[1]
evals = {k: json.load(open(os.path.join(out, f"eval_{k}.json"))) for k in ("one_device", "training_mesh", "pipeline")}
model = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(out, "hf")).eval()
x, y = data.eval_windows(data.load_tokens(os.path.join(out, "run", "data", "val.bin")), 64, 64)
with torch.no_grad():
    logits = model(torch.tensor(x.astype(np.int64))).logits
    hf = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(y.astype(np.int64)).flatten()).item()
samples = [open(os.path.join(out, f"sample_{k}.txt")).read() for k in ("one_device", "training_mesh")]
print(open(os.path.join(out, "sample_one_device.txt")).read().rstrip())
print(json.dumps({**{f"eval_{k}": v["loss"] for k, v in evals.items()}, "transformers": hf,
                  "same_sample": samples[0] == samples[1]}))
PY
