"""jaxpar.models.gelu.gelu_tanh: the tanh GELU (HF "gelu_new") with a backward that saves only its input.
Reference: jax.nn.gelu(approximate=True) for values, the float64 derivative for gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from jaxpar.models.gelu import gelu_tanh
from jaxpar.tolerances import TABLE

X = (np.random.default_rng(0).standard_normal(65536) * 4).astype(np.float32)  # spans both tanh tails


def test_fp32_values_bitwise_equal_jax_gelu():
    ref = jax.jit(lambda x: jax.nn.gelu(x, approximate=True))(X)
    np.testing.assert_array_equal(np.asarray(jax.jit(gelu_tanh)(X)), np.asarray(ref))


def test_bf16_values_are_the_fp32_gelu_rounded_once():
    xb = jnp.asarray(X, jnp.bfloat16)
    got = jax.jit(gelu_tanh)(xb)
    assert got.dtype == jnp.bfloat16
    want = jax.jit(lambda x: jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(jnp.bfloat16))(xb)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_derivative_matches_float64():
    x64, c, a = X.astype(np.float64), np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(c * (x64 + a * x64**3))
    d = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * c * (1 + 3 * a * x64**2)
    g = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(gelu_tanh(x))))(X), np.float64)
    assert np.max(np.abs(g - d)) / np.max(np.abs(d)) <= TABLE["gelu.fp32.grad"].value
    # the cotangent scales the derivative and keeps the input dtype (bf16 in, bf16 out)
    xb = jnp.asarray(X[:8], jnp.bfloat16)
    _, vjp = jax.vjp(gelu_tanh, xb)
    (gx,) = vjp(jnp.full((8,), 2.0, jnp.bfloat16))
    assert gx.dtype == jnp.bfloat16
    xb64 = np.asarray(xb, np.float64)
    tb = np.tanh(c * (xb64 + a * xb64**3))
    db = 0.5 * (1 + tb) + 0.5 * xb64 * (1 - tb * tb) * c * (1 + 3 * a * xb64**2)
    np.testing.assert_allclose(np.asarray(gx, np.float64), 2 * db, rtol=2**-8, atol=0)


def test_saves_only_its_input(capsys):
    # the point of the custom VJP: one (B, T, F) residual per GELU, not jax.nn.gelu's four
    x = jnp.ones((2, 3, 16), jnp.bfloat16)
    print_saved_residuals(lambda x: jnp.sum(gelu_tanh(x).astype(jnp.float32)), x)
    mine = [ln for ln in capsys.readouterr().out.splitlines() if "[2,3,16]" in ln]
    print_saved_residuals(lambda x: jnp.sum(jax.nn.gelu(x, approximate=True).astype(jnp.float32)), x)
    theirs = [ln for ln in capsys.readouterr().out.splitlines() if "[2,3,16]" in ln]
    assert len(mine) == 1 and "bf16[2,3,16]" in mine[0] and "argument" in mine[0], mine
    assert len(theirs) >= 3, theirs
