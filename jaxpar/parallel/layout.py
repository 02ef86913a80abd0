"""The parallel layout: every parallelism decision, resolved and validated once.

`build_layout(cfg, n_devices)` turns a config and a device count into one frozen
`ParallelLayout`: the mesh sizes (the -1 filled in), the parameter rules of each OSDP group
(including `layers -> pipe`), the activation rules outside and inside the pipeline, the batch
axes, the axes the pipeline's `shard_map` is manual over, and the pipeline's stage layout.
Every check that needs the device count happens here, each a one-line `ConfigError` naming the
values; train, the pipeline, eval, inspect and the planner read the layout (or, for the
planner, the same `mesh_problem` predicate) and never re-derive a rule. This is torchtitan's
`ParallelDims` and MaxText's single `logical_axis_rules` table, for jaxpar.

Rules map logical dim names (`batch, seq, embed, heads, head_dim, mlp, vocab, layers`, named by
`jaxpar.models.gpt2`) to mesh axes; `jaxpar.parallel.logical.spec_for` turns them into PartitionSpecs.
What each table means for GPT-2 is explained in `jaxpar.parallel.sharding`. This module imports no JAX
(the planner and the config checks use it before JAX starts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpar.config import Config, ConfigError, MeshConfig, ModelConfig, Remat, check_mesh_sizes
from jaxpar.parallel.groups import GROUPS, group_of
from jaxpar.parallel.partition import partition_layers, stage_bounds, validate_layers_per_stage
from jaxpar.parallel.schedules import TABLE_SCHEDULES, schedule_problem  # numpy only: tables, one executor

Rules = dict[str, Any]  # logical name -> mesh axis, tuple of axes, or None

BATCH_AXES = ("data", "fsdp")  # the batch dim is split over every data-parallel axis

# Megatron tensor parallelism: attention heads, MLP hidden units and the vocabulary split over
# `tensor`, for parameters and activations alike (the one statement of this table).
TENSOR_RULES: Rules = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}

# ---- parameter rules, one table per parallelism, composed data -> fsdp -> tensor -> pipe
DP_PARAM_RULES: Rules = {}  # data parallel: every parameter replicated
FSDP_PARAM_RULES: Rules = {"embed": "fsdp"}  # ZeRO-3: params, grads, AdamW moments split on embed
TP_PARAM_RULES: Rules = TENSOR_RULES
# Pipeline: the stacked (L, ...) `layers` dim over pipe, when L splits evenly (GPipe stage s then
# stores exactly its own layers); otherwise the blocks stay whole over pipe and are gathered.
PIPE_PARAM_RULES: Rules = {"layers": "pipe"}

# ---- activation rules: batch over the data-parallel axes; inside a block heads / mlp / vocab
# follow the parameters' tensor split; the residual stream (embed) stays whole.
ACTIVATION_RULES: Rules = {"batch": BATCH_AXES, **TENSOR_RULES}
# Megatron sequence parallelism (tensor.sequence_parallel): the residual stream's T over `tensor`.
SEQUENCE_PARALLEL_RULES: Rules = {"resid_seq": "tensor"}
# Inside the pipeline's shard_map data, fsdp and pipe are manual: tensor is the only auto axis.
PIPELINE_MANUAL_AXES = ("data", "fsdp", "pipe")
PIPELINE_INNER_RULES: Rules = TENSOR_RULES

# Top-level keys of a block's params (gpt2.BLOCK_AXES) -> their OSDP group.
BLOCK_GROUPS = {"ln_1": "attn", "attn": "attn", "ln_2": "mlp", "mlp": "mlp"}

# Named meshes on 8 devices (golden snapshots, examples, the comm benchmark).
NAMED_MESHES: dict[str, MeshConfig] = {
    "dp": MeshConfig(data=8),
    "fsdp": MeshConfig(fsdp=8),
    "tp": MeshConfig(tensor=4, data=2),
    "dp_fsdp_tp": MeshConfig(data=2, fsdp=2, tensor=2),
}


def param_rules(mc: MeshConfig, replicated: bool = False, n_layer: int | None = None) -> Rules:
    """Parameter rules for the axes in use (size != 1), composed data -> fsdp -> tensor -> pipe.
    replicated: an OSDP group kept whole over fsdp (the fsdp table is skipped).
    n_layer: with mesh.pipe > 1, `layers -> pipe` applies when pipe divides it (None: never)."""
    rules: Rules = dict(DP_PARAM_RULES)
    if mc.fsdp != 1 and not replicated:
        rules.update(FSDP_PARAM_RULES)
    if mc.tensor != 1:
        rules.update(TP_PARAM_RULES)
    if mc.pipe > 1 and n_layer is not None and n_layer % mc.pipe == 0:
        rules.update(PIPE_PARAM_RULES)
    return rules


# ----------------------------------------------------------------------------- sizes and the one predicate


def shown_sizes(sizes: dict) -> str:
    """{"data": 2, "fsdp": 4} -> "data=2×fsdp=4" (how error messages show a mesh)."""
    return "×".join(f"{k}={v}" for k, v in sizes.items())


def resolve_mesh_config(mc: MeshConfig, n_devices: int) -> MeshConfig:
    """Fill the one -1 axis so the product equals `n_devices`; check the product.

    Raises a one-line ConfigError naming the sizes and the device count."""
    check_mesh_sizes(mc)  # the same two rules (and texts) config.validate applies
    sizes = dataclasses.asdict(mc)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    wild = [k for k, v in sizes.items() if v == -1]
    if wild:
        if n_devices % fixed:
            raise ConfigError(f"mesh {shown_sizes(sizes)}: {n_devices} devices are not divisible by the product "
                              f"of the other axes ({fixed})")
        sizes[wild[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(f"mesh {shown_sizes(sizes)} needs {fixed} devices but {n_devices} are available "
                          f"(the product of mesh sizes must equal the device count)")
    return MeshConfig(**sizes)


def sequence_parallel_problem(mc: MeshConfig, seq_len: int) -> str | None:
    """Why tensor.sequence_parallel=true cannot split this run's residual stream, or None."""
    if mc.tensor == 1:
        return "tensor.sequence_parallel=true needs mesh.tensor > 1 (it splits T over the tensor axis)"
    if seq_len % mc.tensor:
        return f"tensor.sequence_parallel=true needs train.seq_len={seq_len} divisible by mesh.tensor={mc.tensor}"
    return None


