#!/usr/bin/env bash
# Two ways to run one training job as 2 processes × 2 emulated CPU devices (gloo collectives),
# on one machine. Each gives the same losses as `jaxpar train mesh.data=2 mesh.fsdp=2` in one process.
#   bash examples/03_multi_process.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-runs/03_multi_process}
STEPS=${STEPS:-3}
ARGS=(model=gpt2-tiny mesh.data=2 mesh.fsdp=2 train.batch_size=8 train.seq_len=32 train.steps=$STEPS
      train.eval_every=0 precision=fp32 progress=plain)
export JAX_PLATFORMS=cpu
rm -rf "$OUT" && mkdir -p "$OUT"

# 1) jaxpar's own launcher: spawns the processes, sets coordinator/process ids, and stops the
#    job if any process dies.
jaxpar launch nprocs=2 -- train "${ARGS[@]}" out="$OUT/launch"

# 2) MPI (the mpich wheel from PyPI provides mpiexec): ranks are detected from PMI_* and the
#    coordinator is agreed through mpi4py (cluster_detection_method="mpi4py").
if command -v mpiexec >/dev/null; then
  mpiexec -n 2 jaxpar train "${ARGS[@]}" out="$OUT/mpiexec"
else
  echo "mpiexec not found: pip install mpich mpi4py" >&2
fi

python - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
for run in ("launch", "mpiexec"):
    p = os.path.join(out, run, "metrics.jsonl")
    if os.path.exists(p):
        print(run, [round(json.loads(l)["loss"], 6) for l in open(p)])
PY
