"""Typed, frozen configuration: presets and `key=value` overrides.

Every CLI command (and torchref) resolves its settings through `resolve()`:
defaults -> `--config FILE.yaml` -> `key=value` overrides, dotted keys, unknown
keys rejected with a one-line `ConfigError` (the CLI turns it into exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any


class ConfigError(ValueError):
    """Invalid configuration or input. The CLI prints `error: <msg>` and exits 2."""


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2 shape. Field names follow HF GPT2Config."""

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = 50257
    n_positions: int = 1024
    dropout: float = 0.0  # resid/embd/attn dropout; 0 by default so runs are deterministic
    layer_norm_epsilon: float = 1e-5
    # attention core: auto (cuDNN flash attention on GPU, jaxpar's einsum core elsewhere) |
    # xla | cudnn (jax.nn.dot_product_attention with that implementation)
    attention: str = "auto"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Parameter count with tied embeddings (HF GPT2LMHeadModel's count)."""
        d, L, v, p = self.n_embd, self.n_layer, self.vocab_size, self.n_positions
        per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
        return v * d + p * d + L * per_layer + 2 * d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B): 6N + 12·L·H·Q·T, N without the wpe table."""
        n = self.num_params() - self.n_positions * self.n_embd
        return 6.0 * n + 12.0 * self.n_layer * self.n_head * self.head_dim * seq_len


# HF's GPT-2 family; gpt2-tiny is ours, for tests (~0.5M params, byte vocab).
PRESETS: dict[str, ModelConfig] = {
    "gpt2-tiny": ModelConfig(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=256),
    "gpt2": ModelConfig(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": ModelConfig(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": ModelConfig(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": ModelConfig(n_layer=48, n_embd=1600, n_head=25),
}


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes in canonical axis order; one axis may be -1 (fill)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1


@dataclass(frozen=True)
class PipelineConfig:
    microbatches: int = 1
    schedule: str = "gpipe"  # gpipe | circular
    repeats: int = 1  # chunks per device for the circular schedule
    layers_per_stage: tuple[int, ...] | None = None  # manual stage partition


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # global sequences per optimizer step
    seq_len: int = 256
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    grad_accum: int = 1
    eval_every: int = 100  # 0 disables
    eval_batches: int = 8
    ckpt_every: int = 0  # 0: only at the end (and on SIGTERM/SIGINT)
    log_every: int = 1  # console lines every N steps (metrics.jsonl gets every step)
    # A step whose loss or gradient norm is not finite is never applied; by default the run then
    # stops (exit 2). true: skip that batch and go on (counted as `nonfinite_skipped` in metrics).
    skip_nonfinite: bool = False
    # none | selective (recompute the attention core: scores, softmax, probs·V) | full (recompute
    # each block); true/false are accepted as full/none
    remat: str = "none"
    vocab_chunks: int = 1  # >1: logits + cross-entropy in this many token chunks (jaxpar.ops)
    mlp_chunks: int = 1  # >1: MLP hidden dim in this many chunks, each recomputed in backward


@dataclass(frozen=True)
class ShardingConfig:
    """Per-group OSDP: parameter groups (embed, attn, mlp) kept replicated over `fsdp`."""

    replicate: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvalConfig:
    windows: int = 0  # 0: every window that fits


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=lambda: PRESETS["gpt2"])
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    model_name: str = "gpt2"  # preset the model section started from
    data: str = ""  # "" -> built-in corpus (tiny Shakespeare, shipped in the package)
    tokenizer: str = "byte"  # used when `data` is raw text: byte | bpe | <GPT-2 tokenizer dir>
    precision: str = "bf16"  # bf16 | fp32
    seed: int = 0
    out: str = "runs/latest"
    resume: bool = False
    init: str = ""  # HF save_pretrained dir to start from
    plan: str = ""  # auto | <plan.json>
    dry_run: bool = False
    device_peak_flops: float = 0.0  # 0: look up / measure
    progress: str = "auto"  # auto | bar | plain | none


PRECISIONS = ("bf16", "fp32")
ATTENTIONS = ("auto", "xla", "cudnn")
SCHEDULES = ("gpipe", "circular")
REMATS = ("none", "selective", "full")
REMAT_ALIASES = {"true": "full", "false": "none"}  # train.remat used to be a bool
PARAM_GROUPS = ("embed", "attn", "mlp")  # OSDP groups (jaxpar.sharding.PARAM_GROUPS)


def parse_value(tp: Any, raw: Any, key: str) -> Any:
    """Coerce `raw` (a CLI string or a YAML value) to the dataclass field type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            return None
        return parse_value(args[0], raw, key)
    if origin is tuple:
        (elem, _) = typing.get_args(tp)
        if isinstance(raw, str):
            raw = raw.strip().strip("[]()")
            items = [s for s in raw.replace(" ", "").split(",") if s]
        else:
            items = list(raw)
        return tuple(parse_value(elem, x, key) for x in items)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r} is not a boolean (true/false)")
    if tp in (int, float):
        try:
            if tp is int and isinstance(raw, str) and raw.strip().lower().endswith(("e", "e+")):
                raise ValueError
            v = float(raw) if tp is float else int(str(raw).replace("_", ""))
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}={raw!r} is not a{'n integer' if tp is int else ' number'}") from None
        if tp is float and not math.isfinite(v):  # nan/inf parse as floats but make no setting meaningful
            raise ConfigError(f"{key}={raw!r} is not a finite number")
        return v
    return str(raw)


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


