"""Typed, frozen configuration: presets and `key=value` overrides.

Every jaxpar command resolves its settings through `resolve()` (the grammar, the GPT-2 shape and
`ConfigError` are shared with torchref: `gpt2common`): defaults -> `--config FILE.yaml` -> `key=value` overrides, dotted keys, unknown
keys rejected with a one-line `ConfigError` (the CLI turns it into exit 2).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
from dataclasses import dataclass, replace
from typing import Any

from gpt2common.grammar import (
    ConfigError,
    field_types,
    load_yaml,
    parse_kv,
    parse_value,
    section_given_a_value,
    setting,
    unknown_key,
)
from gpt2common.model import PRESETS, ModelConfig, check_shape, preset
from gpt2common.optim import OptimSettings, check_optim
from jaxpar.parallel.groups import GROUP_NAMES


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes in canonical axis order; one axis may be -1 (fill)."""

    data: int = setting(1, "data-parallel replicas (the batch is split over data x fsdp); -1: the devices left")
    fsdp: int = setting(1, "fully sharded data parallel: parameters and optimizer state sharded too; -1: fill")
    tensor: int = setting(1, "tensor (Megatron) parallel: heads and MLP columns split; -1: fill")
    pipe: int = setting(1, "pipeline stages, layers split between them; -1: fill")


@dataclass(frozen=True)
class PipelineConfig:
    microbatches: int = setting(1, "microbatches per step through the pipeline (mesh.pipe > 1)")
    schedule: str = setting("gpipe", "pipeline schedule: gpipe | circular | 1f1b | zb (zero-bubble H1) | "
                                                "interleaved (Megatron, repeats chunks per device)")
    repeats: int = setting(1, "layer chunks per device for the circular and interleaved schedules")
    layers_per_stage: tuple[int, ...] | None = setting(None, "manual stage partition, e.g. 5,7 (none: even split)")
    # step keeps the gathered stage for the loop; layer gathers each layer every iteration
    gather: str = setting("step", "when fsdp-sharded block weights are gathered: step (less traffic) | layer "
                                  "(less memory)")


@dataclass(frozen=True)
class TrainConfig(OptimSettings):
    """OptimSettings (steps ... grad_accum, shared with torchref) + jaxpar's own train keys."""

    eval_every: int = setting(100, "validation loss every N steps; 0 disables")
    eval_batches: int = setting(8, "validation batches per evaluation")
    ckpt_every: int = setting(0, "also checkpoint every N steps; 0: none by step count")
    # jaxpar.run.ckpt_clock: the time becomes a step interval all processes share
    ckpt_minutes: float = setting(10.0, "checkpoint about every N minutes of training, stretched so saving "
                                        "takes under 2% of it; 0: off")
    keep_checkpoints: int = setting(2, "newest checkpoints kept in out/ckpt (older ones are deleted)")
    log_every: int = setting(1, "console line every N steps (metrics.jsonl gets every step)")
    # A step whose loss or gradient norm is not finite is never applied either way.
    skip_nonfinite: bool = setting(False, "on a non-finite loss/gradient: false stops the run (exit 2), "
                                          "true skips that batch")
    # selective recomputes scores, softmax, probs·V; full recomputes each block. true/false = full/none.
    remat: str = setting("none", "recompute in backward instead of saving: none | selective | full")
    vocab_chunks: int = setting(1, ">1: logits + cross-entropy in this many token chunks (less memory)")
    mlp_chunks: int = setting(1, ">1: MLP hidden dim in this many chunks, each recomputed in backward")


@dataclass(frozen=True)
class ShardingConfig:
    """Per-group OSDP: parameter groups (embed, attn, mlp) kept replicated over `fsdp`."""

    replicate: tuple[str, ...] = setting((), "parameter groups kept replicated over mesh.fsdp: embed, attn, mlp")


@dataclass(frozen=True)
class TensorConfig:
    """Megatron tensor parallelism over `mesh.tensor`."""

    # Megatron sequence parallelism (Korthikanti et al. 2022): between the blocks' matmuls the
    # residual stream (LayerNorm, dropout, residual adds) is split along T over `tensor`
    # instead of repeated on every tensor peer; all-gather before the column-parallel matmuls,
    # reduce-scatter after the row-parallel ones.
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism: split the residual stream's T over "
                                             "mesh.tensor (needs mesh.tensor > 1 dividing train.seq_len)")


@dataclass(frozen=True)
class EvalConfig:
    windows: int = setting(0, "eval: how many seq_len windows of the data to score; 0: every window that fits")


