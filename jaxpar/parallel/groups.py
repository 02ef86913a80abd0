"""The OSDP parameter groups: one definition, read by the config check, the layout and the planner.

`sharding.replicate=embed,attn,mlp` keeps the named groups replicated over `fsdp` (data-parallel
rules) while the others are ZeRO-3 sharded. A group is a set of dotted parameter-path prefixes of
GPT-2 (`jaxpar.models.gpt2`). No imports, so jax-free code (config, planner) can use it.
"""

from __future__ import annotations

GROUPS: dict[str, tuple[str, ...]] = {
    "embed": ("wte", "wpe", "ln_f"),  # token + position tables, final LayerNorm
    "attn": ("h.ln_1", "h.attn"),  # per block: LayerNorm 1 + attention
    "mlp": ("h.ln_2", "h.mlp"),  # per block: LayerNorm 2 + MLP
}
GROUP_NAMES: tuple[str, ...] = tuple(GROUPS)


def group_of(path: str) -> str:
    """OSDP group of a dotted parameter path ("h.attn.c_attn.weight" -> "attn")."""
    for g, prefixes in GROUPS.items():
        if any(path == p or path.startswith(p + ".") for p in prefixes):
            return g
    raise KeyError(path)
