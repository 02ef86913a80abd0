"""Mesh utilities (public API): build and validate the `(data, fsdp, tensor, pipe)` mesh.

    from jaxpar.config import MeshConfig
    from jaxpar.mesh import build_mesh
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))   # 8 devices
"""

from __future__ import annotations

import dataclasses
import math
import os

from jaxpar.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor", "pipe")  # canonical order: outermost (slowest links) first


def resolve_mesh_config(mc: MeshConfig, n_devices: int) -> MeshConfig:
    """Fill the one -1 axis so the product equals `n_devices`; check the product."""
    sizes = dataclasses.asdict(mc)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    wild = [k for k, v in sizes.items() if v == -1]
    if len(wild) > 1:
        raise ConfigError(f"at most one mesh axis may be -1 (got {sizes})")
    if wild:
        if n_devices % fixed:
            raise ConfigError(f"mesh {sizes}: {n_devices} devices are not divisible by the fixed axes' product {fixed}")
        sizes[wild[0]] = n_devices // fixed
    elif fixed != n_devices:
        shown = "×".join(f"{k}={v}" for k, v in sizes.items())
        raise ConfigError(f"mesh {shown} has {fixed} devices but {n_devices} are available")
    return MeshConfig(**sizes)


def mesh_size(mc: MeshConfig) -> int:
    """Devices the mesh needs (-1 counted as 1)."""
    return math.prod(max(v, 1) for v in dataclasses.asdict(mc).values())


def emulate_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices. Must run before JAX initialises its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def build_mesh(mc: MeshConfig, devices=None):
    """A `jax.sharding.Mesh` with axes (data, fsdp, tensor, pipe) over all `devices`.

    Unlike `jax.make_mesh`, a product smaller than the device count is an error, not a
    silent subset. Axis types are Explicit-free (`Auto`): shardings come from our rules
    via jit in/out shardings and `with_sharding_constraint`.
    """
    import jax
    from jax.sharding import AxisType

    devices = jax.devices() if devices is None else list(devices)
    mc = resolve_mesh_config(mc, len(devices))
    shape = tuple(getattr(mc, a) for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
