"""The model's hand-written numerics against the plain expressions they replace (hypothesis).

Each property draws shapes (odd sizes, T = 1, one head, head dim 1), dtypes (fp32, bf16) and
magnitudes (large logits, zero-variance rows, large means) and compares the replacement's forward
and backward with jax.vjp of the plain expression. Causal attention has no all-masked row (the
diagonal is always visible), so none is drawn.

Bounds, element by element, derived from the arithmetic (jaxpar.tolerances: U_FP32, U_BF16,
gamma(n) = n·u/(1 - n·u), PAIR = 2 for two implementations each within the bound of exact): a sum
of n terms in fp32 is within gamma(n)·S of exact, S the sum of the terms' absolute values; the
bound of each comparison is written next to it with its S. A bf16 output adds one bf16 rounding
that may fall either side: 2·U_BF16·|reference|. Each side is jitted once per drawn shape and
dtype (`both`), so shapes come from short lists and the values, magnitudes and seeds vary freely.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxpar.models import chunked, mixed_attention, precision
from jaxpar.models.gelu import gelu_tanh
from jaxpar.models.layernorm import layer_norm
from jaxpar.models.softmax import causal_softmax
from jaxpar.tolerances import PAIR, TINY_FP32, U_BF16, U_FP32, gamma

F32, BF16 = jnp.float32, jnp.bfloat16
SLOW = 20  # the `-m slow` variants draw this many times more examples
N_FAST = 6  # drawn examples per property in the default suite (plus the explicit @example ones)
DTYPES = st.sampled_from(["fp32", "bf16"])


def f64(x):
    return np.asarray(jnp.asarray(x, F32), np.float64)


def check(what, got, want, bound):
    """|got - want| <= bound element-wise (all float64 numpy); the message names the worst element."""
    got, want = f64(got), f64(want)
    bound = np.broadcast_to(bound, want.shape)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all() and np.isfinite(want).all(), what
    over = np.abs(got - want) - bound
    i = np.unravel_index(np.argmax(over), over.shape)
    assert over[i] <= 0, (f"{what}: |{got[i]:.8g} - {want[i]:.8g}| = {abs(got[i] - want[i]):.3e} over its bound "
                          f"{bound[i]:.3e} at {tuple(int(j) for j in i)} ({int((over > 0).sum())} of {over.size})")


def out_rounding(dtype, want):
    """A bf16 result: both sides round their fp32 values once, possibly to neighbouring bf16 values."""
    return 2 * U_BF16 * np.abs(f64(want)) if dtype == BF16 else 0.0


def arrays(seed, shape, scale=1.0, shift=0.0):
    return np.random.default_rng(seed).normal(shift, scale, shape).astype(np.float32)


_JITS: dict = {}


def both(key, f, plain, args, g, extra=()):
    """(outputs, cotangents) of the replacement f and of jax.vjp of the plain expression, each jitted
    once per `key` (the shapes, dtypes and static settings f and plain close over); `extra`: traced
    non-differentiated arguments (targets)."""
    if key not in _JITS:
        def vjp_of(fn):
            def run(args, extra, g):
                y, vjp = jax.vjp(lambda *a: fn(*a, *extra), *args)
                return y, vjp(g)
            return jax.jit(run)
        _JITS[key] = vjp_of(f), vjp_of(plain)  # two programs: XLA cannot merge the two sides
    ours, ref = _JITS[key]
    return ours(args, extra, g), ref(args, extra, g)


# ----------------------------------------------------------------------------- LayerNorm

EPS = 1e-5  # the model's LayerNorm epsilon


def plain_layer_norm(x, w, b):
    x32 = x.astype(F32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + EPS) * w + b).astype(x.dtype)


LN = st.fixed_dictionaries({
    # D = 1 (x̂ = 0), odd D, one row; a few shapes so that their compiles are shared by the examples
    "shape": st.sampled_from([(1, 1, 1), (2, 3, 7), (1, 2, 33)]),
    "dtype": DTYPES, "shift": st.sampled_from([0.0, 3.0, -1e3]), "scale": st.sampled_from([1e-3, 1.0, 30.0]),
    "flat_rows": st.booleans(),  # every other row constant: zero variance, x - mean = 0
    "seed": st.integers(0, 2**16)})


def _layernorm_property(h):
    B, T, D = h["shape"]
    dt = F32 if h["dtype"] == "fp32" else BF16
    xs = arrays(h["seed"], (B, T, D), h["scale"], h["shift"])
    if h["flat_rows"]:
        xs[:, ::2] = xs[:, ::2, :1]
    x = jnp.asarray(xs).astype(dt)
    w, b = jnp.asarray(arrays(h["seed"] + 1, (D,), 0.5, 1.0)), jnp.asarray(arrays(h["seed"] + 2, (D,), 0.5))
    g = jnp.asarray(arrays(h["seed"] + 3, (B, T, D))).astype(dt)
    (y, (dx, dw, db)), (y0, (dx0, dw0, db0)) = both(("ln", x.shape, dt), lambda x, w, b: layer_norm(x, w, b, EPS),
                                                    plain_layer_norm, (x, w, b), g)
    # forward: the same expression in the same order -> bit-identical
    check("layernorm y", y, y0, 0.0)
    # backward, per row of D, both within gamma(D + 6) of the textbook formula evaluated on the shared
    # fp32 x - mean and rstd: S = rstd·(|dx̂| + mean|dx̂| + (|x̂| + κ)·mean|dx̂·x̂|), dx̂ = g·w; κ = mean|x|·rstd
    # is autodiff's extra term through the mean inside the variance (analytically 0, computed as
    # mean(x - mean) = gamma(D)·mean|x| in fp32).
    x64, g64, w64 = f64(x), f64(g), f64(w)
    x32 = x.astype(F32)
    xc32 = x32 - x32.mean(-1, keepdims=True)  # the fp32 values both sides share (x - mean is not 0 on a flat row)
    xc = f64(xc32)
    rstd = f64(jax.lax.rsqrt(jnp.square(xc32).mean(-1, keepdims=True) + EPS))
    xhat, dxhat = xc * rstd, g64 * w64
    kappa = np.abs(x64).mean(-1, keepdims=True) * rstd
    s_dx = rstd * (np.abs(dxhat) + np.abs(dxhat).mean(-1, keepdims=True)
                   + (np.abs(xhat) + kappa) * np.abs(dxhat * xhat).mean(-1, keepdims=True))
    check("layernorm dx", dx, dx0, PAIR * gamma(D + 6) * s_dx + out_rounding(dt, dx0))
    # dw, db: sums over the B·T rows (fp32 whatever x's dtype); x̂ shared: S = Σ|g·x̂|, Σ|g|
    rows = B * T
    check("layernorm dw", dw, dw0, PAIR * gamma(rows + 2) * np.abs(g64 * xhat).sum((0, 1)))
    check("layernorm db", db, db0, PAIR * gamma(rows) * np.abs(g64).sum((0, 1)))


@settings(max_examples=N_FAST, deadline=None)
@example(h={"shape": (1, 1, 1), "dtype": "fp32", "shift": 3.0, "scale": 1.0, "flat_rows": False, "seed": 0})  # D = 1
@given(h=LN)
def test_layernorm_equals_autodiff_of_the_plain_expression(h):
    _layernorm_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=LN)
def test_layernorm_equals_autodiff_of_the_plain_expression_slow(h):
    _layernorm_property(h)


# ----------------------------------------------------------------------------- causal softmax


def plain_causal_softmax(s):
    T = s.shape[-1]
    return jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, jnp.finfo(F32).min), axis=-1)


SOFTMAX = st.fixed_dictionaries({
    "shape": st.sampled_from([(1, 1, 1), (2, 1, 5), (1, 3, 31)]),  # (B, N, T): T = 1, one head, odd T
    "scale": st.sampled_from([1.0, 30.0, 1e4]),  # 1e4: logits whose exp overflows without the max shift
    "seed": st.integers(0, 2**16)})


def _softmax_property(h):
    B, N, T = h["shape"]
    s = jnp.asarray(arrays(h["seed"], (B, N, T, T), h["scale"]))
    g = jnp.asarray(arrays(h["seed"] + 1, (B, N, T, T)))
    (p, (ds,)), (p0, (ds0,)) = both(("softmax", s.shape), causal_softmax, plain_causal_softmax, (s,), g)
    check("softmax p", p, p0, 0.0)  # forward: jax.nn.softmax of the same masked scores
    assert (f64(p)[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0).all()  # no weight on the future
    # ds = p·(g - Σ_s g·p): a sum of T products, a subtraction and a product: gamma(T + 3), S = p·(|g| + Σ|g|p);
    # each of those T + 3 operations may also flush a result below TINY_FP32 to zero (p near 1e-37 at scale 30)
    p64, g64 = f64(p0), f64(g)
    check("softmax ds", ds, ds0, PAIR * (gamma(T + 3) * p64 * (np.abs(g64) + (np.abs(g64) * p64).sum(-1, keepdims=True))
                                         + (T + 3) * TINY_FP32))


@settings(max_examples=N_FAST, deadline=None)
@example(h={"shape": (1, 1, 1), "scale": 1.0, "seed": 0})  # T = 1: p = 1, ds = 0
@given(h=SOFTMAX)
def test_causal_softmax_equals_autodiff_of_the_plain_expression(h):
    _softmax_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=SOFTMAX)
def test_causal_softmax_equals_autodiff_of_the_plain_expression_slow(h):
    _softmax_property(h)


# ----------------------------------------------------------------------------- tanh GELU

C_GELU, A_GELU = math.sqrt(2 / math.pi), 0.044715


def plain_gelu(x):
    return jax.nn.gelu(x.astype(F32), approximate=True).astype(x.dtype)


GELU = st.fixed_dictionaries({"n": st.sampled_from([1, 257]), "dtype": DTYPES, "scale": st.sampled_from([0.1, 3.0, 30.0, 1e3]),
                              "seed": st.integers(0, 2**16)})


def _gelu_property(h):
    dt = F32 if h["dtype"] == "fp32" else BF16
    x = jnp.asarray(arrays(h["seed"], (h["n"],), h["scale"])).astype(dt)
    g = jnp.asarray(arrays(h["seed"] + 1, (h["n"],))).astype(dt)
    (y, (dx,)), (y0, (dx0,)) = both(("gelu", x.shape, dt), gelu_tanh, plain_gelu, (x,), g)
    check("gelu y", y, y0, 0.0)  # jax.nn.gelu's fp32 expression, rounded once to x's dtype
    # dy/dx = 0.5(1 + t) + 0.5·x(1 - t²)·c(1 + 3a·x²), t = tanh(z), z = c(x + a·x³): about 10 roundings
    # on each side (gamma(10)) of S = 0.5(1 + |t|) + 0.5|x|(1 + t²)c(1 + 3a·x²), plus t's own error
    # (tanh: 2u; z: 4u of c(|x| + a|x|³), through dt/dz = 1 - t²) times |d(dy/dx)/dt| = 0.5 + |x t|c(1 + 3a·x²)
    x64, g64 = f64(x), np.abs(f64(g))
    z = C_GELU * (x64 + A_GELU * x64**3)
    t = np.tanh(z)
    poly = C_GELU * (1 + 3 * A_GELU * x64 * x64)
    s = 0.5 * (1 + np.abs(t)) + 0.5 * np.abs(x64) * (1 + t * t) * poly
    dt_err = 2 * U_FP32 + (1 - t * t) * 4 * U_FP32 * C_GELU * (np.abs(x64) + A_GELU * np.abs(x64) ** 3)
    bound = PAIR * g64 * (gamma(10) * s + (0.5 + np.abs(x64 * t) * poly) * dt_err)
    check("gelu dx", dx, dx0, bound + out_rounding(dt, dx0))


@settings(max_examples=N_FAST, deadline=None)
@given(h=GELU)
def test_gelu_equals_autodiff_of_the_plain_expression(h):
    _gelu_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=GELU)
def test_gelu_equals_autodiff_of_the_plain_expression_slow(h):
    _gelu_property(h)


# ----------------------------------------------------------------------------- attention core


def plain_attention(q, k, v):
    """gpt2.Attention._core without the hand-written core: fp32 scores, causal softmax, probs in q's dtype."""
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=F32) / math.sqrt(q.shape[-1])
    return jnp.einsum("bnts,bsnh->btnh", plain_causal_softmax(s).astype(q.dtype), v)


