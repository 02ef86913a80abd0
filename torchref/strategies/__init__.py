"""The six strategies of the GPT-2 data-parallel study, one file each behind `Strategy`."""

from __future__ import annotations

from torchref.strategies.base import Strategy


def get(name: str) -> Strategy:
    """Strategy instance by CLI name (validated earlier by torchref.config)."""
    if name == "single":
        from torchref.strategies.single import Single as cls
    elif name == "single-ps":
        from torchref.strategies.single_ps import SinglePS as cls
    elif name == "distributed-ps":
        from torchref.strategies.distributed_ps import DistributedPS as cls
    elif name == "distributed-ps-amp":
        from torchref.strategies.distributed_ps_amp import DistributedPSAMP as cls
    elif name == "horovod":
        from torchref.strategies.horovod import Horovod as cls
    elif name == "horovod-amp":
        from torchref.strategies.horovod_amp import HorovodAMP as cls
    else:
        raise KeyError(name)
    return cls()


__all__ = ["Strategy", "get"]
