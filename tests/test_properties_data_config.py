"""Property-based tests (hypothesis) of README claims whose input space is large: the data
pipeline, the key=value grammar through config.json, and the mesh sizes' resolution.

Each draws over the whole documented domain instead of a few hand-picked points; the `ci`
profile (root conftest.py) makes the draws the same on every run. Pure Python / numpy: no JAX
program is compiled here, so the example counts stay in the hundreds at < 3 s per test.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpt2common import data
from gpt2common.grammar import field_types, parse_kv
from jaxpar import config as C
from jaxpar.config import Config, ConfigError, MeshConfig
from jaxpar.parallel import mesh as M

# --------------------------------------------------------------------------- data pipeline

# (n_tokens, seq_len): any split that holds one window (n >= seq_len + 1), from the edge (exactly
# one window) to many; tokens are np.arange so a window's first id *is* its offset.
SPLITS = st.integers(1, 300).flatmap(lambda T: st.tuples(st.integers(T + 1, T + 1 + 5000) | st.just(T + 1), st.just(T)))


@settings(max_examples=200, deadline=None)
@example(split=(17, 16), batch=4, seed=0, step=0)  # the one-window split (numpy's integers(0, 0) raised)
@given(split=SPLITS, batch=st.integers(1, 64), seed=st.integers(0, 2**32 - 1), step=st.integers(0, 2**40))
def test_batches_are_in_range_windows_and_pure_functions_of_seed_and_step(split, batch, seed, step):
    """README "Batches are a pure function of (seed, step)"; data.batch_offsets: offsets lie in
    [0, max(n - T - 1, 1)) (the last window is never drawn), so every window fits (offset + T + 1 <= n).
    Reference: the token ids themselves (arange: row i of the inputs must be offset_i .. offset_i + T - 1)."""
    n, T = split
    train, val = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) + 10**6  # val ids tell the splits apart
    ds = data.Dataset(train=train, val=val, vocab_size=2**31, path="mem")
    x, y = data.train_batch(ds, T, batch, seed, step)
    assert x.shape == y.shape == (batch, T) and x.dtype == y.dtype == np.int32
    off = x[:, 0].astype(np.int64)
    assert off.min() >= 0 and off.max() < max(n - T - 1, 1) and off.max() + T + 1 <= n
    assert np.array_equal(x, off[:, None] + np.arange(T)) and np.array_equal(y, x + 1)  # contiguous, shifted by one
    assert np.array_equal(off, data.batch_offsets(n, T, batch, seed, step))
    # pure: the same batch after other draws (no hidden state), and the same from val for val
    data.train_batch(ds, T, batch, seed, step + 1)
    x2, y2 = data.train_batch(ds, T, batch, seed, step)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    vx, vy = data.val_batch(ds, T, batch, seed, step)
    assert vx.min() >= 10**6 and vy.max() < 10**6 + n and np.array_equal(vx[:, 1:], vy[:, :-1])


@settings(max_examples=200, deadline=None)
@example(n=25, T=5, cap=0)  # a length that is a multiple of T: 4 windows, not 5
@example(n=23, T=23, cap=0)  # one token short of a window: the error
@given(n=st.integers(1, 3000), T=st.integers(1, 400), cap=st.integers(0, 50))
def test_eval_windows_tile_the_split_without_gaps(n, T, cap):
    """data.eval_windows: window k covers tokens [k*T, k*T+T]; (n-1)//T of them (at most `cap`
    when cap > 0); none fits -> the one-line error naming the count. Reference: slices of arange."""
    toks = np.arange(n, dtype=np.uint16)
    want = (n - 1) // T if not cap else min((n - 1) // T, cap)
    if want == 0:
        with pytest.raises(ConfigError) as e:
            data.eval_windows(toks, T, cap)
        assert str(e.value) == f"eval data has {n} tokens, fewer than train.seq_len+1={T + 1}"
        return
    x, y = data.eval_windows(toks, T, cap)
    assert x.shape == y.shape == (want, T)
    ref = np.arange(want * T + 1)
    assert np.array_equal(x.reshape(-1), ref[:-1]) and np.array_equal(y.reshape(-1), ref[1:])
    assert want * T + 1 <= n  # the last window fits ...
    assert cap and want == cap or (want + 1) * T + 1 > n  # ... and, uncapped, one more would not


@settings(max_examples=150, deadline=None)
@example(raw=bytes(range(65, 82)) * 10, min_tokens=17)  # 170 bytes: 153 + 17, exactly one window in val
@example(raw=b"\xff\xfe\x00abc", min_tokens=0)  # not UTF-8: the byte tokenizer keeps the raw bytes
@given(raw=st.binary(min_size=1, max_size=400), min_tokens=st.integers(0, 60))
def test_prepare_splits_any_bytes_into_train_and_val_that_concatenate_back(tmp_path_factory, raw, min_tokens):
    """`prepare` (byte tokenizer, README "tokenized bytewise"): train.bin + val.bin are the input's
    bytes in order, val the last max(n // 10, 1); a split under `min_tokens` is the one-line error
    naming the counts, and nothing is written. Reference: the bytes."""
    out = tmp_path_factory.mktemp("prep")
    n = len(raw)
    n_val = max(n // 10, 1)
    if min(n - n_val, n_val) < min_tokens:
        with pytest.raises(ConfigError) as e:
            data.prepare(raw, out, "byte", source="s", min_tokens=min_tokens)
        assert str(e.value) == (f"data='s' gives {n} tokens ({n - n_val} train, {n_val} val); "
                                f"each split needs at least train.seq_len+1={min_tokens}")
        assert list(out.iterdir()) == []
        return
    meta = data.prepare(raw, out, "byte", source="s", min_tokens=min_tokens)
    assert {k: meta[k] for k in ("tokenizer", "vocab_size", "train_tokens", "val_tokens", "source", "split")} == {
        "tokenizer": "byte", "vocab_size": 256, "train_tokens": n - n_val, "val_tokens": n_val, "source": "s",
        "split": "tail"}
    assert json.loads((out / "meta.json").read_text()) == meta
    train, val = (np.fromfile(out / f, dtype="<u2") for f in ("train.bin", "val.bin"))
    assert (len(train), len(val)) == (n - n_val, n_val)
    assert np.concatenate([train, val]).astype(np.uint8).tobytes() == raw and train.max(initial=0) < 256


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200), raw=st.binary(max_size=200))
def test_the_byte_tokenizer_round_trips_any_text_and_keeps_any_bytes(text, raw):
    """The byte tokenizer (vocab 256): any bytes encode to their own values; any text encodes to
    its UTF-8 bytes and decodes back to itself. Reference: str.encode / bytes."""
    tok = data.Tokenizer("byte")
    assert tok.encode(raw).tolist() == list(raw)
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


# --------------------------------------------------------------------------- key=value -> config.json

def _field_values(tp):
    """(strategy of a field's Python value, how a user may spell it on the command line)."""
    if tp is bool:
        spell = {True: ["true", "1", "yes", "on", "True", "YES"], False: ["false", "0", "no", "off", "False", "OFF"]}
        return st.booleans().flatmap(lambda b: st.tuples(st.just(b), st.sampled_from(spell[b])))
    if tp is int:
        return st.integers(-(2**64), 2**64).flatmap(
            lambda v: st.tuples(st.just(v), st.sampled_from([str(v), f"{v:_}", f" {v}"])))
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False).flatmap(
            lambda v: st.tuples(st.just(v), st.sampled_from([repr(v), f"{v!r}".upper()])))
    if tp == tuple[str, ...]:
        names = st.lists(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8), max_size=4).map(tuple)
        return names.flatmap(lambda g: st.tuples(st.just(g), st.sampled_from([",".join(g), "[" + ", ".join(g) + "]"])))
    if tp == tuple[int, ...] | None:
        ints = st.lists(st.integers(1, 99), min_size=1, max_size=6).map(tuple)
        return st.one_of(st.tuples(st.just(None), st.sampled_from(["none", "null", "", "None"])),
                         ints.flatmap(lambda v: st.tuples(st.just(v), st.sampled_from(
                             [",".join(map(str, v)), "[" + ",".join(map(str, v)) + "]", "(" + ", ".join(map(str, v)) + ")"]))))
    assert tp is str, tp
    return st.text(max_size=30).map(lambda s: (s, s))  # any text: '=' or a line break included