def attention_bounds(q, k, v, g, bf16: bool):
    """Per side bounds on (o, dq, dk, dv), float64, through the chain scores -> probs -> o and
    dP = g·vᵀ -> dS = p(dP - Σ dP·p)/√Hd -> dq = dS·k, dk = dSᵀ·q, dv = pᵀ·g: each dot of length n
    gamma(n) of its absolute products; probs move by p·2·max_s|δs| (softmax's condition) plus the
    exp/sum/divide (gamma(T + 3)). bf16 policy: probs rounded to bf16 for the dots (both sides), dP
    rounded (the plain core's bf16 dot output) and dS rounded (the hand-written core, as autocast):
    U_BF16 of each, counted on both sides."""
    ub = U_BF16 if bf16 else 0.0
    T, hd = q.shape[1], q.shape[-1]
    sc = 1 / math.sqrt(hd)
    A = np.abs
    ein = np.einsum
    causal = np.tril(np.ones((T, T), bool))
    s = ein("btnh,bsnh->bnts", q, k) * sc
    s = np.where(causal, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    e_s = gamma(hd + 1) * ein("btnh,bsnh->bnts", A(q), A(k)) * sc
    e_row = np.where(causal, e_s, 0).max(-1, keepdims=True)
    e_p = p * (2 * e_row + gamma(T + 3) + ub)
    e_o = ein("bnts,bsnh->btnh", e_p, A(v)) + gamma(T) * ein("bnts,bsnh->btnh", p, A(v))
    dP = ein("btnh,bsnh->bnts", g, v)
    e_dP = gamma(hd) * ein("btnh,bsnh->bnts", A(g), A(v)) + ub * A(dP)
    e_dv = ein("bnts,btnh->bsnh", e_p, A(g)) + gamma(T) * ein("bnts,btnh->bsnh", p, A(g))
    c = (dP * p).sum(-1, keepdims=True)
    e_c = (e_dP * p + A(dP) * e_p).sum(-1, keepdims=True) + gamma(T) * (A(dP) * p).sum(-1, keepdims=True)
    dS = p * (dP - c) * sc
    e_dS = (e_p * (A(dP) + A(c)) + p * (e_dP + e_c) + gamma(3) * p * (A(dP) + A(c))) * sc + ub * A(dS)
    e_dq = ein("bnts,bsnh->btnh", e_dS, A(k)) + gamma(T) * ein("bnts,bsnh->btnh", A(dS), A(k))
    e_dk = ein("bnts,btnh->bsnh", e_dS, A(q)) + gamma(T) * ein("bnts,btnh->bsnh", A(dS), A(q))
    return e_o, e_dq, e_dk, e_dv


# (B, T, N, Hd): head dim 1 and one head; T = 1; odd T and N; T = 128: two causal query blocks
# (mixed_attention._fwd_blocked; its compile is the costliest, so the default suite runs it as an
# explicit example and the slow variant draws it)
ATTN_SHAPES = [(1, 5, 1, 1), (2, 1, 2, 8), (1, 7, 3, 8)]
ATTN_DRAW = dict(dtype=DTYPES, scale=st.sampled_from([0.3, 1.0, 8.0]),  # 8: |scores| ~ 64·√Hd, one-hot probs
                 seed=st.integers(0, 2**16))
ATTN = st.fixed_dictionaries({"shape": st.sampled_from(ATTN_SHAPES), **ATTN_DRAW})
ATTN_SLOW = st.fixed_dictionaries({"shape": st.sampled_from([*ATTN_SHAPES, (1, 128, 1, 4), (2, 256, 2, 2)]),
                                   **ATTN_DRAW})


def _attention_property(h):
    shape = h["shape"]
    dt = F32 if h["dtype"] == "fp32" else BF16
    q, k, v = (jnp.asarray(arrays(h["seed"] + i, shape, h["scale"] if i < 2 else 1.0)).astype(dt) for i in range(3))
    g = jnp.asarray(arrays(h["seed"] + 3, shape)).astype(dt)
    (o, grads), (o0, grads0) = both(("attn", shape, dt), lambda q, k, v: mixed_attention.causal_attention(q, k, v, dt),
                                    plain_attention, (q, k, v), g)
    bounds = attention_bounds(*(f64(a) for a in (q, k, v, g)), dt == BF16)
    for name, a, b, e in zip(("o", "dq", "dk", "dv"), (o, *grads), (o0, *grads0), bounds):
        check(f"attention {name}", a, b, PAIR * e + out_rounding(dt, b))
    # the fused-projection entry point (the model's bf16 path) at the same bounds
    qkv = jnp.stack([q, k, v], axis=2)
    (o2, (dqkv,)), _ = both(("attn_qkv", shape, dt), lambda a: mixed_attention.causal_attention_qkv(a, dt),
                            lambda a: a[:, :, 0], (qkv,), g)  # (the second program is not used)
    for name, a, b, e in zip(("qkv o", "dq", "dk", "dv"), (o2, *jnp.unstack(dqkv, axis=2)), (o0, *grads0), bounds):
        check(f"attention {name}", a, b, PAIR * e + out_rounding(dt, b))


@settings(max_examples=N_FAST, deadline=None)
@example(h={"shape": (1, 7, 3, 8), "dtype": "bf16", "scale": 1.0, "seed": 0})
@example(h={"shape": (1, 128, 1, 4), "dtype": "fp32", "scale": 1.0, "seed": 0})
@given(h=ATTN)
def test_attention_core_equals_autodiff_of_the_plain_core(h):
    _attention_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=ATTN_SLOW)
