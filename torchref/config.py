"""torchref's settings: the `jaxpar train` keys it takes (`torchref.run_config`: mirrored ones
held in `RunConfig`, the others accepted and ignored or rejected per `KEY_POLICY`; unknown keys
rejected with one line) plus the keys below, which only mean something to the PyTorch reference:

  strategy=single|single-ps|distributed-ps|horovod|distributed-ps-amp|horovod-amp
  workers=N                  data-parallel worker processes (the PS strategy adds one server)
  ps.async=false             asynchronous parameter server (NOT loss-equivalent to `single`)
  ps.max_staleness=2         async only: drop gradients computed on weights older than this
  ddp.bucket_mb=25           DistributedDataParallel bucket size
  horovod.fusion_mb=64       fusion buffer size (Horovod's HOROVOD_FUSION_THRESHOLD)
  horovod.algorithm=mpi|ring MPI_Allreduce, or the explicit ring in torchref.comm
  horovod.compression=none|fp16
  amp.dtype=bf16|fp16        autocast dtype of the -amp strategies (fp16 adds GradScaler)
  device=cpu|cuda            where the model and batches live (cuda: one GPU per process); CPU
                             unless asked, whether or not CUDA exists
  backend=auto|gloo|nccl     torch.distributed backend (auto: nccl with device=cuda, gloo with cpu)
  timeout_s=120              collective timeout; a dead peer ends the run within this bound
  state_every=0              write the training state to <out>/state/<step>/ every N steps and
                             after the last (docs/state_format.md); 0: never
  debug.grad_step=0          save the averaged gradient of this step (1-based) to grads_step<K>.safetensors
  debug.crash_rank=-1, debug.crash_step=0   fault injection: that worker exits at that step
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field, replace
from typing import Any

from gpt2common.grammar import ConfigError, load_yaml, parse_kv, parse_value, section_given_a_value, setting
from gpt2common.hf import check_init_model_keys
from torchref.run_config import RunConfig, apply_run_overrides, check_rejected, validate_run

STRATEGY_NAMES = ("single", "single-ps", "distributed-ps", "horovod", "distributed-ps-amp", "horovod-amp")


class WorkerDied(RuntimeError):
    """A worker process exited abnormally; the launcher stopped the others (CLI: exit 2)."""


@dataclass(frozen=True)
class PSConfig:
    async_: bool = setting(False, "asynchronous parameter server, strategy=single-ps only (NOT loss-equivalent "
                                  "to single)")  # key `ps.async` (async is a Python keyword)
    max_staleness: int = setting(2, "ps.async only: drop gradients computed on weights older than this many updates")


@dataclass(frozen=True)
class DDPConfig:
    bucket_mb: float = setting(25.0, "DistributedDataParallel bucket size in MiB (torch DDP's bucket_cap_mb)")


@dataclass(frozen=True)
class HorovodConfig:
    fusion_mb: float = setting(64.0, "fusion buffer in MiB (Horovod's HOROVOD_FUSION_THRESHOLD default)")
    algorithm: str = setting("mpi", "mpi (MPI_Allreduce) | ring (the explicit ring in torchref.comm)")
    compression: str = setting("none", "gradients on the wire: none | fp16")


@dataclass(frozen=True)
class AMPConfig:
    dtype: str = setting("bf16", "autocast dtype of the -amp strategies: bf16 | fp16 (adds GradScaler loss scaling)")


@dataclass(frozen=True)
class DebugConfig:
    grad_step: int = setting(0, "save the averaged gradient of this step (1-based) to grads_step<K>.safetensors; 0: none")
    crash_rank: int = setting(-1, "fault injection: this worker exits at debug.crash_step; -1: none")
    crash_step: int = setting(0, "fault injection: the step debug.crash_rank exits at")


@dataclass(frozen=True)
class RefConfig:
    strategy: str = setting("single", "data-parallel strategy: " + " | ".join(STRATEGY_NAMES))
    workers: int = setting(1, "data-parallel worker processes (1 for single; the PS strategies add a server)")
    device: str = setting("cpu", "where the model and batches live: cpu | cuda (one GPU per process); CPU unless asked")
    backend: str = setting("auto", "torch.distributed backend: auto (nccl with device=cuda, gloo with cpu) | gloo | nccl")
    timeout_s: float = setting(120.0, "collective timeout in seconds; a dead peer ends the run within it")
    state_every: int = setting(0, "write the training state to <out>/state/<step>/ every N steps and after the "
                                  "last (docs/state_format.md); 0: never")
    ps: PSConfig = field(default_factory=PSConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    horovod: HorovodConfig = field(default_factory=HorovodConfig)
    amp: AMPConfig = field(default_factory=AMPConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def is_amp(self) -> bool:
        return self.strategy.endswith("-amp")

    @property
    def multi_worker(self) -> bool:
        return self.strategy != "single"

    @property
    def dist_backend(self) -> str:
        """The torch.distributed backend: `backend`, or for auto the one `device` needs."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device == "cuda" else "gloo"


