"""Default XLA flags on GPU: overlap collectives with compute and run matmuls in cuBLAS, as production
JAX trainers do.

XLA reads `XLA_FLAGS` once, when JAX initialises its backend, so the CLI calls
`apply_gpu_defaults()` before any JAX import. The flags (MaxText / NVIDIA JAX-Toolbox
practice; names checked against this jaxlib, which rejects unknown flags at start-up):

  --xla_gpu_enable_latency_hiding_scheduler=true   schedule collectives early, compute in between
  --xla_gpu_enable_highest_priority_async_stream=true  collectives on a high-priority stream
  --xla_gpu_enable_pipelined_all_gather=true       FSDP: layer i+1's all-gather during layer i
  --xla_gpu_enable_pipelined_reduce_scatter=true   FSDP: layer i's reduce-scatter during i-1
  --xla_gpu_enable_pipelined_all_reduce=true       DP/TP: same for all-reduces in the layer scan
  --xla_gpu_enable_while_loop_double_buffering=true  unroll the layer scan by 2 so the above can overlap
  --xla_gpu_{all_gather,reduce_scatter,all_reduce}_combine_threshold_bytes=134217728
                                                   fewer, larger collectives (128 MiB buckets)
  --xla_gpu_enable_triton_gemm=false               every matmul through cuBLAS, none as a Triton
                                                   gemm fusion (NVIDIA JAX-Toolbox's GPU_performance.md).
                                                   Measured on one H200, jax 0.11.2, bf16 seq 1024, median
                                                   step: GPT-2 124M B16 44.2 -> 38.3 ms, 350M B8 53.2 ->
                                                   50.4 ms (benchmarks/README.md, "gpu_mfu.py")

Only on a machine with an NVIDIA GPU (a /dev/nvidia* device or nvidia-smi on PATH) and unless
JAX_PLATFORMS excludes it; a flag the user already set in XLA_FLAGS keeps the user's value.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import MutableMapping

GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_triton_gemm=false",
)


def has_nvidia_gpu(env: MutableMapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def merge_flags(xla_flags: str, flags, override: bool) -> str:
    """`xla_flags` plus `flags`. A flag named in both: `override` keeps the one in `flags` (a
    benchmark lever), else the one already in `xla_flags` (the user's, over a default)."""
    names = {f.split("=", 1)[0] for f in (flags if override else xla_flags.split())}
    if override:
        return " ".join([*(f for f in xla_flags.split() if f.split("=", 1)[0] not in names), *flags])
    return " ".join([*xla_flags.split(), *(f for f in flags if f.split("=", 1)[0] not in names)])


def with_gpu_defaults(xla_flags: str) -> str:
    """`xla_flags` plus every GPU_FLAGS entry whose name it does not set already."""
    return merge_flags(xla_flags, GPU_FLAGS, override=False)


def apply_gpu_defaults(env: MutableMapping[str, str] | None = None) -> bool:
    """Add GPU_FLAGS to env["XLA_FLAGS"] when a GPU is present. Returns whether it did."""
    env = os.environ if env is None else env
    if not has_nvidia_gpu(env):
        return False
    env["XLA_FLAGS"] = with_gpu_defaults(env.get("XLA_FLAGS", ""))
    return True
