"""Device table for the planner: peak FLOP/s, memory, interconnect, overridable by key.

Figures are vendor datasheet numbers (dense, no sparsity). Bandwidths are per device and
per direction, which is what the ring formulas in `cost.py` expect: NVLink 3 (A100) is
600 GB/s bidirectional -> 300 GB/s; NVLink 4 (H100/H200) 900 -> 450 GB/s. Between nodes
(`node_size` devices per node) traffic goes over InfiniBand: one 400 Gb/s NDR (200 Gb/s HDR
for A100) NIC per GPU -> 50 (25) GB/s; 25 GB/s per GPU is also Megatron-LM's Selene cluster
(8 × 200 Gb/s HDR per 8-GPU node). The `cpu` row describes emulated host devices
(`--xla_force_host_platform_device_count`): all on one node, "bandwidth" is memcpy speed.

GPU `efficiency` is the measured Maximum Achievable Matmul FLOPS (MAMF, bf16, best shape) over
the dense peak, from stas00/ml-engineering compute/accelerator/README.md ("Maximum Achievable
Matmul FLOPS comparison table", CUDA 12.1): A100 SXM 267.9 / 312 = 0.859, H100 SXM 792.1 / 989
= 0.801 (H200: the same GH100 die, H100's figure). It was 0.55 before 2026-11-23, which is below
what Megatron-LM measured end to end on A100 (52-57% of peak with everything else included:
benchmarks/results/published_configs.md). `hbm_bandwidth` is the datasheet HBM bandwidth, used by
the elementwise-traffic term of GPUs (cost.py): A100 40GB 1.555 TB/s, A100 80GB SXM 2.039 TB/s,
H100 SXM 3.35 TB/s, H200 4.8 TB/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gpt2common.grammar import setting
from jaxpar.config import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind. Units: FLOP/s, bytes, bytes/s, seconds."""

    name: str = setting(doc="table row")
    peak_flops: float = setting(doc="dense bf16 FLOP/s per device (fp32 for cpu)")
    peak_flops_fp32: float = setting(doc="FLOP/s per device when precision=fp32")
    memory: float = setting(doc="bytes of device memory (16GB, 40GiB, 1.6e10)")
    bandwidth: float = setting(doc="intra-node link, per device and direction, bytes/s")
    inter_bandwidth: float = setting(doc="inter-node link, per device and direction, bytes/s")
    latency: float = setting(doc="seconds per collective hop (alpha)")
    node_size: int = setting(8, "devices sharing the fast intra-node link")
    efficiency: float = setting(0.55, "best achievable fraction of peak on large matmuls, in [0, 1]")
    knee_rows: float = setting(256.0, "matmul rows (tokens) at which half of efficiency is reached; 0: off")
    knee_cols: float = setting(128.0, "matmul width (n_embd / tensor) at which half of it is reached; 0: off")
    overlap: float = setting(0.0, "fraction of data/fsdp collective time hidden behind compute, in [0, 1]")
    reduce_scatter: bool = setting(True, "false: the backend lowers reduce-scatter to all-reduce (XLA:CPU)")
    native_bf16: bool = setting(True, "false: bf16 matmuls run upcast to fp32 (XLA:CPU), fp32 activations")
    # 0: fused away, see README
    mem_bandwidth: float = setting(0.0, "elementwise traffic bytes/s; 0: not modelled")
    shared_host: bool = setting(False, "true: emulated devices share one host's peak and mem_bandwidth")
    hbm_bandwidth: float = setting(0.0, "accelerator memory bytes/s for memory-bound kernels; 0: not modelled")
    # jaxpar.models.mixed_attention on XLA:CPU
    causal_blocks: bool = setting(False, "true: the attention core runs by causal query blocks")
    # XLA:CPU's unrolled layer loop (gpt2.scan_unroll), whose fp32 step keeps more than the rolled
    # scan (activations.unrolled_layer_bytes). GPUs unroll too (up to 24 layers), memory unmeasured: False.
    unrolled_fp32: bool = setting(False, "true: fp32 steps keep the unrolled layer loop's extra activations")


