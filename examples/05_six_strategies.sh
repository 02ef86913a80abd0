#!/usr/bin/env bash
# The six data-parallel strategies of the GPT-2 study, side by side, on this machine.
#
#   bash examples/05_six_strategies.sh [OUT_DIR] [key=value ...]
#
# Runs `torchref compare` on gpt2-tiny (2 layers, 0.46M params) with 2 workers per strategy:
# single, single-ps, distributed-ps (DDP), horovod (mpi4py under mpiexec), and the two AMP
# variants. Extra key=value arguments are passed through (e.g. workers=2,4 train.steps=20).
# Under a minute on an idle laptop CPU; the table and the plot land in OUT_DIR.
set -euo pipefail

OUT=${1:-runs/05_six_strategies}
shift || true
PY=${PYTHON:-python}

"$PY" -m torchref compare workers=2 model=gpt2-tiny train.steps=5 train.batch_size=8 train.seq_len=64 \
  train.warmup_steps=1 train.lr=1e-3 train.log_every=0 out="$OUT" "$@"

echo
echo "table (markdown): $OUT/compare.md"
echo "table (JSON):     $OUT/compare.json"
echo "plot:             $OUT/compare.png"
echo "each run:         $OUT/<strategy>-w<N>/ (metrics.jsonl, summary.json, hf/ final weights, logs/)"