FIELDS = {}  # dotted key -> (section or None, field name, strategy)
for _name, _tp in field_types(Config).items():
    if _name in C.SECTIONS:
        for _f, _ftp in field_types(C.SECTIONS[_name]).items():
            FIELDS[f"{_name}.{_f}"] = (_name, _f, _field_values(_ftp))
    elif _name != "model_name":
        FIELDS[_name] = (None, _name, _field_values(_tp))


@st.composite
def overrides(draw):
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=12, unique=True))
    preset = draw(st.none() | st.sampled_from(sorted(C.PRESETS)))
    return preset, {k: draw(FIELDS[k][2]) for k in keys}


@settings(max_examples=200, deadline=None)
@example(drawn=("gpt2-tiny", {"pipeline.layers_per_stage": ((2, 1), "[2,1]"), "sharding.replicate": ((), ""),
                              "train.lr": (1e-300, "1E-300"), "out": ("a=b\nc", "a=b\nc")}))
@given(drawn=overrides())
def test_any_key_value_set_reads_as_typed_and_round_trips_through_config_json(drawn):
    """README: "The resolved config is printed and saved as <out>/config.json" and resume reloads it
    (`config.from_dict`). Any set of key=value arguments, every key of `jaxpar train`, each value
    in any spelling the grammar takes (booleans yes/on/1, ints with _ and spaces, any finite float
    repr, tuples with or without brackets, None spelled none/null/empty, any text), reads as the
    typed value, and dumps -> json -> from_dict gives back the very same Config. Reference: the
    drawn values (the config is not validated: ranges are test_failures_config_fuzz's concern)."""
    preset, kv = drawn
    args = ([f"model={preset}"] if preset else []) + [f"{k}={spelled}" for k, (_, spelled) in kv.items()]
    cfg = C.apply_overrides(Config(), parse_kv(args))
    for key, (value, _) in kv.items():
        section, name, _ = FIELDS[key]
        got = getattr(getattr(cfg, section), name) if section else getattr(cfg, name)
        assert got == value and type(got) is type(value), (key, got, value)
    if preset:
        assert cfg.model_name == preset
        assert all(getattr(cfg.model, f) == getattr(C.PRESETS[preset], f) for f in ("n_layer", "n_embd", "n_head")
                   if f"model.{f}" not in kv)
    back = C.from_dict(json.loads(C.dumps(cfg)))
    assert back == cfg
    assert all(type(getattr(back.train, f.name)) is type(getattr(cfg.train, f.name)) for f in dataclasses.fields(cfg.train))


