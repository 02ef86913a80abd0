"""Typed, frozen configuration: presets and `key=value` overrides.

Every jaxpar command resolves its settings through `resolve()` (the grammar, the GPT-2 shape and
`ConfigError` are shared with torchref: `gpt2common`): defaults -> `--config FILE.yaml` -> `key=value` overrides, dotted keys, unknown
keys rejected with a one-line `ConfigError` (the CLI turns it into exit 2).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field, replace
from typing import Any

from gpt2common.grammar import ConfigError, field_types, load_yaml, parse_kv, parse_value
from gpt2common.model import PRESETS, ModelConfig, check_shape, preset
from gpt2common.optim import OptimSettings, check_optim
from jaxpar.parallel.groups import GROUP_NAMES


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
    schedule: str = "gpipe"  # gpipe | circular | 1f1b (jaxpar.parallel.pipeline_1f1b)
    repeats: int = 1  # chunks per device for the circular schedule
    layers_per_stage: tuple[int, ...] | None = None  # manual stage partition
    # when fsdp-sharded block weights are all-gathered: step (the whole stage once per step,
    # kept for the loop) | layer (each layer every iteration: less memory, more fsdp traffic)
    gather: str = "step"


@dataclass(frozen=True)
class TrainConfig(OptimSettings):
    """OptimSettings (steps ... grad_accum, shared with torchref) + jaxpar's own train keys."""

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
    vocab_chunks: int = 1  # >1: logits + cross-entropy in this many token chunks (jaxpar.models.chunked)
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
SCHEDULES = ("gpipe", "circular", "1f1b")
GATHERS = ("step", "layer")  # pipeline.gather


class Remat(enum.StrEnum):
    """train.remat: what the model recomputes in backward instead of saving (jaxpar.models.gpt2.GPT2)."""

    NONE = "none"
    SELECTIVE = "selective"  # the attention core: scores, softmax, probs·V
    FULL = "full"  # each block, from its input


REMATS = tuple(r.value for r in Remat)
REMAT_ALIASES = {"true": "full", "false": "none"}  # train.remat used to be a bool
PARAM_GROUPS = GROUP_NAMES  # OSDP groups, defined in jaxpar.parallel.groups


SECTIONS = {"model": ModelConfig, "mesh": MeshConfig, "pipeline": PipelineConfig, "train": TrainConfig, "eval": EvalConfig,
            "sharding": ShardingConfig}


def apply_overrides(cfg: Config, items: dict[str, Any]) -> Config:
    """Apply dotted `key: value` overrides; `model=<preset>` is applied first so that
    `model.*` keys refine the chosen preset."""
    items = dict(items)
    if "model" in items:
        name = str(items.pop("model"))
        cfg = replace(cfg, model=preset(name), model_name=name)
    top = field_types(Config)
    sections: dict[str, dict[str, Any]] = {}
    for key, raw in items.items():
        head, _, rest = key.partition(".")
        if rest:
            if head not in SECTIONS:
                raise ConfigError(f"unknown key {key!r}")
            types_ = field_types(SECTIONS[head])
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


def validate(cfg: Config) -> Config:
    """Checks that need no data or devices. Raises ConfigError naming the values."""
    m, t = cfg.model, cfg.train
    check_shape(m)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
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
    if t.steps >= 2**31:  # the state's step counter is int32
        raise ConfigError(f"train.steps={t.steps} must be < 2**31")
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
    check_optim(t)
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
    if cfg.pipeline.gather not in GATHERS:
        raise ConfigError(f"pipeline.gather={cfg.pipeline.gather!r} must be one of {', '.join(GATHERS)}")
    if cfg.progress not in ("auto", "bar", "plain", "none"):
        raise ConfigError(f"progress={cfg.progress!r} must be one of auto, bar, plain, none")
    check_mesh_sizes(cfg.mesh)
    return cfg


def check_mesh_sizes(mc: MeshConfig) -> None:
    """The rules a mesh obeys before devices are known (config.validate, mesh.resolve_mesh_config):
    at most one -1 wildcard, every other size positive."""
    mesh = dataclasses.asdict(mc)
    if sum(v == -1 for v in mesh.values()) > 1:
        raise ConfigError(f"at most one mesh axis may be -1 (got {mesh})")
    bad = {k: v for k, v in mesh.items() if v == 0 or v < -1}
    if bad:
        raise ConfigError(f"mesh sizes must be positive or -1 (got {bad})")


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
    """Inverse of to_dict (used to reload a run's saved config.json). ConfigError (never a
    KeyError / AttributeError traceback) for a file that is not this shape: a non-object, a
    section that is not an object, or a section key this Config does not have (a hand edit, or
    a config.json of another jaxpar version)."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a JSON object, got {type(d).__name__}")
    kw: dict[str, Any] = {}
    top = field_types(Config)
    for k, v in d.items():
        if k in SECTIONS:
            types_ = field_types(SECTIONS[k])
            if not isinstance(v, dict) or set(v) - set(types_):
                raise ConfigError(f"{k}: expected an object with keys from {', '.join(types_)}, got {v!r}")
            kw[k] = SECTIONS[k](**{kk: parse_value(types_[kk], vv, f"{k}.{kk}") if vv is not None else None
                                  for kk, vv in v.items()})
        elif k in top:
            kw[k] = v
    return Config(**kw)


def dumps(cfg: Config) -> str:
    return json.dumps(to_dict(cfg), indent=2)


def split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config FILE` / `--config=FILE` out of argv."""
    out, path, it = [], None, iter(argv)
    for a in it:
        if a == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config needs a file path")
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
            if not path:  # `--config=` (an unset shell variable): not a run on the defaults
                raise ConfigError("--config needs a file path")
        else:
            out.append(a)
    return path, out
