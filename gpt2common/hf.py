"""The HF weight format: transformers `save_pretrained` dir <-> jaxpar params, in HF's safetensors
layout. Shared by jaxpar (init=, export) and torchref (its initial weights, its outputs).

HF GPT-2 uses Conv1D, whose weights are laid out (in, out) like ours, so conversion is
only (un)stacking layers and reshaping the attention weights:
  c_attn.weight (D, 3D) <-> (D, 3, N, Hd);  c_attn.bias (3D,) <-> (3, N, Hd)
  attn.c_proj.weight (D, D) <-> (N, Hd, D)
lm_head is tied to wte and not stored (as save_pretrained does for tied weights).
Only numpy + safetensors are needed: transformers itself is not imported here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from gpt2common.grammar import ConfigError, naming_key
from gpt2common.model import ModelConfig, check_shape

Params = dict[str, Any]  # jaxpar's nested parameter dict (layout: jaxpar/models/gpt2.py's docstring)

WEIGHTS = "model.safetensors"


def hf_config_dict(cfg: ModelConfig) -> dict:
    """config.json for GPT2LMHeadModel (fields of transformers' GPT2Config)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
        "vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "n_ctx": cfg.n_positions,
        "n_inner": None,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_epsilon, "initializer_range": 0.02,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1,
    }


