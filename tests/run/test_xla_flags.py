"""GPU default XLA flags: added only where a GPU is, never over a user's value, all known to this jaxlib."""

import os
import subprocess
import sys

from jaxpar.run import xla_flags


def test_user_value_wins_and_the_rest_are_added():
    out = xla_flags.with_gpu_defaults("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d")
    flags = out.split()
    assert flags[:2] == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_dump_to=/tmp/d"]
    assert flags[2:] == list(xla_flags.GPU_FLAGS[1:])


def test_not_applied_when_jax_platforms_is_cpu():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert xla_flags.apply_gpu_defaults(env) is False
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_every_flag_is_known_to_this_jaxlib():
    # XLA parses every flag (GPU ones too) at backend start and aborts on an unknown one,
    # so a renamed flag fails here on CPU rather than on a user's GPU.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(xla_flags.GPU_FLAGS)}
    code = "import jax; print(int(jax.numpy.ones(3).sum()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "3", r.stderr[-1000:]


def test_the_defaults_are_the_ones_the_readme_lists():
    # README.md "GPU XLA flags" and benchmarks/README.md "gpu_mfu.py" (the Triton flag: measured on one H200)
    assert xla_flags.with_gpu_defaults("").split() == [
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
    ]