def test_attention_core_equals_autodiff_of_the_plain_core_slow(h):
    _attention_property(h)


# ----------------------------------------------------------------------------- chunked cross-entropy


def plain_cross_entropy(x, w, targets, policy):
    """The unchunked head + loss: logits of the whole (B, T, V), mean of -log_softmax at the target."""
    logits = policy.einsum("btd,vd->btv", x, w)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1))


CE = st.fixed_dictionaries({
    # (B, T, D, V, chunks): chunk length 1 (chunks = T), odd sizes, one chunk
    "shape": st.sampled_from([(2, 6, 5, 7, 3), (1, 8, 4, 33, 8), (3, 1, 3, 2, 1)]),
    "dtype": DTYPES, "scale": st.sampled_from([0.1, 1.0, 10.0]),  # 10: logits ~ 100·√D, one-hot softmax
    "seed": st.integers(0, 2**16)})


def _ce_property(h):
    B, T, D, V, k = h["shape"]
    policy = precision.get_policy(h["dtype"])
    dt = policy.compute_dtype
    x = jnp.asarray(arrays(h["seed"], (B, T, D), h["scale"])).astype(dt)
    w = jnp.asarray(arrays(h["seed"] + 1, (V, D), h["scale"]))
    y = jnp.asarray(np.random.default_rng(h["seed"]).integers(0, V, (B, T)).astype(np.int32))
    (loss, (dx, dw)), (loss0, (dx0, dw0)) = both(
        ("ce", h["shape"], dt), lambda x, w, y: chunked.chunked_cross_entropy(x, w, y, k, policy),
        lambda x, w, y: plain_cross_entropy(x, w, y, policy), (x, w), jnp.float32(1.0), (y,))
    # logits l = x·wᵀ (D-length dots, gamma(D)); nll = logsumexp(l) - l[y]: an error δ in the logits
    # moves it by <= 2 max δ, the exp/sum/log/subtract by gamma(V + 4) of |lse| + max|l| + |l[y]|; the
    # loss is the mean of the B·T nll (gamma(B·T + 1) of Σ|nll|). bf16: x and w enter the dot as bf16
    # on both sides (the same products).
    xr, wr = f64(x), f64(w.astype(dt))
    n = B * T
    logits = np.einsum("btd,vd->btv", xr, wr)
    e_l = gamma(D) * np.einsum("btd,vd->btv", np.abs(xr), np.abs(wr)).max(-1)  # (B, T)
    m = logits.max(-1)
    lse = m + np.log(np.exp(logits - m[..., None]).sum(-1))
    lt = np.take_along_axis(logits, f64(y).astype(int)[..., None], -1)[..., 0]
    e_nll = 2 * e_l + gamma(V + 4) * (np.abs(lse) + np.abs(m) + np.abs(lt))
    check("chunked ce loss", loss, loss0, PAIR * (e_nll.sum() + gamma(n + 1) * np.abs(lse - lt).sum()) / n)
    # dlogits = (softmax - onehot) / (B·T): p moves by p·(2 max δl + gamma(V + 4)); dx = dl·w (V terms),
    # dw = Σ_{B,T} dl·x; bf16: dl rounded to bf16 for both dots (mixed_einsum, both sides)
    ub = U_BF16 if dt == BF16 else 0.0
    p = np.exp(logits - lse[..., None])
    dl = (p - (np.arange(V) == f64(y)[..., None])) / n
    e_dl = (p * (2 * e_l + gamma(V + 4))[..., None]) / n + (U_FP32 + ub) * np.abs(dl)
    e_dx = np.einsum("btv,vd->btd", e_dl, np.abs(wr)) + gamma(V) * np.einsum("btv,vd->btd", np.abs(dl), np.abs(wr))
    e_dw = np.einsum("btv,btd->vd", e_dl, np.abs(xr)) + gamma(n) * np.einsum("btv,btd->vd", np.abs(dl), np.abs(xr))
    check("chunked ce dx", dx, dx0, PAIR * e_dx + out_rounding(dt, dx0))
    check("chunked ce dw", dw, dw0, PAIR * e_dw)