def min_batch_rows(mc: MeshConfig, microbatches: int) -> int:
    """The fewest rows a forward batch takes on the resolved mesh `mc`: one per data-parallel
    replica (data x fsdp) and, with a pipeline, per microbatch."""
    return mc.data * mc.fsdp * (microbatches if mc.pipe > 1 else 1)


def stages_problem(S: int, L: int) -> str | None:
    return f"mesh.pipe={S} stages exceed model.n_layer={L} layers" if S > L else None


def mesh_problem(m: ModelConfig, batch_size: int, data: int, fsdp: int, tensor: int, pipe: int,
                 grad_accum: int = 1, microbatches: int = 1) -> str | None:
    """Why sharding cannot realise this mesh for this model and batch (one line naming the
    values), or None. The one statement of the divisibility rules: `build_layout` raises it, the
    planner's mesh enumeration skips meshes it rejects."""
    if pipe > 1 and (why := stages_problem(pipe, m.n_layer)):
        return why
    if tensor > 1:
        for name, v in (("model.n_head", m.n_head), ("model.n_embd", m.n_embd),
                        ("4*model.n_embd", 4 * m.n_embd), ("model.vocab_size", m.vocab_size)):
            if v % tensor:
                return f"{name}={v} is not divisible by mesh.tensor={tensor}"
    if fsdp > 1 and m.n_embd % fsdp:
        return f"model.n_embd={m.n_embd} is not divisible by mesh.fsdp={fsdp}"
    mb = microbatches if pipe > 1 else 1
    if batch_size % (data * fsdp * grad_accum * mb):
        what = "mesh.data×mesh.fsdp×train.grad_accum" + ("×pipeline.microbatches" if mb > 1 else "")
        vals = f"{data}×{fsdp}×{grad_accum}" + (f"×{mb}" if mb > 1 else "")
        return f"train.batch_size={batch_size} is not divisible by {what}={vals}"
    return None


