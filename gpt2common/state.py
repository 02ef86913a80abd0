"""The training-state format both frameworks read and write: a run's complete state at step k,
so that `jaxpar train` and `torchref train` can take over each other's runs mid-way.

A state dir (docs/state_format.md is the user-facing description):
  manifest.json          format name and version, step, model shape, optimizer settings, the
                         AdamW and schedule counts, the data position, the RNG, file checksums
  model.safetensors      weights, HF GPT-2 names and shapes (`gpt2common.hf.to_hf_state_dict`), fp32
  optimizer.safetensors  AdamW moments: `exp_avg.<HF name>` (first), `exp_avg_sq.<HF name>` (second), fp32
  config.json            the HF config: the dir is also a save_pretrained dir (`init=`, from_pretrained)

Everything the continuing run needs besides the tensors is a pure function of (seed, step): the
batch of step s is `gpt2common.data.train_batch(ds, T, B, seed, s)`, the learning rate of update s
is the schedule at s, jaxpar's dropout key is fold_in(PRNGKey(seed), s). So the manifest pins the
seed, the step and the settings those functions read, and a reader refuses a run whose settings
differ (`check_compatible`): the state would continue another computation.

numpy + json + safetensors only: no pickle anywhere, and neither jax nor torch.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

from gpt2common.grammar import ConfigError
from gpt2common.model import ModelConfig

FORMAT = "gpt2-train-state"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MU, NU = "exp_avg.", "exp_avg_sq."  # torch.optim.AdamW's state names, as key prefixes
SHAPE_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "layer_norm_epsilon")
# OptimSettings fields a continuing run must share: they fix the batches and every update.
# grad_accum is left out: every value computes the same mean gradient.
TRAIN_KEYS = ("steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
              "beta1", "beta2", "eps", "grad_clip")


@dataclasses.dataclass(frozen=True)
class State:
    """One state dir read back: the manifest and the HF-named fp32 tensors."""

    manifest: dict
    params: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def check_target(path: str, key: str) -> None:
    """The output of a state write must not exist yet (a state is never merged or overwritten)."""
    from gpt2common.outdir import check_writable

    if os.path.lexists(path):
        raise ConfigError(f"{key}={path!r} already exists; a state is written into a new directory")
    check_writable(path, key)


def manifest_dict(*, written_by: str, model: ModelConfig, train: Any, seed: int, step: int, adam_count: int,
                  schedule_count: int, lr_next: float, data: dict) -> dict:
    """The manifest without its `files` entry. `train`: an OptimSettings (jaxpar's TrainConfig or
    torchref's TrainSettings); `data`: what identifies the token stream (tokens in train.bin, ...)."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "written_by": written_by,
        "step": int(step),
        "model": {k: getattr(model, k) for k in SHAPE_KEYS},
        "train": {k: getattr(train, k) for k in (*TRAIN_KEYS, "grad_accum")},
        "seed": int(seed),
        "optimizer": {"name": "adamw", "adam_count": int(adam_count), "schedule_count": int(schedule_count),
                      "lr_next": float(lr_next), "decay": "matmul weights (attn.c_attn, attn.c_proj, mlp.c_fc, "
                      "mlp.c_proj); not biases, LayerNorms, wte, wpe"},
        "data": {"seed": int(seed), "next_step": int(step), "batch_size": train.batch_size, "seq_len": train.seq_len,
                 "order": "gpt2common.data.train_batch(ds, seq_len, batch_size, seed, step)", **data},
        "rng": {"seed": int(seed), "next_step": int(step), "dropout": model.dropout,
                "dropout_key": "jax.random.fold_in(jax.random.PRNGKey(seed), step)"},
    }


