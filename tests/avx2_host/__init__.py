"""An emulated AVX2-only host (no AVX-512, no native bf16) on an AVX-512 machine, for the paths CI
takes on such a host: `python -m tests.avx2_host CMD...` runs CMD under `emulation_env()`.

What each cap does (checked on a 2-core AMD Zen 4 host, jax 0.10.2, torch 2.13.0; benchmarks/
README.md "Emulated AVX2-only host" has the figures):
  JAXPAR_CPU_FLAGS       the host's /proc/cpuinfo flags less avx512* and amx*: jaxpar.tolerances.
                         cpu_flags() (NATIVE_BF16, BF16_HOST_FACTOR, pinned bits, report labels)
  XLA_FLAGS              --xla_cpu_max_isa=AVX2 (sitecustomize.py, in every process): XLA's LLVM
                         codegen; AVX-512-only instructions / registers in the compiled kernels: 51 -> 0
  YNNPACK in XLA         sitecustomize.py sets its detected ISA to AVX2 (no env or flag exists):
                         a bf16 x bf16 -> fp32 dot 1024x512x1024 204 -> 54 GFLOP/s
  ATEN_CPU_CAPABILITY    avx2: torch.backends.cpu.get_cpu_capability() 'AVX512' -> 'AVX2'
  DNNL_MAX_CPU_ISA       AVX2: oneDNN, torch's bf16 matmul: mkldnn bf16 supported True -> False,
                         bf16 matmul 134 -> 1 GFLOP/s (ATen's scalar fallback), other bits
  MKL_ENABLE_INSTRUCTIONS AVX2: a no-op on this AMD host (MKL takes its AVX2 path on AMD anyway:
                         fp32 matmul bits unchanged); set for an Intel AVX-512 host
Not emulated: Eigen and the rest of jaxlib/torch compiled for a fixed ISA with no runtime dispatch,
and whatever a real AVX2 core rounds differently (none should: IEEE fp32 ops are exact-rounded).
"""

import os
from pathlib import Path

from jaxpar.tolerances import proc_cpu_flags

HOOK = str(Path(__file__).parent)  # holds sitecustomize.py
CAPS = {"JAXPAR_EMULATE_AVX2": "1", "ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def avx2_only(flags: set[str]) -> list[str]:
    """A CPU flag set as an AVX2-only host of the same family would report it."""
    return sorted(f for f in flags if not f.startswith(("avx512", "amx")))


def emulation_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(CAPS, JAXPAR_CPU_FLAGS=",".join(avx2_only(proc_cpu_flags())))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HOOK, env.get("PYTHONPATH", "")) if p)
    return env
