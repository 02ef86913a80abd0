"""Reading a prepared dir's shards (`gpt2common.prepare` writes them) as one token array.

`ShardedTokens` is the concatenation of the shards' memmaps without copying them: `len` and
integer-array indexing (what `get_batch` does with its (B, T+1) window indices) are all the
batch code needs, so batches are the same function of (seed, step) as on one file.
"""

from __future__ import annotations

import os

import numpy as np

from gpt2common.grammar import ConfigError


def shard_list(path: str, split: str, meta: dict) -> list[dict] | None:
    """meta.json's shards of `split` (checked for shape), or None for a single-file dir."""
    shards = meta.get("shards")
    if shards is None:
        return None
    try:
        out = shards[split]
        if not out or any(not isinstance(s.get("file"), str) or os.sep in s["file"] or type(s.get("tokens")) is not int
                          or type(s.get("max_id")) is not int for s in out):
            raise ValueError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"data={path!r}: meta.json's shard list of {split} is missing or corrupt; "
                          "prepare it again") from None
    return out


class ShardedTokens:
    """The shards' token arrays, read as one: shard k holds ids [starts[k], starts[k+1])."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays])
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx)
        flat = idx.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        k = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, self.dtype)
        for s in np.unique(k):
            m = k == s
            out[m] = self.arrays[s][flat[m] - self.starts[s]]
        return out.reshape(idx.shape)

    def max(self):
        return max(a.max() for a in self.arrays)
