"""The GPT-2 shape both frameworks build: `ModelConfig` (field names follow HF GPT2Config) and the
presets `model=<name>` selects. `check_shape` holds the rules any GPT-2 of ours obeys (they are
what the HF weight format and the uint16 token files need), with the one-line errors both CLIs print."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpt2common.grammar import ConfigError, setting

SHAPE_KEYS = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
MAX_VOCAB = 65536  # token files hold uint16 ids


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2 shape. Field names follow HF GPT2Config."""

    n_layer: int = setting(12, "transformer blocks")
    n_embd: int = setting(768, "hidden width (residual stream)")
    n_head: int = setting(12, "attention heads; n_embd must be divisible by it")
    vocab_size: int = setting(50257, "token ids the embedding holds (at most 65536: uint16 token files)")
    n_positions: int = setting(1024, "longest sequence (learned position table); train.seq_len <= it")
    # 0 by default so runs are deterministic
    dropout: float = setting(0.0, "resid/embd/attn dropout probability, in [0, 1)")
    layer_norm_epsilon: float = setting(1e-5, "epsilon added to the variance in every LayerNorm")
    # torchref uses HF's attention and ignores this key
    attention: str = setting("auto", "attention core: auto (cuDNN flash on GPU, einsum elsewhere) | xla | cudnn")

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


def preset(name: str) -> ModelConfig:
    """`model=<name>` -> its ModelConfig, or the one-line error listing the presets."""
    if name not in PRESETS:
        raise ConfigError(f"model={name!r} is not a preset (choose from {', '.join(PRESETS)})")
    return PRESETS[name]


def check_shape(m: ModelConfig) -> None:
    """Rules of the model both frameworks hold (no dropout/attention knobs): positive sizes, whole
    heads, ids that fit uint16, a usable LayerNorm epsilon."""
    for name in SHAPE_KEYS:
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}")
    if m.vocab_size > MAX_VOCAB:
        raise ConfigError(f"model.vocab_size={m.vocab_size} does not fit uint16 token files (max {MAX_VOCAB})")
    # LayerNorm divides by sqrt(var + eps): eps <= 0 gives NaN (or inf) from step 1, which a run
    # would blame on train.lr. NaN also reaches here from an HF config.json (json reads NaN).
    if not (m.layer_norm_epsilon > 0 and math.isfinite(m.layer_norm_epsilon)):
        raise ConfigError(f"model.layer_norm_epsilon={m.layer_norm_epsilon} must be positive and finite")
