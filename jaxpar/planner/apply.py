"""`jaxpar train plan=auto|plan.json`: turn a plan into the train config.

Runs before JAX initialises (so that CPU device emulation can still follow the plan). The
device count "at hand" is, in order: the `n_devices` argument; the count forced by
`XLA_FLAGS=--xla_force_host_platform_device_count=N`; the product of explicit `mesh.*` sizes
(on a CPU-only host that is how many devices would be emulated); on a host with a GPU plugin
installed, `jax.device_count()`; otherwise 1 for plan=auto and, for a plan file, the plan's
own count (a CPU-only host emulates any count).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

from jaxpar.config import Config, ConfigError, apply_overrides, validate
from jaxpar.planner.devices import spec_for_device_kind
from jaxpar.planner.plan import Plan, load_plan, plan_auto, plan_to_overrides


def _has_gpu_plugin() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                                  "jax_rocm60_plugin"))


def devices_at_hand(cfg: Config, plan: Plan | None = None) -> tuple[int, str]:
    """(device count, device kind for the planner's table); see the module docstring."""
    m = re.search(r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if m:
        return int(m.group(1)), "cpu"
    sizes = dataclasses.astuple(cfg.mesh)
    if all(v > 0 for v in sizes) and max(sizes) > 1:
        n = 1
        for v in sizes:
            n *= v
        return n, "cpu"
    if _has_gpu_plugin():
        import jax

        spec = spec_for_device_kind(jax.devices()[0].device_kind)
        return jax.device_count(), spec.name if spec is not None else "h100"
    return (plan.devices if plan is not None else 1), "cpu"


def apply_plan(cfg: Config, n_devices: int | None = None) -> Config:
    """Config with the plan's mesh, pipeline, grad_accum and remat applied (`cfg.plan` is
    "auto" or a plan.json path). ConfigError (exit 2) for a plan made for another device
    count, model, batch, seq_len or precision, or one needing features train lacks."""
    plan = None if cfg.plan == "auto" else load_plan(cfg.plan)
    n, kind = devices_at_hand(cfg, plan) if n_devices is None else (n_devices, "cpu")
    if plan is None:
        plan = plan_auto(cfg, n, kind)
    # The plan's mesh replaces whatever mesh sizes were given (they only told us the device count).
    base = dataclasses.replace(cfg, mesh=type(cfg.mesh)(), pipeline=type(cfg.pipeline)())
    try:
        return validate(apply_overrides(base, plan_to_overrides(plan, n, cfg)))
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"plan={cfg.plan!r} could not be applied ({e})") from None