@settings(max_examples=N_FAST, deadline=None)
@example(h={"shape": (2, 6, 5, 7, 3), "dtype": "fp32", "scale": 1.0, "seed": 0})
@given(h=CE)
def test_chunked_cross_entropy_equals_autodiff_of_the_plain_loss(h):
    _ce_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=CE)
def test_chunked_cross_entropy_equals_autodiff_of_the_plain_loss_slow(h):
    _ce_property(h)


# ----------------------------------------------------------------------------- chunked MLP


def plain_mlp(x, w_fc, b_fc, w_proj, b_proj, policy):
    """gpt2.MLP's unchunked path."""
    h = gelu_tanh(policy.linear("btd,df->btf", x, w_fc, b_fc))
    return policy.linear("btf,fd->btd", h, w_proj, b_proj, x_elementwise=True)


GELU_D1, GELU_D2 = 1.13, 0.8  # max |gelu'| and |gelu''| of the tanh GELU (1.129 at x = 1.5; 0.798 at 0)

MLP = st.fixed_dictionaries({
    # (B, T, D, F, chunks): one chunk, F/k = 1 (every hidden unit its own chunk), odd D
    "shape": st.sampled_from([(2, 3, 5, 12, 3), (1, 2, 4, 8, 8), (1, 1, 3, 6, 1)]),
    "dtype": DTYPES, "scale": st.sampled_from([0.3, 1.0, 3.0]), "seed": st.integers(0, 2**16)})


