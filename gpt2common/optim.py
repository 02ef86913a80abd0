"""The optimizer, schedule and batch settings both frameworks run with: the `train.*` keys that
torchref mirrors. jaxpar's `TrainConfig` and torchref's `TrainSettings` extend this one frozen
dataclass, so the names, types, defaults and key order are written once (the schedule itself is
written twice on purpose, once per framework: `jaxpar.train.lr_schedule`, `torchref.model.lr_at`)."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2common.grammar import setting


@dataclass(frozen=True)
class OptimSettings:
    steps: int = setting(1000, "optimizer steps of the run")
    batch_size: int = setting(8, "global sequences per optimizer step (all devices, all accumulation steps)")
    seq_len: int = setting(256, "tokens per sequence (context window trained on)")
    lr: float = setting(6e-4, "peak learning rate (AdamW), reached after warmup")
    min_lr_ratio: float = setting(0.1, "the cosine schedule decays to lr * min_lr_ratio, in [0, 1]")
    # update k < W = min(warmup_steps, steps) runs at lr*(k+1)/(W+1)
    warmup_steps: int = setting(100, "linear warmup steps before the cosine decay")
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay of the matmul weights (not biases, LayerNorm, embeddings)")
    beta1: float = setting(0.9, "AdamW first-moment decay, in [0, 1)")
    beta2: float = setting(0.95, "AdamW second-moment decay, in [0, 1)")
    eps: float = setting(1e-8, "AdamW epsilon")
    grad_clip: float = setting(1.0, "global gradient-norm clip; 0 disables")
    grad_accum: int = setting(1, "micro-steps per optimizer step; batch_size must be divisible by it")


def check_optim(t: OptimSettings) -> None:
    """The range checks of the optimizer settings, one-line ConfigErrors naming the value; both
    `jaxpar.config.validate` and torchref's `validate_run` call it at the same point of their order."""
    from gpt2common.grammar import ConfigError

    if t.lr <= 0:
        raise ConfigError(f"train.lr={t.lr} must be positive")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be in [0, 1)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    for name in ("eps", "weight_decay", "grad_clip"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
