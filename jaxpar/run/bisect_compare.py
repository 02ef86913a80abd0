"""The comparison of `jaxpar bisect`: rows in model order, each against the bound of its kind
(jaxpar/tolerances.py), and the table.

Order: the forward's intermediates (HF module tree order), the loss, every parameter's gradient in
backward order (the reverse of the forward's parameter order), then AdamW's first moment, second
moment and update of every parameter in that order.

Bounds per kind (fp32 / a bf16 side):
  activation  inf-relative, max|a - b| / max|b|: `bisect.fp32.activation` / `model.bf16.logits`
  loss        |a - b| / |b|: `parity.fp32.loss` / `parity.bf16.loss`
  grad        inf-relative: `parity.fp32.grad` / l2-relative: `parity.bf16.grad_l2`
  mu, nu, update   per element: what exact AdamW (float64, step 1 from zero moments) makes of the
              two sides' own clipped gradients differs by, plus two fp32 AdamW implementations'
              rounding on one input (`tolerances.adamw_step_bounds`). One relative bound cannot do:
              Adam's first update is g / (|g| + eps), so a gradient entry at rounding level
              (c_attn.bias's key part: zero up to rounding) turns 1e-11 of noise into a change of
              order lr. Such a row's `bound` column is that per-element bound scaled to its
              max rel, so `max rel <= bound` still reads as within.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxpar import tolerances as T


def forward_order(n_layer: int) -> list[str]:
    """Every intermediate name bisect knows, in the order the forward computes them."""
    names = ["transformer.wte", "transformer.wpe", "transformer.drop"]
    for i in range(n_layer):
        p = f"transformer.h.{i}"
        names += [f"{p}.ln_1", f"{p}.attn.c_attn", f"{p}.attn.attn_scores", f"{p}.attn.attn_weights",
                  f"{p}.attn.c_proj:input", f"{p}.attn.c_proj", f"{p}.ln_2:input", f"{p}.ln_2", f"{p}.mlp.c_fc",
                  f"{p}.mlp.act", f"{p}.mlp.c_proj", p]
    return names + ["transformer.ln_f", "lm_head", "loss"]


def param_order(n_layer: int) -> list[str]:
    """HF parameter names in the order the forward first uses them."""
    names = ["transformer.wte.weight", "transformer.wpe.weight"]
    for i in range(n_layer):
        p = f"transformer.h.{i}"
        for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"{p}.{m}.weight", f"{p}.{m}.bias"]
    return names + ["transformer.ln_f.weight", "transformer.ln_f.bias"]


DECAYED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def bounds(bf16: bool) -> dict[str, tuple[str, float, str]]:
    """kind -> (tolerances entry, value, metric)."""
    names = ({"activation": ("model.bf16.logits", "inf"), "loss": ("parity.bf16.loss", "rel"),
              "grad": ("parity.bf16.grad_l2", "l2")} if bf16 else
             {"activation": ("bisect.fp32.activation", "inf"), "loss": ("parity.fp32.loss", "rel"),
              "grad": ("parity.fp32.grad", "inf")})
    factor = T.BF16_HOST_FACTOR if bf16 else 1.0
    return {k: (n, T.TABLE[n].value * factor, m) for k, (n, m) in names.items()}


@dataclass(frozen=True)
class Row:
    name: str
    shape: tuple
    max_abs: float
    max_rel: float
    bound: float
    over: bool


def relative_row(name: str, a, b, bound: float, metric: str) -> Row:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return Row(name, b.shape, math.inf, math.inf, bound, True)
    d = np.abs(a - b)
    max_abs = float(d.max(initial=0.0))
    if metric == "l2":
        num, den = float(np.linalg.norm(d)), float(np.linalg.norm(b))
    else:
        num, den = max_abs, float(np.abs(b).max(initial=0.0))
    rel = 0.0 if num == 0 else (num / den if den > 0 else math.inf)
    return Row(name, b.shape, max_abs, rel, bound, not rel <= bound)  # NaN is over


def first_lr(tc) -> float:
    """The learning rate of update 0 from its definition (torchref.model.lr_at): lr/(W+1) with
    W = min(warmup_steps, steps) > 0, else the cosine's start, lr."""
    warm = min(tc.warmup_steps, tc.steps)
    return tc.lr / (warm + 1) if warm > 0 else tc.lr


def _clipped(grads: dict, clip: float) -> dict:
    """optax.clip_by_global_norm in float64: g * clip / ||g|| where ||g|| >= clip."""
    g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
    s = clip / norm if clip > 0 and norm >= clip else 1.0
    return {k: v * s for k, v in g.items()}


def _sensitivity(g, delta, eps):
    """max |f(g + e) - f(g)| over |e| <= delta, f(g) = g / (|g| + eps) (Adam's step-1 direction):
    f' = eps / (|g| + eps)^2 is largest where |g| is smallest, and f moves by 2 at most."""
    near = np.maximum(np.abs(g) - delta, 0.0)
    return np.minimum(2.0, delta * eps / (near + eps) ** 2)