DEVICES: dict[str, DeviceSpec] = {
    # Emulated devices on one host; fitted on a 2-core AMD EPYC by benchmarks/cpu_calibration.py
    # (rerun it and copy its figures for another host).
    "cpu": DeviceSpec("cpu", 2.7e11, 2.7e11, 16 * GiB, 1.1e9, 1.1e9, 2e-5, node_size=1 << 30, efficiency=0.5,
                      knee_rows=128.0, knee_cols=32.0, reduce_scatter=False, native_bf16=False, mem_bandwidth=6.2e9,
                      shared_host=True, causal_blocks=True, unrolled_fp32=True),
    "a100-40g": DeviceSpec("a100-40g", 312e12, 19.5e12, 40 * GiB, 300e9, 25e9, 5e-6, efficiency=0.859, overlap=0.5,
                           hbm_bandwidth=1.555e12),
    "a100-80g": DeviceSpec("a100-80g", 312e12, 19.5e12, 80 * GiB, 300e9, 25e9, 5e-6, efficiency=0.859, overlap=0.5,
                           hbm_bandwidth=2.039e12),
    "h100": DeviceSpec("h100", 989e12, 67e12, 80 * GiB, 450e9, 50e9, 3e-6, efficiency=0.801, overlap=0.5,
                       hbm_bandwidth=3.35e12),
    "h200": DeviceSpec("h200", 989e12, 67e12, 141e9, 450e9, 50e9, 3e-6, efficiency=0.801, overlap=0.5,
                       hbm_bandwidth=4.8e12),
}



def spec_for_device_kind(kind: str) -> DeviceSpec | None:
    """The row for a JAX `device.device_kind` ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3",
    "NVIDIA H200"): matched by family (the name before "-"), then by the memory suffix when a family
    has several rows (a100-80g <-> "80GB"). None when no GPU row matches: the `cpu` row describes
    the calibration host, not whatever CPU this is (train measures that one)."""
    k = kind.lower()
    rows = [s for n, s in DEVICES.items() if n != "cpu" and n.split("-")[0] in k]
    for s in rows:
        if "-" in s.name and s.name.split("-")[1] + "b" in k:
            return s
    return rows[0] if rows else None


_ZERO_OK = ("mem_bandwidth", "knee_rows", "knee_cols", "hbm_bandwidth")  # fields where 0 switches a term off

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1024, "mib": 1024**2, "gib": GiB, "tib": 1024**4}


def parse_bytes(raw: str | float, key: str = "memory_limit") -> float:
    """'16GB' -> 16e9, '16GiB' -> 16·2^30, '1.5e9' -> 1.5e9. Raises ConfigError."""
    if isinstance(raw, (int, float)):
        return float(raw)
    s = str(raw).strip().lower().replace("_", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        if unit not in _UNITS:
            raise ValueError
        v = float(num) * _UNITS[unit]
        if not math.isfinite(v):  # float() reads 'inf' and 'nan' (and 1e400 overflows): no size is either
            raise ValueError
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a size (e.g. 16GB, 40GiB, 1.6e10)") from None
    if v <= 0:
        raise ConfigError(f"{key}={raw!r} must be positive")
    return v


def get_device(kind: str, overrides: dict[str, str] | None = None) -> DeviceSpec:
    """Table row `kind` with `{field: raw value}` overrides (from `device.<field>=` keys)."""
    if kind not in DEVICES:
        raise ConfigError(f"device={kind!r} is not known (choose from {', '.join(DEVICES)})")
    spec = DEVICES[kind]
    kw = {}
    types = {f.name: f.type for f in dataclasses.fields(DeviceSpec)}
    for k, raw in (overrides or {}).items():
        if k not in types or k == "name":
            valid = ", ".join(f"device.{f}" for f in types if f != "name")
            raise ConfigError(f"unknown key 'device.{k}' (valid: {valid})")
        try:
            if k == "memory":
                v = parse_bytes(raw, "device.memory")
            elif k == "node_size":
                v = int(raw)
            elif k in ("reduce_scatter", "native_bf16", "shared_host", "causal_blocks", "unrolled_fp32"):
                v = str(raw).lower() in ("1", "true", "yes")
            else:
                v = float(raw)
        except ConfigError:  # a ValueError too: parse_bytes' own line (not a size, must be positive) stands
            raise
        except ValueError:
            raise ConfigError(f"device.{k}={raw!r} is not a number") from None
        if not math.isfinite(v):  # 'nan', 'inf': every estimate would be nan or 0 s, not an error
            raise ConfigError(f"device.{k}={raw!r} is not a finite number")
        if k in _ZERO_OK and v < 0:
            raise ConfigError(f"device.{k}={raw!r} must be >= 0 (0: not modelled)")
        if not isinstance(v, bool) and v <= 0 and k not in _ZERO_OK + ("overlap",):
            raise ConfigError(f"device.{k}={raw!r} must be positive")
        if k in ("efficiency", "overlap") and not 0 <= v <= 1:
            raise ConfigError(f"device.{k}={raw!r} must be in [0, 1]")
        kw[k] = v
    return dataclasses.replace(spec, **kw)