@dataclass(frozen=True)
class LogConfig:
    """Where per-step metrics go besides out/metrics.jsonl and TensorBoard (out/tb)."""

    wandb: bool = setting(False, "also log to Weights & Biases (extra `wandb`); a resumed run continues its curves")
    wandb_project: str = setting("jaxpar", "Weights & Biases project name")
    wandb_mode: str = setting("offline", "offline (files under out/wandb; `wandb sync` uploads them) | online")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = setting(factory=lambda: PRESETS["gpt2"])
    mesh: MeshConfig = setting(factory=MeshConfig)
    pipeline: PipelineConfig = setting(factory=PipelineConfig)
    train: TrainConfig = setting(factory=TrainConfig)
    eval: EvalConfig = setting(factory=EvalConfig)
    sharding: ShardingConfig = setting(factory=ShardingConfig)
    tensor: TensorConfig = setting(factory=TensorConfig)
    log: LogConfig = setting(factory=LogConfig)
    # written as `model=<preset>` (apply_overrides); model.* keys then refine the preset
    model_name: str = setting("gpt2", "model preset: " + " | ".join(PRESETS))
    data: str = setting("", "text file or folder (tokenized into out/data), or a prepared dir; empty: built-in tiny Shakespeare")
    tokenizer: str = setting("byte", "when data is raw text: byte | bpe | a GPT-2 tokenizer dir")
    precision: str = setting("bf16", "compute precision: bf16 (fp32 master weights) | fp32")
    seed: int = setting(0, "seed of the initial weights, data order and dropout")
    out: str = setting("runs/latest", "run directory (config.json, metrics.jsonl, ckpt/, tb/)")
    resume: bool = setting(False, "continue the run in out= from its newest checkpoint")
    init: str = setting("", "start from these weights: an HF save_pretrained dir, or a hub name in the local HF cache")
    init_state: str = setting("", "continue a training state dir (jaxpar convert to_state=, torchref state_every=): "
                              "weights, AdamW moments, step; docs/state_format.md")
    plan: str = setting("", "apply a plan: auto (search now) | a plan.json from jaxpar plan")
    dry_run: bool = setting(False, "compile the step, print memory and collectives, do not train")
    device_peak_flops: float = setting(0.0, "peak FLOP/s per device for MFU; 0: the GPU table (no MFU elsewhere)")
    progress: str = setting("auto", "console progress: auto | bar | plain | none")


PRECISIONS = ("bf16", "fp32")
ATTENTIONS = ("auto", "xla", "cudnn")
SCHEDULES = ("gpipe", "circular", "1f1b", "zb", "interleaved")
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
            "sharding": ShardingConfig, "tensor": TensorConfig, "log": LogConfig}


def config_keys() -> list[str]:
    """Every `jaxpar train` key: model, each section's dotted keys, the top keys (a hint's candidates)."""
    top = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS and f.name != "model_name"]
    return ["model", *(f"{h}.{k}" for h, cls in SECTIONS.items() for k in field_types(cls)), *top]


def apply_overrides(cfg: Config, items: dict[str, Any]) -> Config:
    """Apply dotted `key: value` overrides; `model=<preset>` is applied first so that
    `model.*` keys refine the chosen preset."""
    items = dict(items)
    # A run's config.json names its model `model_name` (beside every model.* key): a preset is
    # applied as `model=` would be; another label (hf:<dir> of a converted run) is kept as is.
    label = items.pop("model_name", None)
    if label is not None and "model" not in items:
        if str(label) in PRESETS:
            items["model"] = label
        elif str(label).startswith("hf:"):
            cfg = replace(cfg, model_name=str(label))
        else:
            raise ConfigError(f"model_name={label!r} is neither a preset ({', '.join(PRESETS)}) nor an hf:<dir> label")
    if "model" in items:
        name = str(items.pop("model"))
        cfg = replace(cfg, model=preset(name), model_name=name)
    top = field_types(Config)
    sections: dict[str, dict[str, Any]] = {}
    for key, raw in items.items():
        head, _, rest = key.partition(".")
        if rest:
            if head not in SECTIONS:
                raise unknown_key(key, config_keys())
            types_ = field_types(SECTIONS[head])
            if rest not in types_:
                raise unknown_key(key, (), ", ".join(f"{head}.{k}" for k in types_))
            sections.setdefault(head, {})[rest] = parse_value(types_[rest], raw, key)
        else:
            if key in SECTIONS:
                raise section_given_a_value(key, raw, dataclasses.fields(SECTIONS[key])[0].name)
            if key not in top:
                raise unknown_key(key, config_keys())
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
    for name in ("eval_every", "ckpt_every", "ckpt_minutes", "warmup_steps"):  # 0: off (or no warmup)
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    remat = REMAT_ALIASES.get(str(t.remat).lower(), str(t.remat).lower())
    if remat not in REMATS:
        raise ConfigError(f"train.remat={t.remat!r} must be one of {', '.join(REMATS)} (or true/false)")
    if remat != t.remat:
        t = replace(t, remat=remat)
        cfg = replace(cfg, train=t)
    # eval_batches=0 would average over no batch (ZeroDivisionError at the first eval); eval_every=0 turns eval off
    for name in ("vocab_chunks", "mlp_chunks", "keep_checkpoints", "eval_batches"):
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
    if cfg.log.wandb_mode not in ("offline", "online"):
        raise ConfigError(f"log.wandb_mode={cfg.log.wandb_mode!r} must be offline or online")
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("log.wandb=true needs the wandb package: pip install -e '.[wandb]'")
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


