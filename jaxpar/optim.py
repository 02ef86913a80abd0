"""The optimizer tail in one pass per parameter: clip, AdamW, apply and the non-finite guard.

`train.make_optimizer` (optax: clip_by_global_norm -> adamw with a decay mask) stays the
definition of the optimizer and of its state tree (init, checkpoints, shardings); `make_update`
computes the same step on that state with the same float operations in the same order, so the
results are bit-identical (tests/test_optim.py). What changes is what XLA:CPU emits: optax's
update -> apply_updates -> `where(finite, new, old)` chain became ~7 array passes per leaf
(clipped gradient, mu, nu and params each materialised, a reduction over the new params for the
finite flag, then three selects; 18 array reads + 7 writes), because the finite flag needed the
new weights' norm before anything could be kept. Here the flag is known before the update (loss
and gradient norm), so the guard is a scalar select inside each fusion and XLA emits, per leaf,
one divide (the clipped gradient), mu, nu and the params: 11 reads + 4 writes, no copies
(benchmarks/README.md, profile_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import TrainConfig


def _replace_states(opt_state: Any, adam: Callable, sched: Callable) -> Any:
    """opt_state with every ScaleByAdamState mapped by `adam` and ScaleByScheduleState by `sched`
    (optax's chain is nested tuples of NamedTuples; the tree structure is kept exactly)."""
    if isinstance(opt_state, optax.ScaleByAdamState):
        return adam(opt_state)
    if isinstance(opt_state, optax.ScaleByScheduleState):
        return sched(opt_state)
    if isinstance(opt_state, tuple):
        items = [_replace_states(s, adam, sched) for s in opt_state]
        return type(opt_state)(*items) if hasattr(opt_state, "_fields") else tuple(items)
    return opt_state


def adam_states(opt_state: Any) -> tuple[optax.ScaleByAdamState, optax.ScaleByScheduleState]:
    """The one ScaleByAdamState (count, mu, nu) and ScaleByScheduleState (count) of
    `train.make_optimizer`'s state: what a training-state dir holds besides the weights."""
    adams, scheds = [], []
    _replace_states(opt_state, lambda s: adams.append(s) or s, lambda s: scheds.append(s) or s)
    if len(adams) != 1 or len(scheds) != 1:
        raise ValueError(f"expected one ScaleByAdamState and one ScaleByScheduleState in {opt_state}")
    return adams[0], scheds[0]


def with_adam_states(opt_state: Any, count: Any, mu: Any, nu: Any, schedule_count: Any) -> Any:
    """`opt_state` (any leaves: arrays or ShapeDtypeStructs) with the AdamW count and moments and
    the schedule count replaced; the tree structure is kept, so shardings still apply."""
    return _replace_states(opt_state, lambda s: s._replace(count=count, mu=mu, nu=nu),
                           lambda s: s._replace(count=schedule_count))


def make_update(tc: TrainConfig, schedule: optax.Schedule, mask_fn: Callable) -> Callable:
    """(grads, grad_norm, opt_state, params, ok) -> (params, opt_state), the step of
    `train.make_optimizer(tc)` (schedule = train.lr_schedule(tc), mask_fn = train.decay_mask).

    grad_norm: optax.tree.norm(grads) (the clip's norm; XLA computes it once). ok: a scalar bool,
    isfinite(loss) & isfinite(grad_norm): when False nothing changes (params, mu, nu, counts).
    A weight whose own new value is not finite although loss and gradients are (train.eps=0 with
    an underflowed nu, a beta that rounds to 1 in fp32, or lr·update overflowing fp32) keeps its old value, so the state never holds
    a non-finite number; before, such a step was dropped whole, at the cost of a second pass."""
    b1, b2, eps, wd, clip = tc.beta1, tc.beta2, tc.eps, tc.weight_decay, tc.grad_clip

    def update(grads, grad_norm, opt_state, params, ok):
        adam, sched = adam_states(opt_state)
        count = optax.safe_increment(adam.count)
        # optax.tree.bias_correction's denominators, computed once: written inside the per-leaf
        # expression, XLA turned m / bc into m * (1 / bc), which rounds differently (1 ulp).
        bc1, bc2 = 1 - b1**count, 1 - b2**count
        step_size = -1 * schedule(sched.count)  # optax.scale_by_learning_rate flips the sign
        mask = mask_fn(params)

        def leaf(p, g, m, v, decay):
            # p, g, m, v: one parameter's (...) fp32 arrays; each line is the optax op it replaces.
            gc = g  # optax.clip_by_global_norm (max_norm = clip)
            if clip > 0:
                gc = jax.lax.select(grad_norm < clip, g, (g / grad_norm.astype(g.dtype)) * clip)
            m_new = optax.tree.update_moment(gc, m, b1, 1)  # optax.scale_by_adam
            v_new = optax.tree.update_moment_per_elem_norm(gc, v, b2, 2)
            # The guard sits on the moments *before* the params read them: the params fusion then
            # reads the stored new moments (the old ones are overwritten in place, no copies).
            m2 = jnp.where(ok & jnp.isfinite(m_new), m_new, m)
            v2 = jnp.where(ok & jnp.isfinite(v_new), v_new, v)
            u = (m2 / bc1.astype(m2.dtype)) / (jnp.sqrt(v2 / bc2.astype(v2.dtype) + 0.0) + eps)  # eps_root = 0
            if decay and wd != 0:  # optax.add_decayed_weights under the mask
                u = u + wd * p
            u = jnp.array(step_size, dtype=u.dtype) * u  # optax.scale_by_schedule
            p_new = jnp.asarray(p + u).astype(p.dtype)  # optax.apply_updates
            return jnp.where(ok & jnp.isfinite(p_new), p_new, p), m2, v2

        out = jax.tree.map(leaf, params, grads, adam.mu, adam.nu, mask)
        new_p, new_m, new_v = jax.tree.transpose(jax.tree.structure(params), jax.tree.structure((0, 0, 0)), out)
        bump = lambda c: jnp.where(ok, optax.safe_increment(c), c)  # noqa: E731
        new_state = _replace_states(opt_state, lambda s: s._replace(count=bump(s.count), mu=new_m, nu=new_v),
                                    lambda s: s._replace(count=bump(s.count)))
        return new_p, new_state

    return update