_SECTIONS = {"ps": PSConfig, "ddp": DDPConfig, "horovod": HorovodConfig, "amp": AMPConfig, "debug": DebugConfig}
_TOP = ("strategy", "workers", "device", "backend", "timeout_s", "state_every")


def _fname(section: str, key: str) -> str:
    return "async_" if (section, key) == ("ps", "async") else key


def _key(fname: str) -> str:
    """The key a field is given by: `_fname`'s inverse (only ps.async is renamed)."""
    return "async" if fname == "async_" else fname


def split_items(items: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate torchref's own keys from the `jaxpar train` keys (the latter go to `torchref.run_config`)."""
    ours, theirs = {}, {}
    for k, v in items.items():
        head = k.partition(".")[0]
        (ours if (k in _TOP or head in _SECTIONS) else theirs)[k] = v
    return ours, theirs


def apply_ref_overrides(ref: RefConfig, items: dict[str, Any]) -> RefConfig:
    hints = typing.get_type_hints(RefConfig)
    sections: dict[str, dict[str, Any]] = {}
    for key, raw in items.items():
        head, _, rest = key.partition(".")
        if not rest:
            if head in _SECTIONS:
                raise section_given_a_value(head, raw, _key(dataclasses.fields(_SECTIONS[head])[0].name))
            ref = replace(ref, **{head: parse_value(hints[head], raw, key)})
            continue
        cls = _SECTIONS[head]
        types_ = typing.get_type_hints(cls)
        name = _fname(head, rest)
        if name not in types_ or name == "async" or (name == "async_" and rest != "async"):
            valid = ", ".join(f"{head}.{_key(f)}" for f in types_)
            raise ConfigError(f"unknown key {key!r} (valid: {valid})")
        sections.setdefault(head, {})[name] = parse_value(types_[name], raw, key)
    for head, kv in sections.items():
        ref = replace(ref, **{head: replace(getattr(ref, head), **kv)})
    return ref


def validate_ref(cfg: RunConfig, ref: RefConfig) -> None:
    """Checks that need no processes. Raises ConfigError with a one-line message."""
    if ref.strategy not in STRATEGY_NAMES:
        raise ConfigError(f"strategy={ref.strategy!r} is unknown (choose from {', '.join(STRATEGY_NAMES)})")
    if ref.multi_worker and ref.workers < 2:
        raise ConfigError(f"strategy={ref.strategy} needs workers >= 2 (got workers={ref.workers})")
    if not ref.multi_worker and ref.workers != 1:
        raise ConfigError(f"strategy=single runs one process; workers={ref.workers} must be 1")
    if cfg.train.batch_size % ref.workers:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by workers={ref.workers}")
    if cfg.train.batch_size % (ref.workers * cfg.train.grad_accum):
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by "
                          f"workers×train.grad_accum={ref.workers}×{cfg.train.grad_accum}")
    if ref.horovod.algorithm not in ("mpi", "ring"):
        raise ConfigError(f"horovod.algorithm={ref.horovod.algorithm!r} must be mpi or ring")
    if ref.horovod.compression not in ("none", "fp16"):
        raise ConfigError(f"horovod.compression={ref.horovod.compression!r} must be none or fp16")
    if ref.amp.dtype not in ("bf16", "fp16"):
        raise ConfigError(f"amp.dtype={ref.amp.dtype!r} must be bf16 or fp16")
    if ref.device not in ("cpu", "cuda"):
        raise ConfigError(f"device={ref.device!r} must be cpu or cuda")
    if ref.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend={ref.backend!r} must be auto, gloo or nccl")
    if ref.backend == "nccl" and ref.device != "cuda":
        raise ConfigError(f"backend=nccl needs device=cuda (NCCL moves GPU tensors; device={ref.device})")
    if ref.ps.async_ and ref.strategy != "single-ps":
        raise ConfigError(f"ps.async=true needs strategy=single-ps (got strategy={ref.strategy})")
    if ref.ps.max_staleness < 0:
        raise ConfigError(f"ps.max_staleness={ref.ps.max_staleness} must be >= 0")
    if ref.ddp.bucket_mb <= 0 or ref.horovod.fusion_mb <= 0:
        raise ConfigError(f"ddp.bucket_mb={ref.ddp.bucket_mb} and horovod.fusion_mb={ref.horovod.fusion_mb} must be positive")
    if ref.timeout_s <= 0:
        raise ConfigError(f"timeout_s={ref.timeout_s} must be positive")
    if ref.state_every < 0:
        raise ConfigError(f"state_every={ref.state_every} must be >= 0 (0: no training state is written)")
    if ref.state_every and ref.strategy == "single-ps":
        raise ConfigError("state_every= needs an all-reduce strategy; strategy=single-ps keeps its optimizer "
                          "on the server")


