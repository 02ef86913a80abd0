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
    from gpt2common.writes import write_atomic

    if set(params) != set(exp_avg) or set(params) != set(exp_avg_sq):
        raise ValueError("the moments must have the weights' names")
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_out(tmp, key, given=path)  # a refusal check_target cannot foresee (/proc) is one line
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
        os.rename(tmp, path)
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
    return m


def check_compatible(m: dict, path: str, key: str, model: ModelConfig, train: Any, seed: int) -> None:
    """ConfigError naming the first setting of the continuing run that differs from the state's
    (train.steps included: the schedule's cosine spans the whole run)."""
    diffs = [(f"model.{k}", getattr(model, k), m["model"].get(k)) for k in SHAPE_KEYS]
    diffs += [(f"train.{k}", getattr(train, k), m["train"].get(k)) for k in TRAIN_KEYS]
    diffs += [("seed", seed, m["seed"])]
    for name, ours, theirs in diffs:
        if ours != theirs:
            raise ConfigError(f"{key}={path!r} was written with {name}={theirs}, this run has {name}={ours} "
                              "(the state continues only the same model, batches and schedule)")


def check_data(m: dict, path: str, key: str, train_tokens: int) -> None:
    """The token stream must be the one the state was trained on (same train.bin length)."""
    want = m.get("data", {}).get("train_tokens")
    if want is not None and want != train_tokens:
        raise ConfigError(f"{key}={path!r} was trained on data with {want} train tokens, this run's data has "
                          f"{train_tokens} (data= differs)")


def load_state(path: str, key: str, m: dict | None = None) -> State:
    """Read a state dir: checksums, names and shapes checked (one-line ConfigErrors naming `key`)."""
    from safetensors.numpy import load

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
    mu = {k[len(MU):]: v for k, v in opt.items() if k.startswith(MU)}
    nu = {k[len(NU):]: v for k, v in opt.items() if k.startswith(NU)}
    for label, d in (("exp_avg", mu), ("exp_avg_sq", nu)):
        if set(d) != set(params) or any(d[k].shape != params[k].shape for k in params):
            raise ConfigError(f"{key}={path!r}: the {label} tensors do not match the weights' names and shapes")
    return State(m, params, mu, nu)
