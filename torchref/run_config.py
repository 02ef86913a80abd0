"""The `jaxpar train` keys torchref takes, held in torchref's own frozen dataclasses.

torchref accepts every key of `jaxpar train` and decides per key what to do (`KEY_POLICY`;
`parity_tests/test_key_policy.py` enumerates jaxpar's config dataclasses against it and fails on
a key that is in neither):
  mirrored   torchref computes the same training math with it (checked by the parity tests):
             held in `RunConfig`
  same-math  a jaxpar memory/layout knob whose every value computes the same math; torchref has no
             such knob: the value is parsed to the key's type (a malformed one is still an error)
             and then ignored, not held (the property parity test draws these keys)
  no-math    output and bookkeeping only: parsed and ignored like same-math, except the two torchref
             uses itself (`out`, the run dir; `train.log_every`, console lines), which are held
  rejected   a non-default value is refused with one line naming the key, value and reason

Keys torchref does not hold are declared in `IGNORED` with their type and jaxpar's default (the
default decides "non-default" for rejected keys); `test_key_policy` checks every declared default
and type, and every default of `TrainSettings`, against jaxpar's dataclasses. The grammar (parsing,
YAML, `ConfigError`) and the GPT-2 shape come from `gpt2common`, as in jaxpar.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from gpt2common.grammar import ConfigError, field_types, parse_value, section_given_a_value, setting, unknown_key
from gpt2common.model import PRESETS, ModelConfig, check_shape, preset
from gpt2common.optim import OptimSettings, check_optim

KEY_POLICY: dict[str, tuple[str, str]] = {
    "model": ("mirrored", "preset -> the HF config of the run's init dir"),
    **{f"model.{k}": ("mirrored", "HF GPT2Config of the init dir") for k in
       ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "layer_norm_epsilon")},
    "model.dropout": ("rejected", "torch cannot draw jaxpar's dropout masks, so no step would be comparable; "
                      "use model.dropout=0"),
    **{f"mesh.{k}": ("rejected", "torchref is data-parallel only; use workers=N")
       for k in ("data", "fsdp", "tensor", "pipe")},
    **{f"pipeline.{k}": ("rejected", "torchref has no pipeline parallelism")
       for k in ("microbatches", "schedule", "repeats", "layers_per_stage")},
    "pipeline.gather": ("same-math", "when a pipeline gathers its fsdp-sharded weights (torchref has no pipeline)"),
    **{f"train.{k}": ("mirrored", "same optimizer, schedule and batches") for k in
       ("steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2",
        "eps", "grad_clip", "grad_accum")},
    "train.eval_every": ("no-math", "torchref logs no val_loss"),
    "train.eval_batches": ("no-math", "torchref logs no val_loss"),
    "train.ckpt_every": ("no-math", "torchref writes its weights at the end only"),
    "train.ckpt_minutes": ("no-math", "torchref writes its weights at the end only"),
    "train.keep_checkpoints": ("no-math", "torchref writes its weights at the end only"),
    "tensor.sequence_parallel": ("same-math", "where the residual stream of a tensor-parallel mesh is split"),
    "train.log_every": ("no-math", "console lines"),
    "train.skip_nonfinite": ("rejected", "torchref does not skip non-finite steps"),
    "model.attention": ("same-math", "attention kernel (einsum core, jax.nn.dot_product_attention or cuDNN)"),
    "train.remat": ("same-math", "recomputation in backward"),
    "train.vocab_chunks": ("same-math", "chunked logits + cross-entropy"),
    "train.mlp_chunks": ("same-math", "chunked MLP"),
    "eval.windows": ("no-math", "jaxpar eval only"),
    "sharding.replicate": ("same-math", "which groups FSDP replicates"),
    "data": ("mirrored", "same prepared data and batch order"),
    "tokenizer": ("mirrored", "same tokenizer for raw text"),
    "precision": ("mirrored", "fp32 strategies compute in fp32, -amp ones under autocast(amp.dtype)"),
    "seed": ("mirrored", "same batches and the same numpy init"),
    "init": ("mirrored", "same HF weights"),
    "init_state": ("mirrored", "same weights, AdamW moments and step (torchref.handoff)"),
    "out": ("no-math", "the run directory"),
    "resume": ("rejected", "torchref has no checkpoints to resume from"),
    "plan": ("rejected", "a plan sets jaxpar's mesh"),
    "dry_run": ("rejected", "torchref does not compile"),
    "device_peak_flops": ("no-math", "MFU only"),
    "progress": ("no-math", "console display"),
    **{f"log.{k}": ("no-math", "Weights & Biases logging (torchref writes metrics.jsonl only)")
       for k in ("wandb", "wandb_project", "wandb_mode")},
}

# Keys torchref parses but does not hold: {key: (type, jaxpar's default)}.
IGNORED: dict[str, tuple[Any, Any]] = {
    "model.dropout": (float, 0.0), "model.attention": (str, "auto"),
    **{f"mesh.{k}": (int, 1) for k in ("data", "fsdp", "tensor", "pipe")},
    "pipeline.microbatches": (int, 1), "pipeline.schedule": (str, "gpipe"), "pipeline.repeats": (int, 1),
    "pipeline.layers_per_stage": (tuple[int, ...] | None, None), "pipeline.gather": (str, "step"),
    "train.eval_every": (int, 100), "train.eval_batches": (int, 8), "train.ckpt_every": (int, 0),
    "train.ckpt_minutes": (float, 10.0), "train.keep_checkpoints": (int, 2), "tensor.sequence_parallel": (bool, False),
    "train.skip_nonfinite": (bool, False), "train.remat": (str, "none"), "train.vocab_chunks": (int, 1),
    "train.mlp_chunks": (int, 1), "eval.windows": (int, 0), "sharding.replicate": (tuple[str, ...], ()),
    "resume": (bool, False), "plan": (str, ""), "dry_run": (bool, False), "device_peak_flops": (float, 0.0),
    "progress": (str, "auto"), "log.wandb": (bool, False), "log.wandb_project": (str, "jaxpar"),
    "log.wandb_mode": (str, "offline"),
}


@dataclass(frozen=True)
class TrainSettings(OptimSettings):
    """The `train.*` keys torchref holds: the optimizer, schedule and batch keys (mirrored: the
    shared `gpt2common.optim.OptimSettings`) and `log_every`."""

    log_every: int = setting(1, "console line every N steps (metrics.jsonl gets every step)")


@dataclass(frozen=True)
class RunConfig:
    """What a torchref run computes with. `model` is the shared GPT-2 shape; its jaxpar-only
    fields (dropout, attention) stay at their defaults here (dropout > 0 is rejected, attention ignored)."""

    model: ModelConfig = field(default_factory=lambda: PRESETS["gpt2"])
    train: TrainSettings = field(default_factory=TrainSettings)
    model_name: str = setting("gpt2", "model preset: " + " | ".join(PRESETS))  # the model section started from it
    data: str = setting("", "text file or folder, or a prepared dir (as jaxpar train); empty: built-in tiny Shakespeare")
    tokenizer: str = setting("byte", "when data is raw text: byte | bpe | a GPT-2 tokenizer dir")
    # set from the strategy by torchref.config.resolve_ref
    precision: str = setting("fp32", "set by the strategy: fp32, or the -amp strategies' amp.dtype; a value that "
                                     "contradicts it is refused")
    seed: int = setting(0, "seed of the initial weights (numpy, shared with jaxpar) and the batch order")
    out: str = setting("runs/latest", "run directory (config, metrics.jsonl, summary.json, hf/, logs/)")
    init: str = setting("", "HF save_pretrained dir (or a local hub name) to start from; model keys that disagree "
                            "with its weights are refused")
    init_state: str = setting("", "training-state dir to continue: weights, AdamW moments and step (gpt2common.state)")


SECTIONS = {"model": ModelConfig, "train": TrainSettings}
HELD = set(KEY_POLICY) - set(IGNORED)  # keys whose value RunConfig holds


def _unknown(key: str) -> ConfigError:
    head, _, rest = key.partition(".")
    valid = [k for k in KEY_POLICY if k.startswith(head + ".")]
    if head == "model":  # listed in the shared dataclass's order, as jaxpar lists them
        valid = [f"model.{f.name}" for f in dataclasses.fields(ModelConfig)]
    return unknown_key(key, KEY_POLICY, ", ".join(valid) if rest else "")


def apply_run_overrides(cfg: RunConfig, items: dict[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """Dotted `key: value` overrides of jaxpar train keys -> (RunConfig, {ignored key: parsed value}).
    `model=<preset>` is applied first so that `model.*` keys refine the chosen preset."""
    items = dict(items)
    if "model" in items:
        name = str(items.pop("model"))
        cfg = replace(cfg, model=preset(name), model_name=name)
    ignored: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    top = field_types(RunConfig)
    for key, raw in items.items():
        if (first := next((k for k in KEY_POLICY if k.startswith(f"{key}.")), None)) is not None:
            raise section_given_a_value(key, raw, first.partition(".")[2])
        if key not in KEY_POLICY:
            raise _unknown(key)
        if key in IGNORED:
            tp, _ = IGNORED[key]
            ignored[key] = parse_value(tp, raw, key)
            continue
        head, _, rest = key.partition(".")
        if rest:
            sections.setdefault(head, {})[rest] = parse_value(field_types(SECTIONS[head])[rest], raw, key)
        else:
            cfg = replace(cfg, **{key: parse_value(top[key], raw, key)})
    for head, kv in sections.items():
        cfg = replace(cfg, **{head: replace(getattr(cfg, head), **kv)})
    return cfg, ignored


def validate_run(cfg: RunConfig) -> None:
    """jaxpar's checks of the keys torchref holds, in jaxpar's order and with its messages
    (test_key_policy compares the two on bad values of every held key)."""
    m, t = cfg.model, cfg.train
    check_shape(m)
    for name in ("steps", "batch_size", "seq_len", "grad_accum"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0")
    check_optim(t)
    if t.log_every < 0:
        raise ConfigError(f"train.log_every={t.log_every} must be >= 0")
    if not 0 <= cfg.seed < 2**32:  # numpy's SeedSequence takes non-negative seeds only
        raise ConfigError(f"seed={cfg.seed} must be in [0, 2**32)")
    if t.seq_len > m.n_positions:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.n_positions={m.n_positions}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, tuple):
        return ",".join(map(str, v))
    return str(v)


def check_rejected(ignored: dict[str, Any]) -> None:
    """Keys the reference does not model (KEY_POLICY 'rejected'): refuse a non-default value
    rather than silently ignore it."""
    for key, (kind, why) in KEY_POLICY.items():
        if kind == "rejected" and key in ignored and ignored[key] != IGNORED[key][1]:
            raise ConfigError(f"{key}={_fmt(ignored[key])} is not supported by torchref ({why})")


def run_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def run_from_dict(d: dict[str, Any]) -> RunConfig:
    """Inverse of run_to_dict (a Job read back by an mpiexec-launched worker)."""
    return RunConfig(**{k: (SECTIONS[k](**v) if k in SECTIONS else v) for k, v in d.items()})
