"""Optimizer, the jit-compiled sharded train step, and the training loop.

State is a plain dict {"step", "params", "opt_state"}; params are fp32 master weights.
The step is compiled once with explicit in/out shardings derived from the rules tables
(`jaxpar.parallel.sharding`) via `eval_shape`, and the state is donated. Gradients are fp32 (they
are gradients of fp32 params), so their reduction over data/fsdp is fp32 in bf16 mode too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar import optim
from jaxpar.config import Config, ConfigError, ModelConfig, TrainConfig
from jaxpar.models import gpt2
from jaxpar.models.attention_choice import Accelerator, cudnn_refusal, current_accelerator
from jaxpar.models.precision import get_policy
from jaxpar.parallel import sharding as shd
from jaxpar.parallel import tied
from jaxpar.parallel.layout import ParallelLayout, build_layout
from jaxpar.parallel.logical import activation_rules
from jaxpar.parallel.mesh import build_mesh, mesh_size

State = dict[str, Any]


# ----------------------------------------------------------------------------- optimizer


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """lr of 0-based update `count`: linear warmup lr*(count+1)/(W+1) for count < W, W = min(warmup_steps,
    steps), then cosine from lr to lr*min_lr_ratio at `steps`.

    The +1s are nanoGPT's and torchtitan's: the first update already moves the weights (a warmup from
    exactly 0 made update 1 a no-op, so `train.steps=1` trained nothing)."""
    warmup = min(tc.warmup_steps, tc.steps)
    decay = optax.cosine_decay_schedule(tc.lr, max(tc.steps - warmup, 1), alpha=tc.min_lr_ratio)
    if warmup == 0:
        return decay

    def schedule(count):
        return jnp.where(count < warmup, tc.lr * (count + 1) / (warmup + 1), decay(count - warmup))

    return schedule


def decay_mask(params) -> Any:
    """GPT-2 practice: decay the matmul weights only; not biases, LayerNorm or embeddings."""

    def keep(path, _):
        name = jax.tree_util.keystr(path)
        return name.endswith("['weight']") and "ln_" not in name and "wte" not in name and "wpe" not in name

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """global-norm clip (no epsilon) -> AdamW with bias correction and masked decay."""
    adamw = optax.adamw(lr_schedule(tc), b1=tc.beta1, b2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw) if tc.grad_clip > 0 else adamw


# ----------------------------------------------------------------------------- step


@dataclasses.dataclass
class Trainer:
    """Everything compiled for one (config, mesh): shardings, init and step functions."""

    cfg: Config
    layout: ParallelLayout
    mesh: Any
    tx: optax.GradientTransformation
    state_shardings: Any
    batch_sharding: NamedSharding
    step_fn: Callable  # (state, inputs, targets) -> (state, metrics)
    eval_fn: Callable  # (params, inputs, targets) -> (B,) summed token NLL per row (jaxpar.run.evaluation)
    schedule: optax.Schedule  # learning rate at step count
    # (state, inputs, targets, stop (n_devices,) int32) -> (state, metrics + "stop"): the loop's step
    loop_step_fn: Callable = None
    flag_sharding: NamedSharding = None  # one element per device, over every mesh axis

    def init_state(self, params) -> State:
        """Place (numpy) params on the mesh and build the optimizer state there."""
        params = jax.device_put(params, self.state_shardings["params"])
        opt_init = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt_state"])
        step = jax.device_put(jnp.zeros((), jnp.int32), self.state_shardings["step"])
        return {"step": step, "params": params, "opt_state": opt_init(params)}

    def abstract_state(self) -> State:
        """ShapeDtypeStructs with shardings (for checkpoint restore)."""
        shapes = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                                           "opt_state": self.tx.init(p)},
                                gpt2.abstract_params(self.cfg.model))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def put_batch(self, x: np.ndarray) -> jax.Array:
        """A global (B, T) batch from this process's rows (the whole batch when single-process)."""
        return shd.put_global_batch(x, self.batch_sharding)

    def put_flag(self, flag: bool) -> jax.Array:
        """This process's stop flag on each of its devices, as one global (n_devices,) int32 array.
        The loop step takes its max, so every process learns of a signal to any one of them from
        the step's own collective, with no extra host round trip."""
        n = self.flag_sharding.mesh.devices.size
        return jax.make_array_from_callback((n,), self.flag_sharding,
                                            lambda idx: np.full((len(range(n)[idx[0]]),), int(flag), np.int32))


