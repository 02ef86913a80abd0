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


def add_bias(y, bias):
    """y + bias computed in fp32 and cast back to y's dtype. With bf16 activations the bias
    gradient is then an fp32 sum over every (batch, seq) position of the cotangent; a bf16 add
    would sum it in bf16 (measured: 3.4e-2 relative error on gpt2-tiny's c_attn.bias, vs 6.6e-3
    worst-case for any parameter with the fp32 add)."""
    return (y.astype(jnp.float32) + bias).astype(y.dtype)


POLICIES = {"bf16": Policy("bf16", jnp.bfloat16), "fp32": Policy("fp32", jnp.float32)}


def get_policy(name: str) -> Policy:
    return POLICIES[name]
