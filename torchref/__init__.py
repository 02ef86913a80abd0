"""torchref: a multi-process PyTorch reference of the six data-parallel strategies of the
GPT-2 data-parallel study (single, single-ps, distributed-ps, horovod, and the -amp variants)."""
