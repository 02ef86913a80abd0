"""jaxpar/parallel/tied.py's grouped loss on its own (one device, in-process): the mean over
the data groups equals the global mean, and each group gets its own dropout key.

Independent reference: the per-group values computed here one group at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpar.config import MeshConfig
from jaxpar.parallel import mesh as M
from jaxpar.parallel.tied import grouped_loss

G, B, T, V, D = 4, 8, 3, 11, 5


def _loss(params, x, y, key):
    """A stand-in model: mean over rows of (wte row-sum at the row's first token) plus, when a key
    is given, one uniform draw per call (what dropout consumes)."""
    rows = params["wte"]["weight"][x[:, 0]].sum(-1) * params["scale"]  # (rows,)
    noise = 0.0 if key is None else jax.random.uniform(key)
    return rows.mean() + noise


def test_groups_average_to_the_global_mean_and_draw_distinct_keys():
    mesh = M.build_mesh(MeshConfig(), jax.devices()[:1])
    params = {"wte": {"weight": jnp.arange(V * D, dtype=jnp.float32).reshape(V, D)},  # integers: exact sums,
              "scale": jnp.float32(0.5)}
    x = jnp.asarray(np.arange(B * T).reshape(B, T) % V, jnp.int32)
    grouped = jax.jit(grouped_loss(_loss, mesh, G, PartitionSpec(None, None)))
    with jax.set_mesh(mesh):
        plain = grouped(params, x, x, None)
        key = jax.random.PRNGKey(3)
        noisy = grouped({**params, "scale": jnp.float32(0.0)}, x, x, key)  # the draws alone
    assert float(plain) == float(_loss(params, x, x, None)) == 67.5  # 0.5 * mean(25 r + 10) over first tokens r
    # group g draws from split(key, G)[g]: different masks in every group, none reusing `key` itself
    draws = [float(jax.random.uniform(k)) for k in jax.random.split(key, G)]
    assert len(set(draws)) == G
    np.testing.assert_allclose(float(noisy), np.mean(draws), rtol=0, atol=1e-7)  # fp32 mean of 4 in [0, 1)
    assert abs(float(noisy) - float(jax.random.uniform(key))) > 1e-3
