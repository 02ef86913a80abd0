"""The optimizer, schedule and batch settings both frameworks run with: the `train.*` keys that
torchref mirrors. jaxpar's `TrainConfig` and torchref's `TrainSettings` extend this one frozen
dataclass, so the names, types, defaults and key order are written once (the schedule itself is
written twice on purpose, once per framework: `jaxpar.train.lr_schedule`, `torchref.model.lr_at`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimSettings:
    steps: int = 1000
    batch_size: int = 8  # global sequences per optimizer step
    seq_len: int = 256
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100  # update k < W = min(warmup_steps, steps) runs at lr*(k+1)/(W+1)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    grad_accum: int = 1


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