def resolve_kv(kv: dict[str, Any], config_file: str | None = None, base: Config | None = None,
               file_kv: dict[str, Any] | None = None) -> Config:
    """`resolve` for already split {key: value} overrides. file_kv: `config_file` already read
    (`load_yaml`), so a caller that looked into it does not read it twice."""
    cfg = base or Config()
    if file_kv is None and config_file:
        file_kv = load_yaml(config_file)
    if file_kv:
        cfg = apply_overrides(cfg, file_kv)
    return absolute_paths(validate(apply_overrides(cfg, kv)), base)


PATH_KEYS = ("data", "tokenizer", "init")  # settings that may name a file or dir a run records
NOT_PATHS = {"tokenizer": ("byte", "bpe")}  # values that name no path, whatever the working dir holds


def absolute_paths(cfg: Config, base: Config | None) -> Config:
    """`data=`, `tokenizer=<dir>` and `init=<dir>` as paths that mean the same from any working
    directory: a run records them in its config.json, and resume=true, eval and sample may start
    elsewhere (a relative path then names nothing, or another dataset). A new config's relative
    path is made absolute when it exists here (a missing one stays as typed, for the error that
    names it; `init=gpt2` is then a hub name). Over a `base` (resume=true: the run's config.json)
    a given relative path is made absolute only when the base's is, so that resume compares the
    two as absolute paths; an older run's recorded relative path stays as it was and is compared
    as before. "" (the built-in corpus, no init) is not a path."""
    absolute = {}
    for key in PATH_KEYS:
        value = getattr(cfg, key)
        if not value or os.path.isabs(value) or value in NOT_PATHS.get(key, ()):
            continue
        if base is None and not os.path.exists(value):
            continue
        if base is not None and not os.path.isabs(getattr(base, key)):
            continue
        absolute[key] = os.path.abspath(value)
    return replace(cfg, **absolute) if absolute else cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> Config:
    """Inverse of to_dict (used to reload a run's saved config.json). ConfigError (never a
    KeyError / AttributeError traceback) for a file that is not this shape: a non-object, a
    section that is not an object, a key or section key this Config does not have (a hand edit,
    a config.json of another jaxpar version or of another program), or a value not of its key's
    type (`"seed": "x"`, a null where a key takes no null: each was a TypeError traceback in
    validate)."""
    if not isinstance(d, dict):
        raise ConfigError(f"expected a JSON object, got {type(d).__name__}")
    kw: dict[str, Any] = {}
    top = field_types(Config)
    for k, v in d.items():
        if k in SECTIONS:
            types_ = field_types(SECTIONS[k])
            if not isinstance(v, dict) or set(v) - set(types_):
                raise ConfigError(f"{k}: expected an object with keys from {', '.join(types_)}, got {v!r}")
            kw[k] = SECTIONS[k](**{kk: parse_value(types_[kk], vv, f"{k}.{kk}") for kk, vv in v.items()})
        elif k in top:
            kw[k] = parse_value(top[k], v, k)
        else:  # any JSON object read as the defaults: an HF config.json trained the 124M preset
            raise ConfigError(f"{k!r} is not a key of a jaxpar config")
    return Config(**kw)


def dumps(cfg: Config) -> str:
    return json.dumps(to_dict(cfg), indent=2)


# What a start did rather than what the run is: resume=true (config.json is the run's own,
# continued), dry_run, and plan (its result is the mesh/pipeline/train keys, already in the config).
RUN_STATE = {"resume": False, "dry_run": False, "plan": ""}


def settings_of(cfg: Config) -> Config:
    """The run's settings without RUN_STATE: what `<out>/config.json` holds and `jaxpar train`
    prints, so that `--config <out>/config.json` starts the very same run again."""
    return replace(cfg, **RUN_STATE)


def split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config FILE` / `--config=FILE` out of argv."""
    from gpt2common.grammar import given_twice

    out, path, it = [], None, iter(argv)
    for a in it:
        if a == "--config" or a.startswith("--config="):
            given = next(it, None) if a == "--config" else a.split("=", 1)[1]
            if not given:  # `--config=` (an unset shell variable): not a run on the defaults
                raise ConfigError("--config needs a file path")
            if path is not None:  # the first file would be dropped
                raise given_twice("--config", path, given)
            path = given
        else:
            out.append(a)
    return path, out
