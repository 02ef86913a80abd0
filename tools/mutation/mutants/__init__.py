"""The mutants, one module per wing of the code they break; EQUIVALENT: the ones that cannot
change an observable result."""

from dataclasses import dataclass

from tools.mutation.mutants import gpt2common as _gpt2common
from tools.mutation.mutants import habits as _habits
from tools.mutation.mutants import jaxpar_root as _jaxpar_root
from tools.mutation.mutants import models as _models
from tools.mutation.mutants import parallel as _parallel
from tools.mutation.mutants import parity_tests as _parity_tests
from tools.mutation.mutants import planner as _planner
from tools.mutation.mutants import run as _run
from tools.mutation.mutants import scripts as _scripts
from tools.mutation.mutants import torchref as _torchref
from tools.mutation.mutants.common import Mutant

MUTANTS: list[Mutant] = [*_gpt2common.MUTANTS, *_jaxpar_root.MUTANTS, *_models.MUTANTS, *_parallel.MUTANTS,
                          *_parity_tests.MUTANTS, *_habits.MUTANTS, *_planner.MUTANTS, *_run.MUTANTS, *_scripts.MUTANTS, *_torchref.MUTANTS]


@dataclass(frozen=True)
class Equivalent:
    file: str
    original: str
    mutated: str
    why: str


# Mutants written, found unable to change any observable result, and removed (kept here so they are not written again).
EQUIVALENT: list[Equivalent] = [
    Equivalent("jaxpar/train.py", "a.reshape(B // accum, accum, T).swapaxes(0, 1)", "a.reshape(accum, B // accum, T)",
               "grad accumulation averages over all micro-batches, so which rows form a micro-batch does not change "
               "the mean loss or gradient (only the sharding of each micro-batch, which the constraint right after "
               "fixes)"),
    Equivalent("torchref/model.py", "logits.float().reshape(", "logits.reshape(",
               "F.cross_entropy is on autocast's fp32 list, so bf16 logits are upcast inside it anyway; outside "
               "autocast the logits are already fp32"),
    Equivalent("torchref/model.py", "g.div_(norm).mul_(max_norm)", "g.div_(norm + 1e-6).mul_(max_norm)",
               "torch's clip_grad_norm_ epsilon scales all gradients of a step by one factor 1 - 1e-6/norm; AdamW's "
               "m/sqrt(v) is invariant to a uniform scale, so only the step-to-step differences of that factor "
               "(~1e-6 x |1/n_t - 1/n_s| ~ 1e-7) reach the update: fp32 noise (U_FP32 = 6e-8), below every bound"),
    Equivalent("torchref/strategies/horovod_amp.py", "amp = True", "amp = False",
               "the Strategy.amp class attribute is read by nothing (autocast follows RefConfig.is_amp, i.e. the "
               "strategy name); same for distributed_ps_amp.py. The mutants now flip is_amp instead"),
    Equivalent("jaxpar/parallel/pipeline.py", "(il // Mp < R - 1)", "(il // Mp < R)",
               "the buffer slot written for the last repeat is never read (no repeat R follows)"),
    Equivalent("jaxpar/train.py", "jnp.where(count < warmup,", "jnp.where(count <= warmup,",
               "update W then takes the warmup's lr*(W+1)/(W+1) instead of the cosine's decay(0) = lr: the same value "
               "up to one fp32 rounding (1 ulp of lr for 1218 of 15992 (lr, W) pairs checked, lr in 1e-4..3e-2, "
               "W < 2000)"),
    Equivalent("jaxpar/models/mixed_attention.py", "b = max(_BLOCK, -(-T // _MAX_BLOCKS))", "b = max(_BLOCK, T // _MAX_BLOCKS)",
               "floor(T/8) and ceil(T/8) rows give different block counts only where one of them divides T with "
               "T >= 2b, which needs T = 8b, where they agree (checked T = 1..200000)"),
    Equivalent("jaxpar/planner/plan.py", 'if s.repeats == 1 and d.get("layers_per_stage"):',
               'if False and d.get("layers_per_stage"):',
               "plan_to_overrides leaves pipeline.layers_per_stage out: jaxpar train then partitions the layers itself, "
               "and the planner's split (cost._pipeline_split) is that same uniform-cost partition_layers call (unit cost 1.0 "
               "vs layout.layer_cost, an integer-valued float: both prefix sums are exact multiples), so the stages are "
               "the same; test_properties_planner's drawn plans pass with it"),
    Equivalent("jaxpar/run/inspection.py", "{_mib(mem['outputs'])}, aliased {_mib(mem['aliased'])}",
               "{_mib(mem['aliased'])}, aliased {_mib(mem['outputs'])}",
               "the report prints MiB to 2 decimals, and a train step's outputs are its donated (aliased) state plus "
               "a few scalars: both print the same figure (the JSON line keeps them apart)"),
    Equivalent("examples/08_shard_your_own_model.py", "for a, b in zip(losses, losses1))",
               "for a, b in zip(losses, losses))",
               "the example's printed loss diff, self-compared, prints 0.00e+00: so does the real one, the 3 "
               "sharded losses being bitwise equal to the one-device ones on the AMD Zen 4 host; "
               "test_example_08_prints_the_diffs_of_the_runs_it_saved compares the printed diff with the saved "
               "runs', so a host where they differ catches it"),
]