SECTIONS = {"model": ModelConfig, "mesh": MeshConfig, "pipeline": PipelineConfig, "train": TrainConfig, "eval": EvalConfig,
            "sharding": ShardingConfig}


def apply_overrides(cfg: Config, items: dict[str, Any]) -> Config:
    """Apply dotted `key: value` overrides; `model=<preset>` is applied first so that
    `model.*` keys refine the chosen preset."""
    items = dict(items)
    if "model" in items:
        name = str(items.pop("model"))
        if name not in PRESETS:
            raise ConfigError(f"model={name!r} is not a preset (choose from {', '.join(PRESETS)})")
        cfg = replace(cfg, model=PRESETS[name], model_name=name)
    top = _field_types(Config)
    sections: dict[str, dict[str, Any]] = {}
    for key, raw in items.items():
        head, _, rest = key.partition(".")
        if rest:
            if head not in SECTIONS:
                raise ConfigError(f"unknown key {key!r}")
            types_ = _field_types(SECTIONS[head])
            if rest not in types_:
                valid = ", ".join(f"{head}.{k}" for k in types_)
                raise ConfigError(f"unknown key {key!r} (valid: {valid})")
            sections.setdefault(head, {})[rest] = parse_value(types_[rest], raw, key)
        else:
            if key not in top or key in SECTIONS or key == "model_name":
                raise ConfigError(f"unknown key {key!r}")
            cfg = replace(cfg, **{key: parse_value(top[key], raw, key)})
    for head, kv in sections.items():
        cfg = replace(cfg, **{head: replace(getattr(cfg, head), **kv)})
    return cfg


def flatten_yaml(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'steps': 5}} -> {'train.steps': 5}; `model: gpt2` stays a preset key."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_yaml(v, key + "."))
        else:
            out[key] = v
    return out


def parse_kv(args: list[str]) -> dict[str, str]:
    """['a.b=1', 'c=x'] -> {'a.b': '1', 'c': 'x'}."""
    out: dict[str, str] = {}
    for a in args:
        key, sep, val = a.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {a!r} is not key=value")
        out[key] = val
    return out


def load_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path!r} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of keys")
    return flatten_yaml(doc)