def adam_rows(ra: dict, rb: dict, train, lr0: float, order: list[str], grad_bound: float) -> list[Row]:
    """mu, nu and update rows: per-element bounds (module docstring). The gradient a step applies may
    differ from the one bisect read by `grad_bound` (relative to the tensor's max|g|): jaxpar's step
    is another compilation of the same loss, so noise-level entries differ between the two."""
    b1, b2, eps, wd = train.beta1, train.beta2, train.eps, train.weight_decay
    ga, gb = _clipped(ra["grads"], train.grad_clip), _clipped(rb["grads"], train.grad_clip)
    n = sum(v.size for v in gb.values())
    rows: dict[str, list[Row]] = {"mu": [], "nu": [], "update": []}
    for name in order:
        p, g_a, g_b = np.asarray(rb["params"][name], np.float64), ga[name], gb[name]
        w = wd if name.endswith(DECAYED) else 0.0
        delta = grad_bound * float(np.abs(g_b).max(initial=0.0))  # permitted |g_a - g_b|, clipped scale
        gap = np.abs(g_a - g_b) + delta
        direction = np.abs(g_a / (np.abs(g_a) + eps) - g_b / (np.abs(g_b) + eps)) + _sensitivity(g_b, delta, eps)
        carried = {"mu": (1 - b1) * gap, "nu": (1 - b2) * gap * (2 * np.abs(g_b) + gap),
                   "update": lr0 * np.minimum(direction, 2.0)}  # step 1: m_hat = g, sqrt(v_hat) = |g|
        d_mu, d_nu, d_p = T.adamw_step_bounds(n, p, g_b, 0.0, 0.0, b1=b1, b2=b2, eps=eps, wd=w, lr=lr0, count=1)
        for kind, rounding in (("mu", d_mu), ("nu", d_nu), ("update", d_p)):
            a, b = np.asarray(ra[kind][name], np.float64), np.asarray(rb[kind][name], np.float64)
            allowed = carried[kind] + rounding
            d = np.abs(a - b)
            scale = float(np.abs(b).max(initial=0.0))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = float(np.max(np.where(d == 0, 0.0, d / allowed), initial=0.0))
            rel = float(d.max(initial=0.0)) / scale if scale > 0 else (0.0 if not d.any() else math.inf)
            shown = rel / ratio if ratio > 0 else float(np.min(allowed)) / scale if scale > 0 else 0.0
            rows[kind].append(Row(f"{'adam.' if kind != 'update' else ''}{kind}/{name}", b.shape,
                                  float(d.max(initial=0.0)), rel, shown, not ratio <= 1.0))
    return rows["mu"] + rows["nu"] + rows["update"]


def compare(ra: dict, rb: dict, cfg_a, cfg_b, kinds: tuple[str, str]) -> tuple[list[Row], list[str]]:
    """(rows in model order, names only one side has). kinds: the sides' kinds (jaxpar, torchref, hf)."""
    bf16 = any(k == "jaxpar" and c.precision == "bf16" for k, c in zip(kinds, (cfg_a, cfg_b)))
    bd = bounds(bf16)
    L = cfg_b.model.n_layer
    rows, one_sided = [], sorted(set(ra["acts"]) ^ set(rb["acts"]))
    for name in forward_order(L):
        if name in ra["acts"] and name in rb["acts"]:
            _, value, metric = bd["loss" if name == "loss" else "activation"]
            rows.append(relative_row(name, ra["acts"][name], rb["acts"][name], value, metric))
    backward = param_order(L)[::-1]
    _, value, metric = bd["grad"]
    rows += [relative_row(f"grad/{n}", ra["grads"][n], rb["grads"][n], value, metric) for n in backward]
    rows += adam_rows(ra, rb, cfg_b.train, first_lr(cfg_b.train), backward, value)
    return rows, one_sided


def _g(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2e}"


def report(rows: list[Row], one_sided: list[str], a_text: str, b_text: str) -> tuple[str, Row | None]:
    """(the table and the verdict line, the first row over its bound or None)."""
    first = next((r for r in rows if r.over), None)
    w = max(len(r.name) for r in rows)
    lines = [f"a: {a_text}", f"b: {b_text}", "",
             f"{'tensor':<{w}}  {'shape':<18}  {'max abs':>9}  {'max rel':>9}  {'bound':>9}  verdict"]
    for r in rows:
        shape = "x".join(map(str, r.shape)) or "()"
        lines.append(f"{r.name:<{w}}  {shape:<18}  {_g(r.max_abs):>9}  {_g(r.max_rel):>9}  {_g(r.bound):>9}  "
                     f"{'OVER' if r.over else 'ok'}")
    if one_sided:
        lines.append(f"not compared (one side only): {', '.join(one_sided)}")
    over = sum(r.over for r in rows)
    if first is None:
        lines.append(f"clean: all {len(rows)} tensors within their bounds")
    else:
        lines.append(f"first over its bound: {first.name} (max rel {_g(first.max_rel)} > bound {_g(first.bound)}; "
                     f"{over} of {len(rows)} tensors over)")
    return "\n".join(lines), first
