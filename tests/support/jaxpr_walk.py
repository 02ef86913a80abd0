"""Every equation of a jaxpr, nested ones included (scan and remat bodies, pjit, custom_jvp/vjp
calls, cond branches): for tests that census a traced computation's primitives."""

from __future__ import annotations

from jax.extend import core as jcore


def all_eqns(jaxpr):
    """Each equation of `jaxpr` (a Jaxpr or ClosedJaxpr), followed by those of the jaxprs in its params."""
    for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield e
        for v in e.params.values():
            for j in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(j, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    yield from all_eqns(j)


def dot_eqns(jaxpr):
    """The dot_general equations among `all_eqns(jaxpr)`."""
    return (e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general")