def validate(cfg: Config) -> Config:
    """Checks that need no data or devices. Raises ConfigError naming the values."""
    m, t = cfg.model, cfg.train
    for name in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if m.vocab_size > 65536:
        raise ConfigError(f"model.vocab_size={m.vocab_size} does not fit uint16 token files (max 65536)")
    if m.attention not in ATTENTIONS:
        raise ConfigError(f"model.attention={m.attention!r} must be one of {', '.join(ATTENTIONS)}")
    if m.attention != "auto" and m.dropout > 0:
        raise ConfigError(f"model.attention={m.attention} has no attention dropout (model.dropout={m.dropout}); "
                          "use model.attention=auto")
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision!r} must be one of {', '.join(PRECISIONS)}")
    for name in ("steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    for name in ("eval_every", "ckpt_every", "warmup_steps", "eval_batches"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    remat = REMAT_ALIASES.get(str(t.remat).lower(), str(t.remat).lower())
    if remat not in REMATS:
        raise ConfigError(f"train.remat={t.remat!r} must be one of {', '.join(REMATS)} (or true/false)")
    if remat != t.remat:
        t = replace(t, remat=remat)
        cfg = replace(cfg, train=t)
    for name in ("vocab_chunks", "mlp_chunks"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    if t.seq_len % t.vocab_chunks:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by train.vocab_chunks={t.vocab_chunks}")
    if (4 * m.n_embd) % t.mlp_chunks:
        raise ConfigError(f"4*model.n_embd={4 * m.n_embd} is not divisible by train.mlp_chunks={t.mlp_chunks}")
    bad_groups = [g for g in cfg.sharding.replicate if g not in PARAM_GROUPS]
    if bad_groups:
        raise ConfigError(f"sharding.replicate={','.join(cfg.sharding.replicate)} names unknown groups "
                          f"({', '.join(bad_groups)}); choose from {', '.join(PARAM_GROUPS)}")
    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    for name, lo, hi in (("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0)):
        if not lo <= getattr(t, name) < hi:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be in [{lo:g}, {hi:g})")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    for name in ("eps", "weight_decay", "grad_clip"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    if t.log_every < 0:
        raise ConfigError(f"train.log_every={t.log_every} must be >= 0")
    if not 0 <= cfg.seed < 2**32:  # numpy's SeedSequence takes non-negative seeds only
        raise ConfigError(f"seed={cfg.seed} must be in [0, 2**32)")
    if cfg.device_peak_flops < 0:
        raise ConfigError(f"device_peak_flops={cfg.device_peak_flops} must be >= 0")
    if t.seq_len > m.n_positions:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.n_positions={m.n_positions}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    if cfg.pipeline.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={cfg.pipeline.schedule!r} must be one of {', '.join(SCHEDULES)}")
    if cfg.progress not in ("auto", "bar", "plain", "none"):
        raise ConfigError(f"progress={cfg.progress!r} must be one of auto, bar, plain, none")
    mesh = dataclasses.asdict(cfg.mesh)
    if sum(v == -1 for v in mesh.values()) > 1:
        raise ConfigError(f"at most one mesh axis may be -1 (got {mesh})")
    bad = {k: v for k, v in mesh.items() if v == 0 or v < -1}
    if bad:
        raise ConfigError(f"mesh sizes must be positive or -1 (got {bad})")
    return cfg


def resolve(args: list[str], config_file: str | None = None, base: Config | None = None) -> Config:
    """defaults (or `base`) -> YAML file -> key=value args, then validate."""
    return resolve_kv(parse_kv(args), config_file, base)


def resolve_kv(kv: dict[str, Any], config_file: str | None = None, base: Config | None = None) -> Config:
    """`resolve` for already split {key: value} overrides."""
    cfg = base or Config()
    if config_file:
        cfg = apply_overrides(cfg, load_yaml(config_file))
    return validate(apply_overrides(cfg, kv))


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> Config:
    """Inverse of to_dict (used to reload a run's saved config.json)."""
    kw: dict[str, Any] = {}
    top = _field_types(Config)
    for k, v in d.items():
        if k in SECTIONS:
            types_ = _field_types(SECTIONS[k])
            kw[k] = SECTIONS[k](**{kk: parse_value(types_[kk], vv, f"{k}.{kk}") if vv is not None else None
                                  for kk, vv in v.items()})
        elif k in top:
            kw[k] = v
    return Config(**kw)


def dumps(cfg: Config) -> str:
    return json.dumps(to_dict(cfg), indent=2)