def resolve_ref(args: list[str], config_file: str | None = None) -> tuple[RunConfig, RefConfig]:
    """key=value args (+ optional YAML) -> (RunConfig, RefConfig), validated.

    `precision` belongs to the strategy here: the fp32 strategies compute in fp32, the -amp ones
    under autocast(amp.dtype). `precision=fp32` (non-amp) or `precision=bf16` (amp, amp.dtype=bf16)
    are accepted for symmetry with `jaxpar train`; a contradicting value is an error.
    """
    items: dict[str, Any] = load_yaml(config_file) if config_file else {}
    items.update(parse_kv(args))
    precision = items.pop("precision", None)
    ours, theirs = split_items(items)
    ref = apply_ref_overrides(RefConfig(), ours)
    # model keys beside init= that disagree with its weights: refused as `jaxpar train` refuses them
    check_init_model_keys(theirs, lambda weights, kv: apply_run_overrides(RunConfig(model=weights), kv)[0].model)
    cfg, ignored = apply_run_overrides(RunConfig(), theirs)
    from gpt2common.data import tokenizer_for_init

    # raw text of a fine-tune: init's own tokenizer, as `jaxpar train` (jaxpar/run/rundir.py)
    cfg = replace(cfg, tokenizer=tokenizer_for_init(cfg.init, cfg.data, cfg.tokenizer, "tokenizer" in theirs))
    validate_run(cfg)
    cfg = replace(cfg, precision="bf16" if ref.is_amp and ref.amp.dtype == "bf16" else "fp32")
    validate_ref(cfg, ref)
    check_rejected(ignored)
    if precision is not None:
        want = "fp32" if not ref.is_amp else ref.amp.dtype
        if str(precision) != want:
            raise ConfigError(f"precision={precision} contradicts strategy={ref.strategy}"
                              f"{' amp.dtype=' + ref.amp.dtype if ref.is_amp else ''} (it computes in {want})")
    return cfg, ref


def ref_to_dict(ref: RefConfig) -> dict[str, Any]:
    d = dataclasses.asdict(ref)
    d["ps"]["async"] = d["ps"].pop("async_")
    return d


def ref_from_dict(d: dict[str, Any]) -> RefConfig:
    d = json.loads(json.dumps(d))
    d["ps"]["async_"] = d["ps"].pop("async")
    return RefConfig(**{k: (_SECTIONS[k](**v) if k in _SECTIONS else v) for k, v in d.items()})
