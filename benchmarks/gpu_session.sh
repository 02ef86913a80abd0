#!/usr/bin/env bash
# The whole GPU verification as one command, sized for 8 minutes on one H100:
#   bash benchmarks/gpu_session.sh            (run from the repository root; writes under $OUT, default /tmp/gpu_out)
#   bash benchmarks/gpu_session.sh levers     (env, flags, then only benchmarks/gpu_levers.py: 350M B8, each speed
#                                              lever on and off, 300 s budget, $OUT/gpu_levers.json; about 6 minutes)
# Steps, each with its own time limit, the most wanted figures first:
#   env      (20 s)  GPU, driver, versions
#   flags    (30 s)  does this jaxlib accept jaxpar's GPU XLA flags (an unknown flag aborts JAX's start-up)?
#                    a rejected flag is named and left out of every later step
#   mfu     (170 s)  benchmarks/gpu_mfu.py: PyTorch peer (torch.compile) and jaxpar at GPT-2 124M B16 and
#                    350M B8, T1024, bf16; ratios in $OUT/gpu_mfu.json
#   lane    (200 s)  python -m pytest -m gpu (tests/gpu/): attention paths, bf16 vs fp32, CLI runs, checkpoints
#                    across devices, torchref on CUDA, the MFU line; junit XML in $OUT/lane.xml
#   profile  (50 s)  benchmarks/gpu_profile.py: the 350M step's kernels by class and HLO op, $OUT/gpu_profile.json
# The limits add up to 470 s (490 if a flag is rejected); a step that runs out is cut, its rc 124 logged, and the next one starts.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu_session.log") 2>&1

# step NAME SECONDS CMD...: one step, its rc and seconds
step() {
  local name=$1 t=$2 start rc
  shift 2
  echo "=== $name ($(date -u +%T))"
  start=$(date +%s)
  timeout "$t" bash -c '"$@"' _ "$@"
  rc=$?
  echo "=== $name: rc=$rc in $(($(date +%s) - start)) s"
  return $rc
}

# py SCRIPT ARGS...: a benchmark with the GPU XLA flags this jaxlib rejected ($BAD) left out. The benchmarks
# share a persistent compilation cache: the profile's and the levers' base 350M step are gpu_mfu's, compiled once
py() {
  JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxpar_gpu_cache} python3 -c 'import runpy, sys
import jaxpar.run.xla_flags as x
bad = set(filter(None, sys.argv[1].split(",")))
x.GPU_FLAGS = tuple(f for f in x.GPU_FLAGS if f.split("=")[0] not in bad)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")' "$BAD" "$@"
}

probe() {
  python3 -c 'import os, sys
import jaxpar.run.xla_flags as x
x.GPU_FLAGS = tuple(f for f in x.GPU_FLAGS if f.split("=")[0] not in set(filter(None, sys.argv[1].split(","))))
x.apply_gpu_defaults(); print("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
import jax; print(jax.devices())' "$BAD" > "$OUT/probe.txt" 2>&1
}
BAD=""
export BAD
export -f py probe

step env 20 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
  python3 -c "import sys, jax, jaxlib, flax, optax, numpy, torch; print(sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__, \"numpy\", numpy.__version__, \"torch\", torch.__version__, torch.version.cuda)"'

if ! step flags 30 probe; then
  cat "$OUT/probe.txt"
  # XLA names them: "Unknown flags in XLA_FLAGS: --a=1 --b=2"
  BAD=$(grep -o 'Unknown flags\? in XLA_FLAGS:.*' "$OUT/probe.txt" | sed 's/.*XLA_FLAGS://' | tr ' ' '\n' |
        grep -- '^--' | cut -d= -f1 | paste -sd, -)
  echo "rejected GPU flags: ${BAD:-none named}"
  export BAD
  step flags_again 20 probe || cat "$OUT/probe.txt"
else
  cat "$OUT/probe.txt"
fi

if [ "${1:-}" = levers ]; then
  # each lever is its own gpu_mfu.py process, which applies every GPU flag: a flag rejected above fails its levers
  step levers 330 py benchmarks/gpu_levers.py --budget 300 --out "$OUT/gpu_levers.json"
  echo "=== done ($(date -u +%T))"
  exit 0
fi

step mfu 170 py benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu.json"
# The lane's subprocesses run the CLI, which applies GPU_FLAGS itself: $BAD reaches them through XLA_FLAGS
# only if the probe found none rejected (the usual case); otherwise the lane reports the same abort.
step lane 200 python3 -m pytest -m gpu -q -rA -p no:cacheprovider --junitxml="$OUT/lane.xml"
step profile 50 py benchmarks/gpu_profile.py --model gpt2-medium --batch 8 --out "$OUT/gpu_profile.json"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
echo "=== done ($(date -u +%T))"