# --------------------------------------------------------------------------- mesh sizes

AXES_ = ("data", "fsdp", "tensor", "pipe")


@settings(max_examples=400, deadline=None)
@example(sizes=(2, 1, 2, 1), wild=None, n=8)
@example(sizes=(1, 1, 3, 1), wild=0, n=8)
@given(sizes=st.tuples(*[st.integers(1, 12)] * 4), wild=st.none() | st.integers(0, 3),
       n=st.integers(1, 5000) | st.just(-1))
def test_mesh_sizes_resolve_to_the_device_count_or_name_it(sizes, wild, n):
    """jaxpar.parallel.mesh.resolve_mesh_config (README "mesh.data|fsdp|tensor|pipe (one may be -1)";
    mesh.py: "The product must equal the device count"): for any sizes, at most one -1, and any
    device count n (n = -1 stands for "exactly the product"), the result has product n with the
    given axes kept and the -1 filled, in axis order; otherwise the documented one-line texts.
    Reference: the arithmetic of the rule."""
    sizes = list(sizes)
    if wild is not None:
        sizes[wild] = -1
    fixed = math.prod(v for v in sizes if v != -1)
    if n == -1:
        n = fixed * (1 + (sizes[0] % 3) if wild is not None else 1)
    mc = MeshConfig(*sizes)
    shown = "×".join(f"{a}={v}" for a, v in zip(AXES_, sizes))
    if wild is None and fixed != n:
        want = (f"mesh {shown} needs {fixed} devices but {n} are available "
                "(the product of mesh sizes must equal the device count)")
    elif wild is not None and n % fixed:
        want = f"mesh {shown}: {n} devices are not divisible by the product of the other axes ({fixed})"
    else:
        got = M.resolve_mesh_config(mc, n)
        assert tuple(f.name for f in dataclasses.fields(got)) == AXES_ == M.AXES
        assert math.prod(dataclasses.astuple(got)) == n == M.mesh_size(got)
        assert all(g == s for g, s in zip(dataclasses.astuple(got), sizes) if s != -1)
        return
    with pytest.raises(ConfigError) as e:
        M.resolve_mesh_config(mc, n)
    assert str(e.value) == want


@settings(max_examples=200, deadline=None)
@given(sizes=st.tuples(*[st.integers(-3, 4)] * 4), n=st.integers(1, 64))
def test_mesh_sizes_that_no_device_count_fits_are_named(sizes, n):
    """Two -1s, a 0 or a size below -1: the two rule texts of config.check_mesh_sizes, whatever the
    device count (the wildcard rule first). Reference: the sizes."""
    d = dict(zip(AXES_, sizes))
    if sum(v == -1 for v in sizes) > 1:
        want = f"at most one mesh axis may be -1 (got {d})"
    elif bad := {k: v for k, v in d.items() if v == 0 or v < -1}:
        want = f"mesh sizes must be positive or -1 (got {bad})"
    else:
        return
    with pytest.raises(ConfigError) as e:
        M.resolve_mesh_config(MeshConfig(*sizes), n)
    assert str(e.value) == want