# ----------------------------------------------------------------------------- pipeline stages


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where every layer runs: virtual stage v = r·S + s holds `layers_per_stage[v]` layers."""

    n_stages: int  # S (mesh.pipe)
    repeats: int  # R
    layers_per_stage: tuple[int, ...]  # length S·R, in virtual-stage order
    lmax: int  # largest stage (the padded depth)
    index: np.ndarray  # (R, S, Lmax) layer id feeding each slot (pads repeat a real layer)
    valid: np.ndarray  # (R, S, Lmax) bool, False on pads

    @property
    def uniform(self) -> bool:
        return len(set(self.layers_per_stage)) == 1


def make_stage_layout(layers_per_stage, S: int, R: int) -> StageLayout:
    lps = tuple(int(v) for v in layers_per_stage)
    lmax = max(lps)
    index = np.zeros((R, S, lmax), np.int32)
    valid = np.zeros((R, S, lmax), bool)
    for v, (a, b) in enumerate(stage_bounds(lps)):
        r, s = divmod(v, S)
        n = b - a
        index[r, s, :n] = np.arange(a, b)
        index[r, s, n:] = b - 1
        valid[r, s, :n] = True
    return StageLayout(S, R, lps, lmax, index, valid)


def layer_cost(mc: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block (matmuls + attention scores), the partitioner's unit."""
    d = mc.n_embd
    return 2.0 * 12 * d * d + 4.0 * seq_len * d


def n_iterations(S: int, M: int, R: int = 1) -> int:
    """Scan iterations of the pipeline schedule: (R-1)·max(M,S) + M + S - 1 (= R·M + S - 1 when M >= S)."""
    return (R - 1) * max(M, S) + M + S - 1


def n_ticks(S: int, M: int) -> int:
    """Scan length of the 1F1B schedule (jaxpar.parallel.pipeline_1f1b): M + 2S - 2."""
    return M + 2 * S - 2


def ring_slots(S: int, M: int) -> int:
    """Saved stage inputs per device: min(M, 2S - 1)."""
    return min(M, 2 * S - 1)


def bubble_fraction(S: int, M: int, R: int = 1, schedule: str = "gpipe") -> float:
    """Idle fraction of a device's step time under `schedule`, closed form.

    Time unit: one stage's forward F on one microbatch; the input-gradient pass B and the weight-gradient
    pass W each cost F too (the split of Qi et al. 2023; 1F1B and GPipe run B and W together).
    - gpipe, circular (R chunks), 1f1b: 1 - R·M / n_iterations = (S-1)/(R·M+S-1) for M >= S.
    - interleaved (Megatron's virtual stages, R per device): (S-1)/(R·M+S-1); the fill and drain
      each cost S-1 chunk times, a chunk being 1/R of a stage.
    - zb (ZB-H1): the W passes fill the drain, so only (S-1) units of F+B-W = F stay idle per device:
      (S-1)/(3M+S-1) for M >= S.
    """
    if schedule == "zb":
        return (S - 1) / (3 * M + S - 1)
    if schedule == "interleaved":
        return (S - 1) / (R * M + S - 1)
    return 1.0 - R * M / n_iterations(S, M, R)


def one_f_one_b_problem(cfg: Config) -> str | None:
    """The line the planner refuses pipeline.schedule=1f1b with model.dropout > 0 by (its cost
    model, jaxpar.planner, covers 1f1b without dropout only), or None. `jaxpar train` runs every
    table schedule with dropout and with either pipeline.gather (jaxpar.parallel.pipeline_exec)."""
    if cfg.model.dropout > 0:
        return (f"pipeline.schedule={cfg.pipeline.schedule} does not support model.dropout={cfg.model.dropout} "
                "(use 0, or schedule=gpipe)")
    return None


