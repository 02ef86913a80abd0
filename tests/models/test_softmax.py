"""jaxpar.models.softmax.causal_softmax: the attention's causal fp32 softmax, whose backward saves only the probs.
Reference: autodiff of the plain masked softmax it replaced (written out below) and float64."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from jaxpar.models.softmax import causal_softmax
from jaxpar.tolerances import TABLE

B, N, T = 2, 3, 24
rng = np.random.default_rng(1)
S = (rng.standard_normal((B, N, T, T)) * 3).astype(np.float32)  # scores, some rows peaked
G = rng.standard_normal((B, N, T, T)).astype(np.float32)
CAUSAL = np.tril(np.ones((T, T), bool))


def plain(s):
    """jaxpar's attention softmax before the hand-written backward (saved the mask, masked scores, exp, probs)."""
    return jax.nn.softmax(jnp.where(jnp.asarray(CAUSAL), s, jnp.finfo(jnp.float32).min), axis=-1)


@jax.jit
def fwd_bwd(s, g):
    out = []
    for f in (causal_softmax, plain):
        p, vjp = jax.vjp(f, s)
        out.append((p, *vjp(g)))
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_forward_bitwise_and_backward_equals_autodiff_and_float64():
    (p, ds), (p0, ds0) = fwd_bwd(S, G)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(p0))
    assert np.all(np.asarray(p)[..., ~CAUSAL] == 0)  # causal: no weight on later keys
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-6)
    # masked entries get exactly no gradient (the scores there never reach the output)
    assert np.all(np.asarray(ds)[..., ~CAUSAL] == 0)
    bound = TABLE["softmax.fp32.grad"].value
    assert np.max(np.abs(np.asarray(ds0))) > 0.1
    assert _rel(ds, ds0) <= bound, _rel(ds, ds0)
    # float64: ds = p (g - sum(g p)) with p the exact causal softmax
    s64 = np.where(CAUSAL, S.astype(np.float64), -np.inf)
    p64 = np.exp(s64 - s64.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    g64 = G.astype(np.float64)
    ds64 = p64 * (g64 - (g64 * p64).sum(-1, keepdims=True))
    assert _rel(ds, ds64) <= bound, _rel(ds, ds64)


def test_saves_only_the_probs(capsys):
    # autodiff of the plain softmax saves three fp32 (B, N, T, T) arrays and a bool mask; this one
    # saves its output only
    s = jnp.asarray(S)
    print_saved_residuals(lambda s: jnp.sum(causal_softmax(s)), s)
    saved = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert [ln.split(" ")[0] for ln in saved] == [f"f32[{B},{N},{T},{T}]"], saved
    print_saved_residuals(lambda s: jnp.sum(plain(s)), s)
    theirs = [ln.split(" ")[0] for ln in capsys.readouterr().out.splitlines() if f"{T},{T}]" in ln]
    assert len(theirs) >= 3, theirs
