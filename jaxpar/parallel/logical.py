"""Logical-axis annotations for activations, resolved against the active rules.

Model code calls `constrain(x, ("batch", "seq", "embed"))` and stays free of
parallelism: outside an `activation_rules(...)` context this is the identity; inside
one it becomes `with_sharding_constraint` on the mesh axes the rules map those names to.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxpar_activation_rules", default=None)

Rules = Mapping[str, "str | tuple[str, ...] | None"]


def spec_for(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Logical names -> PartitionSpec. A mesh axis is used at most once per spec
    (the first dim that claims it wins), as MaxText's logical_to_mesh_axes does."""
    used: set[str] = set()
    out = []
    for name in names:
        axes = rules.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules):
    """Within this context (at trace time) `constrain` shards activations by `rules`."""
    token = _ACTIVE.set((mesh, dict(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, rules)))