def model_config_from_hf(path: str) -> ModelConfig:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            c = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: init= / hf= names a file
        if not os.path.exists(path) and HUB_ID.fullmatch(path) and "/" in path:
            raise ConfigError(f"{path!r} is no dir, nor a model in the local HF cache ({hub_cache_dir()}); "
                              f"jaxpar never downloads: fetch it first (huggingface-cli download {path})") from None
        raise ConfigError(f"{path!r} is not an HF save_pretrained dir (no config.json)") from None
    except OSError as e:  # a directory named config.json, no read permission
        raise ConfigError(f"{path!r}: config.json cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError):  # JSONDecodeError, not UTF-8; nested past the stack (json recurses)
        raise ConfigError(f"{path!r}: config.json is corrupt") from None
    if not isinstance(c, dict):  # valid JSON but not an object: c.get was an AttributeError traceback
        raise ConfigError(f"{path!r}: config.json is corrupt")
    if c.get("model_type") is None and os.path.isdir(os.path.join(path, "ckpt")) and {"mesh", "train"} <= set(c):
        # a jaxpar run dir given where an HF dir goes (init=RUN, hf=RUN): model_type=None said nothing
        raise ConfigError(f"{path!r} is a jaxpar run dir, not an HF save_pretrained dir: eval and sample take it as "
                          f"checkpoint=, and `jaxpar convert checkpoint={path} to_hf=DIR` exports its weights")
    if c.get("model_type") != "gpt2":
        raise ConfigError(f"{path!r}: model_type={c.get('model_type')!r}, expected 'gpt2'")
    for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        if type(c.get(k)) is not int or c[k] <= 0:  # a missing field was a KeyError traceback
            raise ConfigError(f"{path!r}: config.json has no positive integer {k} (got {c.get(k)!r})")
    if c.get("activation_function", "gelu_new") != "gelu_new" or c.get("n_inner") not in (None, 4 * c["n_embd"]):
        raise ConfigError(f"{path!r}: only GPT-2 with gelu_new and n_inner=4*n_embd is supported")
    eps = c.get("layer_norm_epsilon", 1e-5)
    if type(eps) not in (int, float) or not 0 < eps < float("inf"):  # "x" was a ValueError traceback in float()
        raise ConfigError(f"{path!r}: config.json has no positive number layer_norm_epsilon (got {eps!r})")
    # The HF dir's resid/embd/attn_pdrop (0.1 in OpenAI's GPT-2) is not inherited: dropout is a training
    # choice, the run's model.dropout (default 0), as nanoGPT's from_pretrained override does.
    mc = ModelConfig(n_layer=c["n_layer"], n_embd=c["n_embd"], n_head=c["n_head"], vocab_size=c["vocab_size"],
                     n_positions=c["n_positions"], layer_norm_epsilon=float(eps))
    try:  # whole heads, ids that fit uint16: a reshape or an index error later otherwise
        check_shape(mc)
    except ConfigError as e:
        raise ConfigError(f"{path!r}: config.json: {e}") from None
    return mc


def to_hf_state_dict(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Stacked jaxpar params -> HF names, float32 numpy, HF shapes."""
    D = cfg.n_embd
    p = {k: v for k, v in _flat(params).items()}
    sd = {"transformer.wte.weight": p["wte.weight"], "transformer.wpe.weight": p["wpe.weight"],
          "transformer.ln_f.weight": p["ln_f.weight"], "transformer.ln_f.bias": p["ln_f.bias"]}
    for i in range(cfg.n_layer):
        pre = f"transformer.h.{i}."
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias",
                     "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"):
            sd[pre + name] = p["h." + name][i]
        sd[pre + "attn.c_attn.weight"] = p["h.attn.c_attn.weight"][i].reshape(D, 3 * D)
        sd[pre + "attn.c_attn.bias"] = p["h.attn.c_attn.bias"][i].reshape(3 * D)
        sd[pre + "attn.c_proj.weight"] = p["h.attn.c_proj.weight"][i].reshape(D, D)
    return {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in sd.items()}


def from_hf_state_dict(cfg: ModelConfig, sd: dict[str, np.ndarray]) -> Params:
    """HF names (with or without the `transformer.` prefix) -> stacked jaxpar params."""
    D, N, Hd = cfg.n_embd, cfg.n_head, cfg.head_dim
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}

    def get(name, shape, hf_shape=None):
        """sd[name] checked against its HF shape (`hf_shape`, default `shape`), reshaped to ours.
        The whole shape is compared: a size check would take a transposed (out, in) matrix."""
        if name not in sd:
            raise ConfigError(f"HF weights lack {name!r}")
        v = np.asarray(sd[name], dtype=np.float32)
        want = hf_shape or shape
        if tuple(v.shape) != want:
            raise ConfigError(f"HF weight {name!r} has shape {tuple(v.shape)}, expected {want}")
        return v.reshape(shape)

    def stack(name, shape, hf_shape=None):
        return np.stack([get(f"h.{i}.{name}", shape, hf_shape) for i in range(cfg.n_layer)])

    return {
        "wte": {"weight": get("wte.weight", (cfg.vocab_size, D))},
        "wpe": {"weight": get("wpe.weight", (cfg.n_positions, D))},
        "h": {
            "ln_1": {"weight": stack("ln_1.weight", (D,)), "bias": stack("ln_1.bias", (D,))},
            "attn": {"c_attn": {"weight": stack("attn.c_attn.weight", (D, 3, N, Hd), (D, 3 * D)),
                                "bias": stack("attn.c_attn.bias", (3, N, Hd), (3 * D,))},
                     "c_proj": {"weight": stack("attn.c_proj.weight", (N, Hd, D), (D, D)),
                                "bias": stack("attn.c_proj.bias", (D,))}},
            "ln_2": {"weight": stack("ln_2.weight", (D,)), "bias": stack("ln_2.bias", (D,))},
            "mlp": {"c_fc": {"weight": stack("mlp.c_fc.weight", (D, 4 * D)), "bias": stack("mlp.c_fc.bias", (4 * D,))},
                    "c_proj": {"weight": stack("mlp.c_proj.weight", (4 * D, D)), "bias": stack("mlp.c_proj.bias", (D,))}},
        },
        "ln_f": {"weight": get("ln_f.weight", (D,)), "bias": get("ln_f.bias", (D,))},
    }


def generation_config_dict(cfg: ModelConfig, temperature: float, top_k: int, max_new_tokens: int) -> dict:
    """generation_config.json: the special tokens of config.json and the caller's sampling defaults,
    so `model.generate(ids)` samples as the trainer's own sampler does by default."""
    c = hf_config_dict(cfg)
    return {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"], "do_sample": temperature > 0,
            **({"temperature": temperature, "top_k": top_k} if temperature > 0 else {}),
            "max_new_tokens": max_new_tokens}


def save_hf(path: str, cfg: ModelConfig, params: Params) -> None:
    """Write config.json + model.safetensors loadable by GPT2LMHeadModel.from_pretrained. Each
    goes to a temporary file renamed into place: a full disk is WriteFailed naming the file
    (safetensors' own save_file says "I/O error" without an errno) and leaves no torn file."""
    from safetensors.numpy import save

    from gpt2common.writes import write_atomic

    os.makedirs(path, exist_ok=True)
    # written through open(): the umask's mode, as transformers' save_pretrained (safetensors'
    # save_file would create 0o600 files, unreadable by the group sharing an export)
    weights = os.path.join(path, WEIGHTS)
    write_atomic(weights, save(to_hf_state_dict(cfg, params), metadata={"format": "pt"}))
    write_atomic(os.path.join(path, "config.json"), json.dumps(hf_config_dict(cfg), indent=2))


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # gpt2, openai-community/gpt2


def hf_home() -> str:
    return os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))