def _auto_loss(cfg: Config, mesh, lay: ParallelLayout) -> Callable:
    """The plain model under the layout's activation rules; XLA's partitioner adds the collectives.
    With tied groups the batch split moves to the vmapped group dim (jaxpar.parallel.tied)."""
    policy, mc = get_policy(cfg.precision), cfg.model
    groups = lay.tied_groups
    rules = lay.activation_rules if groups == 1 else {**lay.activation_rules, "batch": None}
    # the model's structure and options, built once; each traced call merges its weights in
    graphdef = nnx.graphdef(gpt2.GPT2(mc, policy=policy, remat=cfg.train.remat, vocab_chunks=cfg.train.vocab_chunks,
                                      mlp_chunks=cfg.train.mlp_chunks))

    def loss(params, inputs, targets, key):
        with activation_rules(mesh, rules):
            return nnx.merge(graphdef, params).loss(inputs, targets, key)

    if groups == 1:
        return loss
    # data parallel: the tied wte gradient (lookup + head) is summed before its one reduction
    wte_spec = lay.param_specs(gpt2.param_axes(mc))["wte"]["weight"]
    return tied.grouped_loss(loss, mesh, groups, wte_spec)


def _zero3_loss(cfg: Config, mesh, lay: ParallelLayout) -> Callable:
    from jaxpar.parallel import fsdp

    return fsdp.make_fsdp_loss_fn(cfg, mesh, lay)


def _gpipe_loss(cfg: Config, mesh, lay: ParallelLayout) -> Callable:
    from jaxpar.parallel.pipeline import make_pipeline_loss_fn

    return make_pipeline_loss_fn(cfg, lay, mesh)


def _one_f_one_b_loss(cfg: Config, mesh, lay: ParallelLayout) -> Callable:
    from jaxpar.parallel.pipeline_1f1b import make_schedule_loss_fn

    return make_schedule_loss_fn(cfg, lay, mesh)


# layout.loss_path -> builder (cfg, mesh, layout) -> loss: the one place a parallel program is picked
LOSS_PATHS: dict[str, Callable] = {"auto": _auto_loss, "tied": _auto_loss, "zero3": _zero3_loss,
                                   "gpipe": _gpipe_loss, "1f1b": _one_f_one_b_loss,
                                   "zb": _one_f_one_b_loss, "interleaved": _one_f_one_b_loss}


def make_loss_fn(layout: ParallelLayout, mesh) -> Callable:
    """(params, inputs (B,T), targets (B,T), key|None) -> mean fp32 loss: the program
    `layout.loss_path` names, for the layout's config on `mesh` (built from the same layout)."""
    return LOSS_PATHS[layout.loss_path](layout.cfg, mesh, layout)