def _mlp_property(h):
    B, T, D, F, k = h["shape"]
    policy = precision.get_policy(h["dtype"])
    dt = policy.compute_dtype
    sd = h["seed"]
    x = jnp.asarray(arrays(sd, (B, T, D), h["scale"])).astype(dt)
    ws = (jnp.asarray(arrays(sd + 1, (D, F), 0.5)), jnp.asarray(arrays(sd + 2, (F,), 0.5)),
          jnp.asarray(arrays(sd + 3, (F, D), 0.5)), jnp.asarray(arrays(sd + 4, (D,), 0.5)))
    g = jnp.asarray(arrays(sd + 5, (B, T, D))).astype(dt)
    (y, grads), (y0, grads0) = both(("mlp", h["shape"], dt), lambda x, *w: chunked.chunked_mlp(x, *w, k, policy),
                                    lambda x, *w: plain_mlp(x, *w, policy), (x, *ws), g)
    # forward: h = x·W_fc + b (D + 1 terms), a = gelu(h) (|gelu'| <= 1.13, ~10 roundings), y = a·W_proj + b
    # (F + 1 terms; the chunks only reorder this sum). bf16: h and a rounded to bf16 on both sides (may
    # straddle: 2·U_BF16), the chunked y rounded once more before its bias (U_BF16·|a·W_proj|).
    ub = U_BF16 if dt == BF16 else 0.0
    A = np.abs
    xr = f64(x)
    wf, bf, wp, bp = (f64(w.astype(dt)) if i in (0, 2) else f64(w) for i, w in enumerate(ws))
    gr = f64(g)
    pre = np.einsum("btd,df->btf", xr, wf) + bf
    e_h = gamma(D + 1) * (np.einsum("btd,df->btf", A(xr), A(wf)) + A(bf)) + 2 * ub * A(pre)
    a = f64(gelu_tanh(jnp.asarray(pre, F32)))
    e_a = GELU_D1 * e_h + (gamma(10) + 2 * ub) * A(a)
    y_nb = np.einsum("btf,fd->btd", a, wp)
    e_y = (np.einsum("btf,fd->btd", e_a, A(wp)) + gamma(F + 1) * (np.einsum("btf,fd->btd", A(a), A(wp)) + A(bp))
           + ub * A(y_nb))
    check("chunked mlp y", y, y0, PAIR * e_y + out_rounding(dt, y0))
    # backward: da = g·W_projᵀ (D terms), dh = da·gelu'(h) (gelu' moves by |gelu''|·δh), dx = dh·W_fcᵀ
    # (F terms, summed over the chunks in fp32), dW_fc = Σ_{B,T} x·dh, db_fc = Σ dh, dW_proj = Σ a·g,
    # db_proj = Σ g (B·T terms each). bf16: dh rounded to bf16 (gelu's output dtype, 2·U_BF16).
    n = B * T
    da = np.einsum("btd,fd->btf", gr, wp)
    e_da = gamma(D) * np.einsum("btd,fd->btf", A(gr), A(wp))
    dh = da * (f64(jax.grad(lambda z: jnp.sum(gelu_tanh(z)))(jnp.asarray(pre, F32))))
    e_dh = GELU_D1 * e_da + GELU_D2 * A(da) * e_h + (gamma(10) + 2 * ub) * A(dh)
    e = {
        "dx": np.einsum("btf,df->btd", e_dh, A(wf)) + gamma(F) * np.einsum("btf,df->btd", A(dh), A(wf)),
        "dw_fc": np.einsum("btd,btf->df", A(xr), e_dh) + gamma(n) * np.einsum("btd,btf->df", A(xr), A(dh)),
        "db_fc": e_dh.sum((0, 1)) + gamma(n) * A(dh).sum((0, 1)),
        "dw_proj": np.einsum("btf,btd->fd", e_a, A(gr)) + gamma(n) * np.einsum("btf,btd->fd", A(a), A(gr)),
        "db_proj": gamma(n) * A(gr).sum((0, 1)),
    }
    for (name, bound), a_, b_ in zip(e.items(), grads, grads0):
        check(f"chunked mlp {name}", a_, b_, PAIR * bound + (out_rounding(dt, b_) if name == "dx" else 0.0))