def hub_cache_dir() -> str:
    """Where `cached_snapshot` looks: huggingface_hub's cache dir (HF_HUB_CACHE, else HF_HOME/hub)."""
    try:
        from huggingface_hub import constants

        return constants.HF_HUB_CACHE
    except ImportError:
        return os.environ.get("HF_HUB_CACHE", os.path.join(hf_home(), "hub"))


def cached_snapshot(name: str) -> str | None:
    """The local Hugging Face cache's snapshot dir of hub model `name` (`init=gpt2` as
    transformers resolves it offline), or None. Never downloads; HF_HOME / HF_HUB_CACHE apply."""
    if os.path.exists(name) or not HUB_ID.fullmatch(name):
        return None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def load_hf_config(path: str, key: str) -> ModelConfig:
    """The ModelConfig of an HF dir, or of a hub model's snapshot in the local cache, from its
    config.json alone (no weights read); errors name `key` as `load_hf`'s do."""
    path = cached_snapshot(path) or path
    try:
        return model_config_from_hf(path)
    except ConfigError as e:
        raise ConfigError(naming_key(str(e), key, path)) from None


def load_hf(path: str, key: str = "") -> tuple[ModelConfig, Params]:
    """Read an HF save_pretrained dir (safetensors), or a hub model's snapshot in the local
    Hugging Face cache, into (ModelConfig, params). With `key` (init, hf: the key the user gave
    `path` by), errors name it."""
    path = cached_snapshot(path) or path
    if key:
        try:
            return load_hf(path)
        except ConfigError as e:
            raise ConfigError(naming_key(str(e), key, path)) from None
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:  # registers bfloat16 with numpy: transformers saves bf16 weights, numpy has no such dtype
        import ml_dtypes  # noqa: F401
    except ImportError:
        pass
    cfg = model_config_from_hf(path)
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise ConfigError(f"{path!r} has no {WEIGHTS}")
    try:
        sd = load_file(file)
    except (SafetensorError, OSError, ValueError, TypeError) as e:  # TypeError: a dtype numpy lacks
        raise ConfigError(f"{file!r} is corrupt or of an unknown dtype ({str(e).splitlines()[0]})") from None
    return cfg, from_hf_state_dict(cfg, sd)


def _flat(tree, prefix="") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = np.asarray(v)
    return out


# What an HF dir's config.json sets (load_hf): with init= its weights decide these.
INIT_MODEL_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "layer_norm_epsilon")


def check_init_model_keys(given: dict, apply_model: Callable[[ModelConfig, dict], ModelConfig]) -> None:
    """init= weights set the model (jaxpar and torchref replace the config's with theirs): a
    `model=<preset>` or `model.<key>` given beside it (YAML or key=value) that disagrees with the
    weights is refused, as bisect refuses model keys beside hf=, instead of being silently dropped.
    Keys that agree pass, so a run's own config.json still starts it again. model.dropout and
    model.attention are the run's own choices and apply on top. `apply_model(weights, keys)`: the
    model those keys make over the weights' in the caller's config (a preset first, then model.*)."""
    init = str(given.get("init", ""))
    if not init:
        return
    keys = [k for k in given if k in ("model", "model_name") or (k.startswith("model.") and k[6:] in INIT_MODEL_KEYS)]
    if not keys:
        return
    weights = load_hf_config(init, "init")
    # the model the keys alone would make from the weights' (no validation: they may not fit a preset)
    mine = apply_model(weights, {k: given[k] for k in keys})
    differ = [f for f in INIT_MODEL_KEYS if getattr(mine, f) != getattr(weights, f)]
    if not differ:
        return
    shown = [f"model.{f}={getattr(mine, f)}" for f in differ if f"model.{f}" in given]
    preset = next((k for k in ("model", "model_name") if k in given), None)
    if preset and len(shown) < len(differ):  # the rest comes from the preset
        shown.insert(0, f"{preset}={given[preset]}")
    theirs = ", ".join(f"{f}={getattr(weights, f)}" for f in differ)
    raise ConfigError(f"model keys conflict with init={init!r}, whose weights set the model: {', '.join(shown)} "
                      f"(the weights have {theirs})")
