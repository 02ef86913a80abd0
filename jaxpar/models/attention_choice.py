"""Where cuDNN flash attention runs: a pure rule over the facts its checks read.

`jax.nn.dot_product_attention(implementation="cudnn")` raises at trace time on shapes and dtypes
cuDNN does not take (`jax._src.cudnn.fused_attention_stablehlo.check_layout` and
`check_is_flash_attention`), so `model.attention=auto` must ask first and keep jaxpar's einsum core
where the answer is no, and `model.attention=cudnn` must refuse such a model before any compile.
`cudnn_refusal` is that question as a pure function of the accelerator's facts (`Accelerator`),
the head dim, the compute dtype and the dropout rate; `current_accelerator` reads the facts once.

The rules, for a causal mask without bias or padding (the only form jaxpar calls):
  * a CUDA GPU backend: jax reads the compute capability only where the backend's platform
    version names CUDA (on ROCm it takes the pre-Hopper limits);
  * compute capability 8.0 or newer: cuDNN's SDPA support matrix starts at Ampere (jax does not
    check it; cuDNN then fails when XLA compiles the call);
  * compute capability 10.3 needs cuDNN 9.11 or newer (jax's check);
  * q, k and v in fp16 or bf16 (jax also takes fp8, which jaxpar never computes in);
  * head dim a multiple of 8 and at most 256 from compute capability 9.0 (Hopper), 128 before;
  * no attention dropout: jax.nn.dot_product_attention has none (jaxpar's own rule).
tests/models/test_attention_choice.py holds this rule equal to the installed jax's own checks
over a grid of head dims, dtypes and compute capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    """What cuDNN's checks depend on. `platform`: jax's default backend ("cpu", "gpu", "tpu").
    `cuda`: the GPU backend is CUDA's. `compute_capability`: (major, minor), None off CUDA.
    `cudnn_version`: cuDNN's integer version (9.11.0 -> 91100), None where unknown."""

    platform: str
    cuda: bool = False
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None


@dataclass(frozen=True)
class Refusal:
    """Why cuDNN flash attention does not apply. `what`: the fact at fault (platform, cuda,
    capability, cudnn_version, dtype, dropout, head_dim); `text`: the reason, phrased to follow
    "model.attention=cudnn "."""

    what: str
    text: str


CUDNN_DTYPES = ("bfloat16", "float16")
MIN_CAPABILITY = (8, 0)  # cuDNN SDPA: Ampere or newer
HOPPER = (9, 0)  # head dim up to 256 from here, 128 before


def max_head_dim(acc: Accelerator) -> int:
    """jax's H_max: 256 on a CUDA GPU of compute capability 9.0 or newer, else 128."""
    return 256 if acc.cuda and acc.compute_capability is not None and acc.compute_capability >= HOPPER else 128


def _capability(cc: tuple[int, int] | None) -> str:
    return "unknown" if cc is None else f"{cc[0]}.{cc[1]}"


def cudnn_refusal(acc: Accelerator, head_dim: int, dtype: str, dropout: float) -> Refusal | None:
    """None where cuDNN flash attention takes a causal (B, T, N, head_dim) q/k/v of `dtype`
    (a numpy dtype name: "bfloat16", "float32", ...) with attention dropout `dropout`; else the
    first rule it breaks, in the order of the module docstring."""
    if acc.platform != "gpu":
        return Refusal("platform", f"needs a GPU (this backend: {acc.platform})")
    if not acc.cuda:
        return Refusal("cuda", "needs an NVIDIA GPU with CUDA (this GPU backend is not CUDA)")
    cc = acc.compute_capability
    if cc is None or cc < MIN_CAPABILITY:
        return Refusal("capability", f"needs compute capability 8.0 or newer (this GPU: {_capability(cc)})")
    if cc == (10, 3) and (acc.cudnn_version is None or acc.cudnn_version < 91100):
        return Refusal("cudnn_version", f"needs cuDNN 9.11 or newer on compute capability 10.3 "
                                        f"(this cuDNN: {acc.cudnn_version or 'unknown'})")
    if dtype not in CUDNN_DTYPES:
        return Refusal("dtype", f"needs bf16 or fp16 operands (compute dtype: {dtype})")
    if dropout > 0:
        return Refusal("dropout", f"has no attention dropout (model.dropout={dropout})")
    hmax = max_head_dim(acc)
    if head_dim % 8 or head_dim > hmax:
        return Refusal("head_dim", f"refuses head dim {head_dim}: cuDNN flash attention takes a multiple of 8, "
                                   f"at most {hmax} on compute capability {_capability(cc)}")
    return None


def cudnn_accepts(acc: Accelerator, head_dim: int, dtype: str, dropout: float) -> bool:
    return cudnn_refusal(acc, head_dim, dtype, dropout) is None


def current_accelerator() -> Accelerator:
    """The facts of jax's default backend (initialises it). The cuDNN version is read only on
    compute capability 10.3, the one place a rule needs it."""
    import jax

    platform = jax.default_backend()
    if platform != "gpu":
        return Accelerator(platform)
    d = jax.devices()[0]
    cuda = "cuda" in getattr(d.client, "platform_version", "").lower()
    cc_text = getattr(d, "compute_capability", None) if cuda else None
    cc = tuple(int(x) for x in str(cc_text).split(".")[:2]) if cc_text else None
    cudnn = None
    if cc == (10, 3):
        try:
            from jax._src.lib import cuda_versions  # jax's own check reads the version here

            cudnn = int(cuda_versions.cudnn_get_version()) if cuda_versions is not None else None
        except (ImportError, AttributeError, RuntimeError):
            cudnn = None  # unknown: the 10.3 rule then refuses, as an old cuDNN would
    return Accelerator(platform, cuda, cc, cudnn)  # type: ignore[arg-type]
