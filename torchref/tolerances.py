"""torchref's bounds, re-exported from the project's one tolerance table, `jaxpar/tolerances.py`
(measured values and derivations are there). Kept so existing imports keep working; new code
imports `jaxpar.tolerances` directly. Like that module, imports neither jax nor torch."""

from jaxpar.tolerances import (  # noqa: F401
    BF16_U,
    GRAD_NORM_RTOL_AMP,
    GRAD_TOL_FP32,
    LOSS_RTOL_AMP,
    LOSS_RTOL_FP16_WIRE,
    LOSS_RTOL_FP32,
)
