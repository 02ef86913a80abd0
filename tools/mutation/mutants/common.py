"""What every mutant module shares: the Mutant record and test-path names.

The mutants: small real bugs, each a string replacement that must match exactly once.

A mutant names its file, the exact original snippet, the mutated snippet, why it is a real bug,
and the tests most likely to catch it (run first, so a caught mutant costs one small pytest
run). When the code moves on and a snippet no longer matches exactly once, the runner reports the
mutant STALE instead of silently passing it: update the snippet, do not delete the mutant.

One module per wing of the code a mutant breaks (tools/mutation/mutants/<wing>.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    file: str
    original: str
    mutated: str
    why: str
    tests: tuple[str, ...] = ()


T = "tests/"
P = "parity_tests/"
PARITY_MODEL = P + "test_model_parity.py"
PARITY_TRAIN = P + "test_training_parity.py"
EQUIV = T + "parallel/test_sharding_equivalence.py"
TR_STRAT = T + "torchref/test_torchref_strategies.py"
CLAIMS = T + "run/test_claims_run.py"  # dropout, SIGINT resume, val_loss, progress bar
RESUME = T + "run/test_train_cli.py::test_sigterm_then_resume_is_bit_identical"
SIGKILL = T + "run/test_train_cli.py::test_sigkill_resumes_from_last_complete_checkpoint"
TRAIN100 = T + "run/test_train_cli.py::test_loss_falls_30_percent_in_100_steps"
SAMPLE = T + "run/test_train_cli.py::test_sample_is_deterministic"
PROPS = T + "test_properties_data_config.py"
PROPS_PLAN = T + "planner/test_properties_planner.py"
PROPS_OPTIM = T + "test_properties_optim.py"
PROPS_NUM = T + "models/test_properties_numerics.py"
