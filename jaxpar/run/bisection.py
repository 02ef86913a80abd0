"""`jaxpar bisect A B`: one training step of two runs from the same weights and batch, compared
tensor by tensor in model order; names the first tensor over its bound.

A run description is one string (`jaxpar.run.options.BisectOptions` has the grammar):
  jaxpar KEY=VALUE...                       any `jaxpar train` key, mesh.* / pipeline.* included
  torchref strategy=single [KEY=VALUE...]   torchref's model and optimizer mirror (one process)
  hf=DIR [KEY=VALUE...]                     transformers' GPT2LMHeadModel.from_pretrained(DIR)
Both sides start from one set of weights: DIR's when a side is hf=DIR (its shape: a model key beside it
that sets another shape is refused, naming it, as `train init=` does), else
`gpt2common.init.init_params(model, seed)`; the sides may differ in the model keys that set no shape
(model.layer_norm_epsilon, model.attention: compared, it is what bisect locates); and see one batch: (B, T+1) ids drawn by
numpy's default_rng(seed) (B, T = train.batch_size, train.seq_len; bisect's defaults 8 and 32, with
precision=fp32 and train.warmup_steps=0 unless a side sets them).

What is compared (jaxpar.run.bisect_compare has the bounds): the forward's named intermediates,
read on the jaxpar side by `nnx.capture` of the model's `_tap`s (jaxpar.models.gpt2) on the run's
mesh (gathered by device_get), on the torch side by forward hooks (torchref.bisect_taps), both named
after HF's module tree; the loss of the real step; every parameter's gradient (the layout's own
loss program: auto-sharded, tied, ZeRO-3 or pipeline); AdamW's moments and update (the real step,
`jaxpar.train.build_trainer`). The capture forward runs the plain model with the einsum attention
core (it materialises the probs; on CPU the same forward ops as the fused core, fp32_dots.loss = 0)
and without remat or chunking: those knobs show in the loss, gradients and update.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpt2common.grammar import parse_kv
from jaxpar import config as C
from jaxpar.config import ConfigError

# fp32 unless a side says precision=bf16; a batch small enough for a tiny model on a laptop; no warmup,
# so the one step moves the weights at the full lr (at lr/(W+1) an update of a weight near 1 is a few
# ulps of it, below what p_new - p can resolve), as parity_tests.common.PARITY_TRAIN
BASE = C.Config(precision="fp32", train=dataclasses.replace(C.TrainConfig(), batch_size=8, seq_len=32,
                                                            warmup_steps=0))
TORCH_KEYS = ("model", "model.", "seed", "train.")  # what a torchref / hf side may set
SIDE_KEYS = ("hf", "strategy")  # a side's own keys, not config keys: given once
# The model keys the shared weights fix: both sides must agree on them (and with an hf=DIR side's weights).
# The others (layer_norm_epsilon, attention; dropout must be 0) are each side's own, and compared.
SHAPE_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")


@dataclass(frozen=True)
class Side:
    label: str  # "a" | "b"
    text: str  # the run description as given
    kind: str  # "jaxpar" | "torchref" | "hf"
    cfg: C.Config
    hf_dir: str = ""


def split_args(argv: list[str]) -> tuple[str, str]:
    """`A B` (two quoted descriptions) or `a=A b=B` -> (A, B)."""
    keyed = parse_kv([a for a in argv if a.startswith(("a=", "b="))], once=True)  # a= twice: refused
    rest = [a for a in argv if not a.startswith(("a=", "b="))]
    if keyed and rest or len(keyed) + len(rest) != 2 or (keyed and set(keyed) != {"a", "b"}):
        shown = " ".join(shlex.quote(a) for a in argv) or "nothing"
        raise ConfigError(f"bisect takes two run descriptions, A B or a=A b=B (got {shown})")
    return (keyed["a"], keyed["b"]) if keyed else (rest[0], rest[1])


def _words(label: str, text: str) -> tuple[str, dict[str, Any]]:
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"{label}={text!r}: {e}") from None
    head = words[0] if words else ""
    if head.startswith("hf="):
        kind, rest = "hf", words
    elif head in ("jaxpar", "torchref"):
        kind, rest = head, words[1:]
    else:
        raise ConfigError(f"{label}={text!r}: a run description starts with jaxpar, torchref or hf=DIR")
    try:
        kv = parse_kv(rest, once=SIDE_KEYS)  # config keys: the last value, as in train
    except ConfigError as e:
        raise ConfigError(f"{label}={text!r}: {e}") from None
    # Both sides start from one set of weights (see the docstring): a jaxpar side's own start
    # would be dropped without a word, and both sides reported clean from the seed's init.
    if kind == "jaxpar" and (k := next((k for k in ("init", "init_state") if kv.get(k)), None)):
        raise ConfigError(f"{label}={text!r}: {k}= is not taken by bisect: both sides start from one set of "
                          "weights, the seed's init or an hf=DIR side's")
    return kind, kv


def _resolve(label: str, text: str, kv: dict, base: C.Config) -> C.Config:
    try:
        cfg = C.resolve_kv(kv, None, base)
    except ConfigError as e:
        raise ConfigError(f"{label}={text!r}: {e}") from None
    if cfg.model.dropout > 0:
        raise ConfigError(f"{label}={text!r}: model.dropout={cfg.model.dropout}: bisect compares deterministic "
                          "steps (dropout 0)")
    return cfg


def _check_shape_keys(label: str, text: str, kv: dict, mine, weights, hf_dir: str) -> None:
    """Refuse a side whose model keys (a preset, model.*) set another shape than the hf=DIR weights
    both sides start from, naming the keys, as `train init=` does (gpt2common.hf.check_init_model_keys);
    keys that agree, or set no shape, pass."""
    differ = [f for f in SHAPE_KEYS if getattr(mine, f) != getattr(weights, f)]
    if not differ:
        return
    shown = [f"model.{f}={getattr(mine, f)}" for f in differ if f"model.{f}" in kv]
    if "model" in kv and len(shown) < len(differ):  # the rest comes from the preset
        shown.insert(0, f"model={kv['model']}")
    theirs = ", ".join(f"{f}={getattr(weights, f)}" for f in differ)
    raise ConfigError(f"{label}={text!r}: model keys conflict with hf={hf_dir!r}, whose weights set the model's "
                      f"shape: {', '.join(shown)} (the weights have {theirs})")


def resolve_sides(a_text: str, b_text: str) -> tuple[Side, Side, dict]:
    """The two sides and the weights both start from (jaxpar's nested params, numpy fp32)."""
    from gpt2common import hf
    from gpt2common.init import init_params  # numpy: no JAX before the devices are set up

    parsed = {lab: (txt, *_words(lab, txt)) for lab, txt in (("a", a_text), ("b", b_text))}
    hf_dirs = {lab: kv["hf"] for lab, (_, kind, kv) in parsed.items() if kind == "hf"}
    base, params = BASE, None
    if hf_dirs:
        lab, d = next(iter(hf_dirs.items()))
        mc, params = hf.load_hf(d, f"{lab}: hf")
        base = dataclasses.replace(BASE, model=mc, model_name=f"hf:{d}")
    sides = []
    for lab, (txt, kind, kv) in parsed.items():
        kv = dict(kv)
        if kind == "torchref":
            if kv.pop("strategy", None) != "single":
                raise ConfigError(f"{lab}={txt!r}: bisect runs torchref in one process: give strategy=single")
        hf_dir = kv.pop("hf", "") if kind == "hf" else ""
        if kind != "jaxpar":
            bad = sorted(k for k in kv if not (k in TORCH_KEYS or k.startswith(TORCH_KEYS)))
            if bad:
                raise ConfigError(f"{lab}={txt!r}: key(s) {', '.join(bad)} are jaxpar's; a {kind} side takes "
                                  "model, model.*, seed and train.*")
        cfg = _resolve(lab, txt, kv, base)
        if hf_dirs:
            _check_shape_keys(lab, txt, kv, cfg.model, base.model, next(iter(hf_dirs.values())))
        sides.append(Side(lab, txt, kind, cfg, hf_dir))
    a, b = sides
    shape = [(f"model.{f}", lambda c, f=f: getattr(c.model, f)) for f in SHAPE_KEYS]
    for what, get in (*shape, ("seed", lambda c: c.seed),
                      ("train.batch_size", lambda c: c.train.batch_size), ("train.seq_len", lambda c: c.train.seq_len)):
        if get(a.cfg) != get(b.cfg):
            raise ConfigError(f"a and b must start from the same weights and batch: {what} is {get(a.cfg)} in "
                              f"a={a.text!r} and {get(b.cfg)} in b={b.text!r}")
    if len(set(hf_dirs.values())) > 1:
        raise ConfigError(f"a and b name two HF dirs ({', '.join(repr(d) for d in hf_dirs.values())}); "
                          "bisect starts both from one set of weights")
    if params is None:
        params = init_params(a.cfg.model, a.cfg.seed)
    return a, b, params


# Copies of every captured intermediate a bisect holds at its peak: per side the device's (the
# capture's outputs, the gradient's own residuals) and the host's (device_get), then the table's
# float64 differences of both sides (2 x 2): 8 in all, the torch side's within the same count.
COPIES = 8


def bisect_bytes(cfg: C.Config) -> int:
    """Bytes a bisect of `cfg`'s model and batch needs at its peak (fp32): COPIES x the captured
    intermediates. Per layer (B, T, D, H = batch, seq_len, n_embd, n_head): ln_1, c_attn (3D),
    attention scores and weights (B, H, T, T) each, c_proj in/out, resid_mid, ln_2, c_fc and act
    (4D each), mlp out, the block's out: 16 x B*T*D + 2 x B*H*T*T; plus wte, wpe, drop, ln_f
    (B, T, D) and the logits (B, T, V)."""
    mc, B, T = cfg.model, cfg.train.batch_size, cfg.train.seq_len
    per_layer = 16 * B * T * mc.n_embd + 2 * B * mc.n_head * T * T
    return COPIES * 4 * (mc.n_layer * per_layer + 4 * B * T * mc.n_embd + B * T * mc.vocab_size)


def available_bytes() -> int:
    """Host memory available now (/proc/meminfo MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(cfg: C.Config) -> None:
    """Refuse a batch whose bisect cannot fit this host, before anything is allocated: 100,000
    rows hung at 0% CPU, 20,000 aborted inside XLA (exit 134)."""
    need, have = bisect_bytes(cfg), available_bytes()
    if need > have:
        B, T = cfg.train.batch_size, cfg.train.seq_len
        raise ConfigError(f"train.batch_size={B} at train.seq_len={T} does not fit a bisect: it keeps every "
                          f"intermediate of both sides, about {need / 2**30:.1f} GiB, and this host has "
                          f"{have / 2**30:.1f} GiB available; lower train.batch_size or train.seq_len")


def batch(cfg: C.Config) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), (B, T) int32 each: one (B, T+1) draw of default_rng(seed), shifted by one."""
    B, T = cfg.train.batch_size, cfg.train.seq_len
    ids = np.random.default_rng(cfg.seed).integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


def mesh_devices(side: Side) -> int:
    from jaxpar.parallel.mesh import mesh_size

    return mesh_size(side.cfg.mesh) if side.kind == "jaxpar" else 1


def run_side(side: Side, params: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """{"acts": {HF name: array} + "loss", "grads", "mu", "nu", "update": {HF param: array}} of one step."""
    if side.kind == "jaxpar":
        from jaxpar.run.bisect_jax import run_jaxpar

        return run_jaxpar(side.cfg, params, x, y)
    from gpt2common import hf
    from torchref.bisect_taps import train_step
    from torchref.run_config import TrainSettings

    mc = side.cfg.model
    train = TrainSettings(**{f.name: getattr(side.cfg.train, f.name) for f in dataclasses.fields(TrainSettings)
                             if hasattr(side.cfg.train, f.name)})
    if side.kind == "torchref":
        from torchref.model import build_model

        model = build_model(hf.hf_config_dict(mc), hf.to_hf_state_dict(mc, params))
    else:
        from transformers import GPT2LMHeadModel

        # dropout is the run's (0), not the dir's resid/embd/attn_pdrop: as jaxpar's init= does; the epsilon
        # is the side's (the dir's unless the side sets model.layer_norm_epsilon)
        model = GPT2LMHeadModel.from_pretrained(side.hf_dir, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                layer_norm_epsilon=mc.layer_norm_epsilon)
        model.train()
    return train_step(model, mc.n_layer, x, y, train)


def main(argv: list[str]) -> int:
    """The CLI: resolve both sides (every error before JAX starts), run them, print the table."""
    import sys

    a, b, params = resolve_sides(*split_args(argv))
    check_fits(a.cfg)  # both sides share the model and batch (resolve_sides)
    if a.kind == "jaxpar" or b.kind == "jaxpar":
        from jaxpar.parallel import mesh

        big = max((s for s in (a, b) if s.kind == "jaxpar"), key=mesh_devices)
        mesh.setup_devices(big.cfg.mesh)
    from jaxpar.run.bisect_compare import compare, report

    x, y = batch(a.cfg)
    ra, rb = run_side(a, params, x, y), run_side(b, params, x, y)
    rows, one_sided = compare(ra, rb, a.cfg, b.cfg, (a.kind, b.kind))
    text, first = report(rows, one_sided, a.text, b.text)
    sys.stdout.write(text + "\n")
    return 1 if first is not None else 0
