"""Dtype policy.

bf16 (default): fp32 master params, optimizer state and gradient reduction; matmul
inputs and activations in bf16; LayerNorm statistics, softmax, logits and loss in fp32.
fp32: everything in fp32, for exact comparisons (parity and sharding tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class Policy:
    name: str
    compute_dtype: jnp.dtype  # activations and matmul operands
    param_dtype: jnp.dtype = jnp.float32  # master weights, grads, optimizer state
    accum_dtype: jnp.dtype = jnp.float32  # LN stats, softmax, logits, loss

    def cast(self, x):
        """Cast a (fp32) parameter or activation to the compute dtype."""
        return x.astype(self.compute_dtype)


POLICIES = {"bf16": Policy("bf16", jnp.bfloat16), "fp32": Policy("fp32", jnp.float32)}


def get_policy(name: str) -> Policy:
    return POLICIES[name]
