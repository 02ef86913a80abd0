#!/usr/bin/env bash
# The GPU benchmarks as one command for a GPU lent for a short time: every step has its own timeout
# and the most wanted figures come first.
#   bash benchmarks/gpu_session.sh [profile|verify|triton]  (writes under $OUT, or /tmp/gpu_out)
# Steps: environment; do this jaxlib's XLA accept jaxpar's GPU flags (an unknown flag aborts the
# start-up); gpu_mfu.py at its defaults (the MFU target); gpu_check.py (cuDNN / XLA / einsum
# attention against each other); `jaxpar train` end to end; then 350M variants while time is left.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG=$OUT/gpu_session.log
exec > >(tee -a "$LOG") 2>&1

# run NAME TIMEOUT CMD...: one step, its rc and seconds
run() {
  local name=$1 t=$2 start rc
  shift 2
  echo "=== $name ($(date -u +%T))"
  start=$(date +%s)
  timeout "$t" bash -c '"$@"' _ "$@"  # bash -c: py and probe are (exported) functions
  rc=$?
  echo "=== $name: rc=$rc in $(($(date +%s) - start)) s"
  return $rc
}

# py SCRIPT ARGS...: a benchmark with the GPU flags this jaxlib rejected ($BAD) left out
BAD=""
py() {
  python3 -c 'import runpy, sys
import jaxpar.run.xla_flags as x
bad = set(filter(None, sys.argv[1].split(",")))
x.GPU_FLAGS = tuple(f for f in x.GPU_FLAGS if f.split("=")[0] not in bad)
exec(__import__("os").environ.get("PATCH", ""))  # an A/B variant, e.g. the scan unrolled
sys.argv = sys.argv[2:]
if sys.argv[0] == "-m":  # py -m MODULE ARGS...
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(sys.argv[0], run_name="__main__")' "$BAD" "$@"
}

run env 30 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv;
  python3 -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint, numpy; print(sys.version.split()[0], jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__, numpy.__version__); print(jax.devices())"'

probe() {
  python3 -c 'import jaxpar.run.xla_flags as x
import os, sys
x.GPU_FLAGS = tuple(f for f in x.GPU_FLAGS if f.split("=")[0] not in set(filter(None, sys.argv[1].split(","))))
x.apply_gpu_defaults(); print("XLA_FLAGS", os.environ["XLA_FLAGS"])
import jax; print(jax.devices())' "$BAD" > "$OUT/probe.txt" 2>&1
}
export -f py probe
export BAD
if ! run flags 60 probe; then
  cat "$OUT/probe.txt"
  # XLA names them: "Unknown flags in XLA_FLAGS: --a=1 --b=2"
  BAD=$(grep -o 'Unknown flags\? in XLA_FLAGS:.*' "$OUT/probe.txt" | sed 's/.*XLA_FLAGS://' | tr ' ' '\n' |
        grep -- '^--' | cut -d= -f1 | paste -sd, -)
  echo "rejected GPU flags: ${BAD:-none named}"
  export BAD
  run flags_again 60 probe || cat "$OUT/probe.txt"
else
  cat "$OUT/probe.txt"
fi

if [ "${1:-}" = profile ]; then  # where the step's time goes, and two A/B variants
  run prof350 150 py benchmarks/gpu_profile.py --model gpt2-medium --batch 8 --out "$OUT/gpu_profile_350m.json"
  run prof124 150 py benchmarks/gpu_profile.py --model gpt2 --batch 16 --out "$OUT/gpu_profile_124m.json"
  BAD=$(python3 -c 'import jaxpar.run.xla_flags as x; print(",".join(f.split("=")[0] for f in x.GPU_FLAGS))') \
    run mfu_noflags 90 py benchmarks/gpu_mfu.py --models gpt2-medium --out "$OUT/gpu_mfu_noflags.json"
  PATCH='import jaxpar.models.gpt2 as g; g.scan_unroll = lambda n, backend=None, remat="none": n' \
    run mfu_unrolled 150 py benchmarks/gpu_mfu.py --models gpt2-medium,gpt2 --out "$OUT/gpu_mfu_unrolled.json"
  echo "=== done ($(date -u +%T))"
  exit 0
fi

if [ "${1:-}" = triton ]; then  # XLA's Triton gemm fusions against cuBLAS alone
  run mfu 120 py benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu.json"
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
    run mfu_cublas 120 py benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu_cublas.json"
  echo "=== done ($(date -u +%T))"
  exit 0
fi

if [ "${1:-}" = verify ]; then  # the head's bf16 backward and the unrolled scan, A/B
  run mfu 120 py benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu.json"
  PATCH='import jaxpar.models.gpt2 as g; g.scan_unroll = lambda n, backend=None, remat="none": 1' \
    run mfu_rolled 120 py benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu_rolled.json"
  run mfu_b16 90 py benchmarks/gpu_mfu.py --models gpt2-medium --batch 16 --out "$OUT/gpu_mfu_b16.json"
  run check 120 py benchmarks/gpu_check.py --out "$OUT/gpu_check.json"
  run prof350 90 py benchmarks/gpu_profile.py --model gpt2-medium --batch 8 --out "$OUT/gpu_profile_350m.json"
  echo "=== done ($(date -u +%T))"
  exit 0
fi

run mfu 240 py benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu.json"
run check 150 py benchmarks/gpu_check.py --out "$OUT/gpu_check.json"
run train 90 py -m jaxpar.cli train model=gpt2-tiny train.steps=60 out=/tmp/gpu_tiny
run mfu_b16 150 py benchmarks/gpu_mfu.py --models gpt2-medium --batch 16 --out "$OUT/gpu_mfu_b16.json"
run mfu_xla 150 py benchmarks/gpu_mfu.py --models gpt2-medium --attention xla --out "$OUT/gpu_mfu_xla.json"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
echo "=== done ($(date -u +%T))"
