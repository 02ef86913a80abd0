"""A training-state dir (gpt2common/state.py) written without training: the shared numpy init as
the weights and constant moments, for the tests of the bad-input paths of both CLIs."""

from __future__ import annotations

import numpy as np

from gpt2common import hf
from gpt2common import state as fmt
from gpt2common.init import init_params
from gpt2common.model import PRESETS
from gpt2common.optim import OptimSettings

TINY = PRESETS["gpt2-tiny"]
TRAIN = OptimSettings(steps=6, batch_size=8, seq_len=32, lr=1e-3, warmup_steps=2)
# the keys of a run that TRAIN's state can continue (both CLIs take them)
KEYS = ["model=gpt2-tiny", "train.steps=6", "train.batch_size=8", "train.seq_len=32", "train.lr=1e-3",
        "train.warmup_steps=2"]


def write_state(path, step: int = 3, **manifest_overrides) -> str:
    """gpt2-tiny at `step`: the numpy init (seed 0) as weights, moments 0.5 / 0.25 (HF shapes)."""
    sd = hf.to_hf_state_dict(TINY, init_params(TINY, 0))
    m = fmt.manifest_dict(written_by="test", model=TINY, train=TRAIN, seed=0, step=step, adam_count=step,
                          schedule_count=step, lr_next=1e-3, data={})
    fmt.write_state(str(path), {**m, **manifest_overrides}, sd, {k: np.full_like(v, 0.5) for k, v in sd.items()},
                    {k: np.full_like(v, 0.25) for k, v in sd.items()}, hf.hf_config_dict(TINY))
    return str(path)