def build_trainer(layout: ParallelLayout, mesh=None, devices=None) -> Trainer:
    """Compile-ready trainer for the run's resolved `layout` (`build_layout`, or `resolve_layout`
    with the backend check) on `mesh` (if None, built from the layout over `devices`, default all)."""
    from jaxpar.run.evaluation import make_nll_fn

    lay, cfg = layout, layout.cfg
    mesh = build_mesh(lay, devices) if mesh is None else mesh
    tc = cfg.train
    tx = make_optimizer(tc)
    update = optim.make_update(tc, lr_schedule(tc), decay_mask)  # tx's step in one pass per leaf
    # per-group OSDP (groups in sharding.replicate stay whole over fsdp) and layers -> pipe: the layout's rules
    param_specs = lay.param_specs(gpt2.param_axes(cfg.model))
    abstract = gpt2.abstract_params(cfg.model)
    opt_specs = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, abstract), param_specs,
                                      transform_non_params=lambda _: PartitionSpec(),
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    specs = {"step": PartitionSpec(), "params": param_specs, "opt_state": opt_specs}
    state_sh = shd.named(mesh, specs)
    batch_sh = NamedSharding(mesh, shd.batch_spec(lay.batch_axes))
    loss_fn = make_loss_fn(lay, mesh)
    grad_fn = jax.value_and_grad(loss_fn)
    accum = tc.grad_accum
    use_dropout = cfg.model.dropout > 0

    def train_step(state, inputs, targets):
        key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), state["step"]) if use_dropout else None
        if accum == 1:
            loss, grads = grad_fn(state["params"], inputs, targets, key)
        else:
            # (B, T) -> (A, B/A, T) taking every A-th row, so each microbatch spans all data shards.
            B, T = inputs.shape
            split = lambda a: a.reshape(B // accum, accum, T).swapaxes(0, 1)  # noqa: E731
            xs, ys = split(inputs), split(targets)
            mb_spec = NamedSharding(mesh, PartitionSpec(None, *shd.batch_spec(lay.batch_axes)))
            xs, ys = jax.lax.with_sharding_constraint((xs, ys), mb_spec)

            def body(carry, mb):
                loss_sum, g_sum = carry
                i, x, y = mb
                k = None if key is None else jax.random.fold_in(key, i)
                loss_mb, g = grad_fn(state["params"], x, y, k)
                return (loss_sum + loss_mb, jax.tree.map(jnp.add, g_sum, g)), None

            zeros = jax.tree.map(jnp.zeros_like, state["params"])
            (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (jnp.arange(accum), xs, ys))
            loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
        grad_norm = optax.tree.norm(grads)  # optax.global_norm is deprecated
        # A non-finite loss or gradient norm is never applied: the old params and optimizer state
        # are kept, so no checkpoint can hold non-finite values even when the loop reads this flag
        # a step late (a weight whose own update overflows keeps its old value: jaxpar.optim). The
        # step counter (dropout key) advances either way; the loop stops or skips on `finite` == False.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = update(grads, grad_norm, state["opt_state"], state["params"], finite)
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return new, {"loss": loss, "grad_norm": grad_norm, "finite": finite}

    def loop_step(state, inputs, targets, stop):
        # stop: (n_devices,) int32, each process's signal flag on its devices; the max is an
        # all-reduce inside the step, so all processes see the same value for the same step.
        new, m = train_step(state, inputs, targets)
        return new, {**m, "stop": jnp.max(stop) > 0}

    repl = NamedSharding(mesh, PartitionSpec())
    metrics_sh = {"loss": repl, "grad_norm": repl, "finite": repl}
    step_fn = jax.jit(train_step, in_shardings=(state_sh, batch_sh, batch_sh),
                      out_shardings=(state_sh, metrics_sh), donate_argnums=0)
    flag_sh = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    loop_step_fn = jax.jit(loop_step, in_shardings=(state_sh, batch_sh, batch_sh, flag_sh),
                           out_shardings=(state_sh, {**metrics_sh, "stop": repl}), donate_argnums=0)
    eval_fn = make_nll_fn(cfg, lay, mesh, state_sh["params"], batch_sh)
    return Trainer(cfg, lay, mesh, tx, state_sh, batch_sh, step_fn, eval_fn, lr_schedule(tc), loop_step_fn, flag_sh)


# ----------------------------------------------------------------------------- metrics: FLOPs and peaks

def device_peak_flops(cfg: Config) -> float | None:
    """Per-device peak for MFU: `device_peak_flops` if set, else the planner's device table (dense
    bf16, or the non-tensor-core fp32 figure), else None: no MFU is claimed against a peak the
    program does not know. A CPU has no datasheet peak, and a timed matmul is not its peak: MFU
    against one read near or above 100%."""
    from jaxpar.planner.devices import spec_for_device_kind

    if cfg.device_peak_flops > 0:
        return cfg.device_peak_flops
    spec = spec_for_device_kind(jax.devices()[0].device_kind)
    if spec is not None:
        return spec.peak_flops if cfg.precision == "bf16" else spec.peak_flops_fp32
    return None


def resolve_layout(cfg: Config, n_devices: int) -> ParallelLayout:
    """The run's ParallelLayout for `n_devices`, after the one check that needs the backend; every
    mesh, divisibility and pipeline rule is `jaxpar.parallel.layout.build_layout`'s."""
    check_attention(cfg)
    return build_layout(cfg, n_devices)


def check_attention(cfg: Config, accelerator: Accelerator | None = None) -> None:
    """model.attention=cudnn on a model, precision or backend cuDNN flash attention refuses: one
    ConfigError naming the keys, before anything is traced (jax would raise mid-trace).
    `accelerator`: the default backend's facts unless given."""
    mc = cfg.model
    if mc.attention != "cudnn":
        return
    acc = current_accelerator() if accelerator is None else accelerator
    dtype = jnp.dtype(get_policy(cfg.precision).compute_dtype).name
    why = cudnn_refusal(acc, mc.head_dim, dtype, mc.dropout)
    if why is None:
        return
    keys = {"head_dim": f" (model.n_embd={mc.n_embd} / model.n_head={mc.n_head})",
            "dtype": f" (precision={cfg.precision})"}.get(why.what, "")
    raise ConfigError(f"model.attention=cudnn {why.text}{keys}; use model.attention=auto or xla")


def check_model_vs_mesh(mc: ModelConfig, cfg: Config) -> ParallelLayout:
    """`resolve_layout` for a config whose mesh is already resolved (sizes, no -1)."""
    return resolve_layout(dataclasses.replace(cfg, model=mc), mesh_size(cfg.mesh))