@settings(max_examples=N_FAST, deadline=None)
@example(h={"shape": (2, 3, 5, 12, 3), "dtype": "fp32", "scale": 1.0, "seed": 0})
@given(h=MLP)
def test_chunked_mlp_equals_autodiff_of_the_plain_mlp(h):
    _mlp_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=MLP)
def test_chunked_mlp_equals_autodiff_of_the_plain_mlp_slow(h):
    _mlp_property(h)


# ----------------------------------------------------------------------------- mixed_einsum's weight gradient

# (spec, a_elementwise, a shape, b shape): the model's three matmul forms. The weight gradient
# takes XLA's operand order or the swapped one behind the optimization barrier depending on the
# sizes (precision._weight_grad): the first of each pair swaps, the second does not (fp32; the
# swap decision for bf16 differs through a_cost, so both dtypes see both sides too).
EINSUMS = [
    ("btd,df->btf", False, (2, 8, 8), (8, 2)), ("btd,df->btf", False, (1, 3, 2), (2, 8)),
    ("btf,fd->btd", True, (2, 8, 8), (8, 2)), ("btf,fd->btd", False, (1, 2, 3), (3, 8)),
    ("btd,vd->btv", False, (2, 8, 8), (2, 8)), ("btd,vd->btv", False, (1, 3, 2), (9, 2)),
]
EINSUM = st.fixed_dictionaries({"case": st.sampled_from(EINSUMS), "dtype": DTYPES,
                                "scale": st.sampled_from([1e-3, 1.0, 1e3]), "seed": st.integers(0, 2**16)})