def pipeline_stages(cfg: Config) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(layers per virtual stage, warnings) for cfg.pipeline on the resolved cfg.mesh (pipe > 1).
    Raises one-line ConfigErrors; the warnings are for the command to print, once."""
    pc, mc, tc = cfg.pipeline, cfg.model, cfg.train
    S, R, M, L = cfg.mesh.pipe, pc.repeats, pc.microbatches, mc.n_layer
    if R < 1:
        raise ConfigError(f"pipeline.repeats={R} must be >= 1")
    if M < 1:
        raise ConfigError(f"pipeline.microbatches={M} must be >= 1")
    if R > 1 and pc.schedule not in ("circular", "interleaved"):
        raise ConfigError(f"pipeline.repeats={R} needs pipeline.schedule=circular or interleaved (got {pc.schedule!r})")
    if pc.schedule in TABLE_SCHEDULES and (why := schedule_problem(pc.schedule, S, M, R)):
        raise ConfigError(why)
    if why := stages_problem(S, L):
        raise ConfigError(why)
    if R * S > L:
        raise ConfigError(f"pipeline.repeats×mesh.pipe={R}×{S}={R * S} exceeds model.n_layer={L} layers")
    dp = cfg.mesh.data * cfg.mesh.fsdp
    per_replica = tc.batch_size // (dp * tc.grad_accum)
    if tc.batch_size % (dp * tc.grad_accum) == 0 and per_replica % M:
        raise ConfigError(f"pipeline.microbatches={M} does not divide the per-replica batch {per_replica} "
                          f"(train.batch_size={tc.batch_size} / mesh.data×mesh.fsdp={dp} / "
                          f"train.grad_accum={tc.grad_accum})")
    if pc.layers_per_stage is not None:
        name = "mesh.pipe" if R == 1 else "mesh.pipe×pipeline.repeats"
        lps = validate_layers_per_stage(pc.layers_per_stage, L, S * R, name)
    else:
        lps = partition_layers([layer_cost(mc, tc.seq_len)] * L, S * R)
    warnings = ()
    if M < S:
        warnings = (f"warning: pipeline.microbatches={M} < mesh.pipe={S} stages: the pipeline bubble "
                    f"({bubble_fraction(S, M, R, pc.schedule):.0%} of stage time idle) will dominate",)
    return lps, warnings


# ----------------------------------------------------------------------------- the layout value


# ----------------------------------------------------------------------------- which parallel program

# The loss paths, one per parallel program (`jaxpar.train.LOSS_PATHS` maps each to its builder):
LOSS_PATHS = (
    "auto",   # the plain model under the activation rules; XLA's partitioner inserts the collectives
    "tied",   # data parallel: the tied wte gradient summed per data group first (jaxpar.parallel.tied)
    "zero3",  # ZeRO-3 in a shard_map with explicit gathers / reduce-scatters (jaxpar.parallel.fsdp)
    "gpipe",  # blocks pipelined over `pipe`, GPipe or circular schedule (jaxpar.parallel.pipeline)
    "1f1b",   # blocks pipelined over `pipe`, one-forward-one-backward (jaxpar.parallel.pipeline_exec)
    "zb",     # the same executor running ZB-H1's table (backward split into B and W)
    "interleaved",  # the same executor running Megatron's interleaved table (repeats chunks per device)
)


def zero3_applies(cfg: Config, fsdp: int, pipe: int) -> bool:
    """ZeRO-3's shard_map path runs when fsdp > 1 without a pipeline, dropout, train.remat=selective
    or train.mlp_chunks > 1 (those keep the auto-sharded step: jaxpar.parallel.fsdp's docstring)."""
    tc = cfg.train
    return (fsdp > 1 and pipe == 1 and cfg.model.dropout == 0 and Remat(tc.remat) != Remat.SELECTIVE
            and tc.mlp_chunks == 1)


def tied_groups(mc: MeshConfig) -> int:
    """Data groups of the tied-embedding reduction: mesh.data when only `data` splits the batch
    (no fsdp, no pipeline), else 1 (jaxpar.parallel.tied)."""
    return mc.data if mc.data > 1 and mc.fsdp == 1 and mc.pipe == 1 else 1


def choose_loss_path(cfg: Config, mc: MeshConfig) -> str:
    """The parallel program for this config on the resolved mesh `mc` (one of LOSS_PATHS)."""
    if mc.pipe > 1:
        return cfg.pipeline.schedule if cfg.pipeline.schedule in TABLE_SCHEDULES else "gpipe"
    if zero3_applies(cfg, mc.fsdp, mc.pipe):
        return "zero3"
    return "tied" if tied_groups(mc) > 1 else "auto"


# ----------------------------------------------------------------------------- the layout value


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Every parallelism decision for one (config, device count); see the module docstring."""

    cfg: Config  # the run's config with `mesh` resolved (sizes, no -1)
    mesh: MeshConfig  # resolved sizes, product = device count (= cfg.mesh)
    group_param_rules: dict[str, Rules]  # OSDP group -> parameter rules (incl. layers -> pipe)
    activation_rules: Rules  # outside the pipelined loop (the whole model when pipe == 1)
    pipeline_rules: Rules  # inside a shard_map manual over the batch axes (pipeline, ZeRO-3): auto axes only
    batch_axes: tuple[str, ...]  # (B, T) token arrays: rows over these
    manual_axes: tuple[str, ...]  # the pipeline's shard_map is manual over these
    stages: StageLayout | None  # the pipeline's layer placement; None when mesh.pipe == 1
    loss_path: str = "auto"  # which parallel program computes the loss (LOSS_PATHS)
    warnings: tuple[str, ...] = ()  # printed once by the command (e.g. a dominant bubble)

    @property
    def pipelined(self) -> bool:
        return self.stages is not None

    @property
    def tied_groups(self) -> int:
        """G of the tied-embedding reduction (1: not grouped)."""
        return tied_groups(self.mesh) if self.loss_path == "tied" else 1

    def rules_for(self, path: str) -> Rules:
        """Parameter rules of a dotted parameter path ("h.attn.c_attn.weight")."""
        return self.group_param_rules[group_of(path)]

    def block_rules(self) -> dict[str, Rules]:
        """Parameter rules per top-level block key (ln_1, attn, ln_2, mlp) of gpt2.BLOCK_AXES."""
        return {k: self.group_param_rules[g] for k, g in BLOCK_GROUPS.items()}

    def param_specs(self, axes_tree) -> Any:
        """Tree of logical-axes tuples (gpt2.param_axes) -> tree of PartitionSpec (imports JAX)."""
        import jax

        from jaxpar.parallel.logical import spec_for

        def one(path, a):
            return spec_for(a, self.rules_for(".".join(k.key for k in path)))

        return jax.tree_util.tree_map_with_path(one, axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def build_layout(cfg: Config, n_devices: int) -> ParallelLayout:
    """Resolve cfg.mesh against `n_devices` and every rule the config implies; validate once.
    Raises one-line ConfigErrors (bad mesh sizes, product != device count, pipeline settings,
    divisibility). cfg is an already `config.validate`-d config. The one place mesh sizes are
    resolved for a run: the mesh (`jaxpar.parallel.mesh.build_mesh(layout)`), the step, eval and
    inspect all read the result."""
    mc = resolve_mesh_config(cfg.mesh, n_devices)
    cfg = dataclasses.replace(cfg, mesh=mc)
    m, tc = cfg.model, cfg.train
    stages, warnings = None, ()
    if mc.pipe > 1:  # stages vs layers, layers_per_stage, microbatches, repeats
        lps, warnings = pipeline_stages(cfg)
        stages = make_stage_layout(lps, mc.pipe, cfg.pipeline.repeats)
    why = mesh_problem(m, tc.batch_size, mc.data, mc.fsdp, mc.tensor, mc.pipe, tc.grad_accum,
                       cfg.pipeline.microbatches)
    if why:
        raise ConfigError(why)
    groups = {g: param_rules(mc, g in cfg.sharding.replicate, m.n_layer) for g in GROUPS}
    act, inner = dict(ACTIVATION_RULES), dict(PIPELINE_INNER_RULES)
    if cfg.tensor.sequence_parallel:
        if why := sequence_parallel_problem(mc, tc.seq_len):
            raise ConfigError(why)
        act.update(SEQUENCE_PARALLEL_RULES)
        inner.update(SEQUENCE_PARALLEL_RULES)
    if mc.pipe > 1 and (tc.batch_size // tc.grad_accum) % (mc.data * mc.fsdp * mc.pipe) == 0:
        # outside the pipelined loop the batch is also split over pipe when it divides, so the
        # embedding and head are spread over the pipe ranks rather than repeated on each
        act["batch"] = (*BATCH_AXES, "pipe")
    return ParallelLayout(cfg, mc, groups, act, inner, BATCH_AXES, PIPELINE_MANUAL_AXES,
                          stages, choose_loss_path(cfg, mc), warnings)