def write_state(path: str, manifest: dict, params: dict, exp_avg: dict, exp_avg_sq: dict, hf_config: dict,
                key: str = "out") -> None:
    """Write a state dir at `path` (which `check_target` accepted): every file goes into
    `<path>.tmp` first, renamed to `path` once complete, so a reader never sees half a state.
    params / exp_avg / exp_avg_sq: {HF name: fp32 array}, the same names and shapes. `key`: the
    key `path` was given by (to_state=; torchref's states are dirs of its out=), for errors."""
    from safetensors.numpy import save

    from gpt2common.outdir import make_out
    from gpt2common.writes import temp_name, write_atomic

    if set(params) != set(exp_avg) or set(params) != set(exp_avg_sq):
        raise ValueError("the moments must have the weights' names")
    # A temporary of its own (never another writer's, never removed before use): two writes of
    # one new DIR each write their own and the second rename is refused, not merged.
    tmp = temp_name(path.rstrip("/"))
    make_out(os.path.dirname(os.path.abspath(tmp)), key, given=path)
    try:
        os.mkdir(tmp)
    except OSError as e:  # a refusal check_target cannot foresee (/proc) is one line
        raise ConfigError(f"{key}={path!r} cannot be created ({e.strerror})") from None
    f32 = lambda v: np.ascontiguousarray(np.asarray(v, dtype=np.float32))  # noqa: E731
    blobs = {MODEL_FILE: save({k: f32(v) for k, v in params.items()}, metadata={"format": "pt"}),
             OPTIMIZER_FILE: save({**{MU + k: f32(v) for k, v in exp_avg.items()},
                                   **{NU + k: f32(v) for k, v in exp_avg_sq.items()}}, metadata={"format": "pt"})}
    try:
        for name, blob in blobs.items():
            write_atomic(os.path.join(tmp, name), blob)
        files = {name: hashlib.sha256(blob).hexdigest() for name, blob in blobs.items()}
        write_atomic(os.path.join(tmp, "config.json"), json.dumps(hf_config, indent=2))
        write_atomic(os.path.join(tmp, MANIFEST), json.dumps({**manifest, "files": files}, indent=2))
        try:
            os.rename(tmp, path)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            raise ConfigError(f"{key}={path!r} already exists (written meanwhile by another process); "
                              "a state is written into a new directory") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_manifest(path: str, key: str) -> dict:
    """The manifest of state dir `path` (given as `key=`), checked for format and version."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} is not a directory")
    try:
        with open(file) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{key}={path!r} has no {MANIFEST} (not a training-state dir)") from None
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the stack (json recurses)
        raise ConfigError(f"{key}={path!r}: {MANIFEST} is corrupt") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ConfigError(f"{key}={path!r}: {MANIFEST} is not a {FORMAT} manifest")
    version = m.get("format_version")
    if type(version) is not int:
        raise ConfigError(f"{key}={path!r}: {MANIFEST} has no integer format_version")
    if version > FORMAT_VERSION:
        raise ConfigError(f"{key}={path!r} has format_version={version}, newer than this reader's "
                          f"{FORMAT_VERSION}; upgrade to read it")
    for field in ("step", "seed", "model", "train", "optimizer", "files"):
        if field not in m:
            raise ConfigError(f"{key}={path!r}: {MANIFEST} lacks {field!r}")
    check_fields(m, path, key)
    return m


def check_compatible(m: dict, path: str, key: str, model: ModelConfig, train: Any, seed: int) -> None:
    """ConfigError naming the first setting of the continuing run that differs from the state's
    (train.steps included: the schedule's cosine spans the whole run)."""
    diffs = [(f"model.{k}", getattr(model, k), m["model"].get(k)) for k in SHAPE_KEYS]
    diffs += [(f"train.{k}", getattr(train, k), m["train"].get(k)) for k in TRAIN_KEYS]
    diffs += [("seed", seed, m["seed"])]
    for name, ours, theirs in diffs:
        if ours != theirs:  # check_fields made both numbers: what differs prints differently
            raise ConfigError(f"{key}={path!r} was written with {name}={theirs!r}, this run has {name}={ours!r} "
                              "(the state continues only the same model, batches and schedule)")
    check_counts(m, path, key, train.steps)


def check_data(m: dict, path: str, key: str, train_tokens: int) -> None:
    """The token stream must be the one the state was trained on (same train.bin length)."""
    want = m.get("data", {}).get("train_tokens")
    if want is not None and want != train_tokens:
        raise ConfigError(f"{key}={path!r} was trained on data with {want} train tokens, this run's data has "
                          f"{train_tokens} (data= differs)")


_LAST: dict = {}  # the last state load_state read: {"stamp": ..., "state": State}


def _stamp(path: str, key: str) -> tuple:
    """What identifies one read of a state dir: its path and each file's inode, size and mtime."""
    def one(name):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns
    return os.path.abspath(path), key, tuple(one(n) for n in (MANIFEST, MODEL_FILE, OPTIMIZER_FILE))


def forget_loaded() -> None:
    """Drop the state load_state keeps (3 copies of the weights' size) once it is placed."""
    _LAST.clear()


def load_state(path: str, key: str, m: dict | None = None) -> State:
    """Read a state dir, checked whole (one-line ConfigErrors naming `key`): checksums, and each
    tensor's name, shape, dtype and values (`_check_tensors`). The check before a run's first
    write reads it; the run's own read later gets the same State (until `forget_loaded`)."""
    from safetensors.numpy import load

    stamp = _stamp(path, key)
    if _LAST.get("stamp") == stamp:
        return _LAST["state"]
    m = read_manifest(path, key) if m is None else m
    tensors = {}
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                blob = f.read()
        except OSError as e:
            raise ConfigError(f"{key}={path!r}: cannot read {name} ({e.strerror})") from None
        if hashlib.sha256(blob).hexdigest() != m["files"].get(name):
            raise ConfigError(f"{key}={path!r}: {name} does not match its checksum in {MANIFEST} (damaged or replaced)")
        tensors[name] = load(blob)
    params = tensors[MODEL_FILE]
    opt = tensors[OPTIMIZER_FILE]
    shapes = expected_shapes(m["model"])
    _check_tensors(MODEL_FILE, params, shapes, path, key)
    _check_tensors(OPTIMIZER_FILE, opt, {p + k: s for p in (MU, NU) for k, s in shapes.items()}, path, key)
    mu = {k[len(MU):]: v for k, v in opt.items() if k.startswith(MU)}
    nu = {k[len(NU):]: v for k, v in opt.items() if k.startswith(NU)}
    _LAST.update(stamp=stamp, state=State(m, params, mu, nu))
    return _LAST["state"]


# ----------------------------------------------------------------------------- the whole state checked
# A state is checked whole before a run continues it (both CLIs, before their first write): the
# manifest's fields by type, its counts against each other and the run's train.steps, and every
# tensor by name, shape, dtype and value. A NaN or negative second moment would silently freeze
# its weights (each update is skipped or NaN from then on) and be saved into every later state.
_INT, _NUM = "an integer", "a finite number"
_FIELDS = {"step": _INT, "seed": _INT, **{f"model.{k}": _INT for k in SHAPE_KEYS[:-1]},
           "model.layer_norm_epsilon": _NUM, **{f"train.{k}": _NUM for k in TRAIN_KEYS},
           **{f"train.{k}": _INT for k in ("steps", "batch_size", "seq_len", "warmup_steps", "grad_accum")},
           "optimizer.adam_count": _INT, "optimizer.schedule_count": _INT, "optimizer.lr_next": _NUM,
           f"files.{MODEL_FILE}": "a sha256 string", f"files.{OPTIMIZER_FILE}": "a sha256 string"}


def _of_type(v, what: str) -> bool:
    if what == _INT:
        return type(v) is int
    if what == _NUM:
        return type(v) in (int, float) and np.isfinite(v)
    return isinstance(v, str)


def check_fields(m: dict, path: str, key: str) -> None:
    """Each field the readers use has its type (a bool is not an integer), counts are >= 0."""
    where = f"{key}={path!r}: {MANIFEST} field"
    for name, what in _FIELDS.items():
        section, _, sub = name.partition(".") if "." in name else ("", "", name)
        holder = m.get(section) if section else m
        if not isinstance(holder, dict):
            raise ConfigError(f"{where} {section!r} is {holder!r}, not an object")
        if sub not in holder:
            raise ConfigError(f"{where} {name} is missing")
        if not _of_type(holder[sub], what):
            raise ConfigError(f"{where} {name} is {holder[sub]!r}, not {what}")
    for name in ("step", "optimizer.adam_count", "optimizer.schedule_count", "nonfinite_skipped"):
        section, _, sub = name.partition(".") if "." in name else ("", "", name)
        v = (m[section] if section else m).get(sub, 0)
        if type(v) is not int or v < 0:
            raise ConfigError(f"{where} {name} is {v!r}, not an integer >= 0")
    for section in ("data", "rng"):
        if section in m and not isinstance(m[section], dict):
            raise ConfigError(f"{where} {section!r} is {m[section]!r}, not an object")
    tokens = m.get("data", {}).get("train_tokens")
    if tokens is not None and type(tokens) is not int:
        raise ConfigError(f"{where} data.train_tokens is {tokens!r}, not an integer")


def check_counts(m: dict, path: str, key: str, train_steps: int) -> None:
    """The AdamW and schedule counts are the updates applied: the step less the non-finite steps
    jaxpar skipped (counts unchanged, step advanced); the step leaves a step of train.steps to run."""
    opt, step, skipped = m["optimizer"], m["step"], m.get("nonfinite_skipped", 0)
    if step >= train_steps:
        raise ConfigError(f"{key}={path!r} is at step {step}: train.steps={train_steps} leaves no step to run")
    if not opt["adam_count"] == opt["schedule_count"] == step - skipped:
        raise ConfigError(f"{key}={path!r} is inconsistent: step {step} with {skipped} skipped non-finite steps "
                          f"needs AdamW and schedule counts {step - skipped}, the manifest has "
                          f"{opt['adam_count']} and {opt['schedule_count']}")


def expected_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of the weights of a state's `model` (each moment has its weight's name
    and shape): wte (V, D), wpe (P, D), ln_f, and per layer c_attn (D, 3D), c_fc (D, 4D), ..."""
    D, L = model["n_embd"], model["n_layer"]
    shapes = {"transformer.wte.weight": (model["vocab_size"], D), "transformer.wpe.weight": (model["n_positions"], D),
              "transformer.ln_f.weight": (D,), "transformer.ln_f.bias": (D,)}
    per_layer = {"ln_1.weight": (D,), "ln_1.bias": (D,), "attn.c_attn.weight": (D, 3 * D), "attn.c_attn.bias": (3 * D,),
                 "attn.c_proj.weight": (D, D), "attn.c_proj.bias": (D,), "ln_2.weight": (D,), "ln_2.bias": (D,),
                 "mlp.c_fc.weight": (D, 4 * D), "mlp.c_fc.bias": (4 * D,), "mlp.c_proj.weight": (4 * D, D),
                 "mlp.c_proj.bias": (D,)}
    for i in range(L):
        shapes.update({f"transformer.h.{i}.{k}": s for k, s in per_layer.items()})
    return shapes


def _check_tensors(file: str, tensors: dict, want: dict, path: str, key: str) -> None:
    """`tensors` (one safetensors file, names as stored) holds exactly `want`'s names, each fp32 of
    its shape and finite; a second moment (exp_avg_sq.*) is also >= 0."""
    where = f"{key}={path!r}: {file}"
    if extra := sorted(set(tensors) - set(want)):
        raise ConfigError(f"{where} holds tensors no GPT-2 state has ({', '.join(extra[:3])})")
    if missing := sorted(set(want) - set(tensors)):
        raise ConfigError(f"{where} lacks {', '.join(missing[:3])}")
    for name, shape in want.items():
        v = tensors[name]
        if v.dtype != np.float32:
            raise ConfigError(f"{where}: {name} is {v.dtype}, not float32")
        if tuple(v.shape) != shape:
            raise ConfigError(f"{where}: {name} has shape {tuple(v.shape)}, expected {shape}")
        if not np.isfinite(v).all():
            raise ConfigError(f"{where}: {name} holds non-finite values")
        if name.startswith(NU) and (v < 0).any():
            raise ConfigError(f"{where}: {name} holds negative second moments")