def swaps(case, dtype) -> bool:
    """Whether mixed_einsum's weight gradient takes the swapped operand order (an optimization_barrier)."""
    spec, elem, sa, sb = case
    a, b = jnp.zeros(sa, dtype), jnp.zeros(sb, F32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda b: precision.mixed_einsum(spec, a, b, dtype, elem).sum()))(b)
    return "optimization_barrier" in str(jaxpr)


def _einsum_property(h):
    spec, elem, sa, sb = h["case"]
    dt = F32 if h["dtype"] == "fp32" else BF16
    a = jnp.asarray(arrays(h["seed"], sa, h["scale"])).astype(dt)
    b = jnp.asarray(arrays(h["seed"] + 1, sb))
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, a, b)).shape
    g = jnp.asarray(arrays(h["seed"] + 2, out_shape))

    def plain(a, b):
        return jnp.einsum(spec, precision.dot_operand(a, dt), precision.dot_operand(b, dt),
                          preferred_element_type=F32)

    (y, (da, db)), (y0, (da0, db0)) = both(("einsum", h["case"], dt), lambda a, b: precision.mixed_einsum(spec, a, b, dt, elem),
                                            plain, (a, b), g)
    check("mixed_einsum y", y, y0, 0.0)  # the same dot
    # da = g·bᵀ over the output-only dim, db = Σ_{B,T} a·g: each within gamma(length) of its absolute
    # products; bf16: the cotangent enters both backward dots rounded to bf16 (mixed_einsum) where
    # autodiff keeps it fp32, U_BF16 of the same sums; da rounded to a's dtype.
    ta, tb = precision._transpose_specs(spec)
    ub = U_BF16 if dt == BF16 else 0.0
    ar, br, gr = f64(a), f64(b.astype(dt)), f64(g)
    s_a, s_b = spec.split("->")[0].split(",")
    size = dict(zip(s_a, sa)) | dict(zip(s_b, sb))
    len_a = math.prod(size[c] for c in s_b if c not in s_a)  # da sums over b's own dims (f, or v)
    len_b = math.prod(size[c] for c in s_a if c not in s_b)  # db sums over (B, T)
    check("mixed_einsum da", da, da0, PAIR * (gamma(len_a) + ub) * np.einsum(ta, np.abs(gr), np.abs(br))
          + out_rounding(dt, da0))
    check("mixed_einsum db", db, db0, PAIR * (gamma(len_b) + ub) * np.einsum(tb, np.abs(ar), np.abs(gr)))


def test_the_einsum_cases_take_both_weight_gradient_orders():
    """Each dtype sees both operand orders of precision._weight_grad (so the property covers both)."""
    for dtype in (F32, BF16):
        assert {swaps(c, dtype) for c in EINSUMS} == {True, False}, dtype


@settings(max_examples=N_FAST, deadline=None)
@example(h={"case": EINSUMS[2], "dtype": "fp32", "scale": 1.0, "seed": 0})  # the MLP's c_proj dW, swapped
@given(h=EINSUM)
def test_mixed_einsum_equals_autodiff_of_the_plain_einsum(h):
    _einsum_property(h)


@pytest.mark.slow
@settings(max_examples=N_FAST * SLOW, deadline=None)
@given(h=EINSUM)
def test_mixed_einsum_equals_autodiff_of_the_plain_einsum_slow(h):
    _einsum_property(h)
