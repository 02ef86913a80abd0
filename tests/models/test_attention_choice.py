"""model.attention: cuDNN flash attention only where cuDNN takes the shape (jaxpar.models.attention_choice),
checked on CPU against the installed jax's own cuDNN checks, and `model.attention=cudnn` refused up front."""

import dataclasses
import inspect
import itertools

import jax
import numpy as np
import pytest

from jaxpar import cli
from jaxpar.config import ConfigError, resolve
from jaxpar.models import attention_choice as AC
from jaxpar.models import gpt2
from jaxpar.models.precision import get_policy
from jaxpar.train import check_attention

H100 = AC.Accelerator("gpu", True, (9, 0), 91000)
A100 = AC.Accelerator("gpu", True, (8, 0), 91000)
CAPABILITIES = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]
DTYPES = ["bfloat16", "float16", "float32"]


def _jax_accepts(monkeypatch, cc, cudnn_version, head_dim, dtype) -> bool:
    """The installed jax's own verdict on a causal BTNH q/k/v of (1, 4, 2, head_dim): its layout
    check, then its flash-attention check for inference and for training, with the compute
    capability those checks read from the backend replaced by `cc` (they are the only backend reads)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def at_least(cap):
        return cc >= tuple(int(x) for x in cap.split("."))

    def equal(cap):
        return cc == tuple(int(x) for x in cap.split("."))

    monkeypatch.setattr(fa, "check_compute_capability", at_least)
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", equal, raising=False)
    q = jax.ShapeDtypeStruct((1, 4, 2, head_dim), np.dtype(jax.numpy.dtype(dtype)))
    layout = fa.AttentionLayout.BTNH
    given = {"query": q, "key": q, "value": q, "layout": layout.value, "cudnn_version": cudnn_version,
             "has_bias": False}
    params = inspect.signature(fa.check_is_flash_attention).parameters
    try:
        fa.check_layout(q, q, q, *([None] * (len(inspect.signature(fa.check_layout).parameters) - 4)), layout)
        for training in (False, True):
            fa.check_is_flash_attention(**{k: v for k, v in given.items() if k in params}, is_training=training)
    except (NotImplementedError, ValueError, RuntimeError):
        return False
    return True


def test_rule_equals_the_installed_jax_checks_over_a_grid(monkeypatch):
    """Every head dim 1..300, three dtypes, nine compute capabilities, two cuDNN versions: where jax
    has a verdict (compute capability 8.0 and up) ours is the same; below 8.0 (cuDNN's SDPA support
    starts at Ampere, which jax leaves to cuDNN's compile) ours refuses on the capability."""
    disagree, accepted = [], 0
    for cc, ver, dtype in itertools.product(CAPABILITIES, (90800, 91100), DTYPES):
        acc = AC.Accelerator("gpu", True, cc, ver)
        for hd in range(1, 301):
            ours = AC.cudnn_refusal(acc, hd, dtype, 0.0)
            if cc < (8, 0):
                assert ours is not None and ours.what == "capability"
                continue
            theirs = _jax_accepts(monkeypatch, cc, ver, hd, dtype)
            accepted += theirs
            if (ours is None) != theirs:
                disagree.append((cc, ver, dtype, hd, ours))
    assert disagree == []
    # 128/8 head dims before Hopper, 256/8 from it, bf16 and fp16, both cuDNN versions except 10.3 + 9.8
    assert accepted == 2 * 2 * (16 * 3 + 32 * 3) + 2 * 32


@pytest.mark.parametrize("acc, head_dim, dtype, dropout, what", [
    (AC.Accelerator("cpu"), 64, "bfloat16", 0.0, "platform"),
    (AC.Accelerator("gpu", False), 64, "bfloat16", 0.0, "cuda"),  # ROCm
    (AC.Accelerator("gpu", True, (7, 5), 91000), 64, "bfloat16", 0.0, "capability"),
    (AC.Accelerator("gpu", True, (10, 3), 91000), 64, "bfloat16", 0.0, "cudnn_version"),
    (AC.Accelerator("gpu", True, (10, 3), 91100), 64, "bfloat16", 0.0, None),
    (H100, 64, "float32", 0.0, "dtype"),
    (H100, 64, "bfloat16", 0.1, "dropout"),
    (H100, 12, "bfloat16", 0.0, "head_dim"),  # n_embd 96 / n_head 8
    (H100, 264, "bfloat16", 0.0, "head_dim"),
    (H100, 256, "float16", 0.0, None),
    (A100, 256, "bfloat16", 0.0, "head_dim"),  # 128 before Hopper
    (A100, 128, "bfloat16", 0.0, None),
    (H100, 64, "bfloat16", 0.0, None),  # every GPT-2 preset: head dim 64
])
def test_refusal_names_the_fact_at_fault(acc, head_dim, dtype, dropout, what):
    r = AC.cudnn_refusal(acc, head_dim, dtype, dropout)
    assert (None if r is None else r.what) == what
    assert AC.cudnn_accepts(acc, head_dim, dtype, dropout) is (what is None)


@pytest.mark.parametrize("n_embd, n_head, precision, dropout, impl", [
    (768, 12, "bf16", 0.0, "cudnn"),  # gpt2: head dim 64
    (96, 8, "bf16", 0.0, "einsum"),  # head dim 12: cuDNN would raise at trace time
    (600, 2, "bf16", 0.0, "einsum"),  # head dim 300 > 256
    (768, 12, "fp32", 0.0, "einsum"),
    (768, 12, "bf16", 0.1, "einsum"),
])
def test_auto_takes_cudnn_only_where_it_accepts(n_embd, n_head, precision, dropout, impl):
    assert gpt2.attention_impl("auto", get_policy(precision), dropout, n_embd // n_head, H100) == impl
    assert gpt2.attention_impl("xla", get_policy(precision), dropout, n_embd // n_head, H100) == "xla"


def test_auto_reads_the_default_backend(monkeypatch):
    """No accelerator given: the backend's own facts (here CPU: the einsum core), read through
    current_accelerator; a reported H100 there turns auto into cuDNN for head dim 64 only."""
    assert AC.current_accelerator() == AC.Accelerator("cpu")
    assert gpt2.attention_impl("auto", get_policy("bf16"), 0.0, 64) == "einsum"
    monkeypatch.setattr(gpt2, "current_accelerator", lambda: H100)
    assert [gpt2.attention_impl("auto", get_policy("bf16"), 0.0, hd) for hd in (64, 12)] == ["cudnn", "einsum"]


@pytest.mark.parametrize("args, acc, msg", [
    (["model.n_embd=96", "model.n_head=8", "precision=bf16"], H100,
     "model.attention=cudnn refuses head dim 12: cuDNN flash attention takes a multiple of 8, at most 256 on "
     "compute capability 9.0 (model.n_embd=96 / model.n_head=8); use model.attention=auto or xla"),
    (["model.n_embd=512", "model.n_head=2", "precision=bf16"], A100,
     "model.attention=cudnn refuses head dim 256: cuDNN flash attention takes a multiple of 8, at most 128 on "
     "compute capability 8.0 (model.n_embd=512 / model.n_head=2); use model.attention=auto or xla"),
    (["precision=fp32"], H100,
     "model.attention=cudnn needs bf16 or fp16 operands (compute dtype: float32) (precision=fp32); "
     "use model.attention=auto or xla"),
    (["precision=bf16"], AC.Accelerator("gpu", True, (7, 0)),
     "model.attention=cudnn needs compute capability 8.0 or newer (this GPU: 7.0); use model.attention=auto or xla"),
])
def test_cudnn_refused_where_cudnn_would_raise(args, acc, msg):
    cfg = resolve(["model=gpt2-tiny", "model.attention=cudnn", *args])
    with pytest.raises(ConfigError) as e:
        check_attention(cfg, acc)
    assert str(e.value) == msg
    ok = dataclasses.replace(cfg, precision="bf16", model=dataclasses.replace(cfg.model, n_embd=128, n_head=2))
    check_attention(ok, H100)  # head dim 64 in bf16 on an H100: accepted


def test_cli_cudnn_with_a_refused_head_dim_is_one_error_line(monkeypatch, capsys, tmp_path):
    """`jaxpar train model.attention=cudnn` on a GPU that cannot take head dim 12: exit 2, one line,
    nothing written, before any trace (the reported GPU is a stand-in: the check reads only its facts)."""
    import jaxpar.train as T

    monkeypatch.setattr(T, "current_accelerator", lambda: H100)
    out = tmp_path / "run"
    rc = cli.main(["train", "model=gpt2-tiny", "model.n_embd=96", "model.n_head=8", "precision=bf16",
                   "model.attention=cudnn", "train.steps=1", f"out={out}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == ("error: model.attention=cudnn refuses head dim 12: cuDNN flash attention takes a multiple of 8, "
                   "at most 256 on compute capability 9.0 (model.n_embd=96 / model.n_head=8); "
                   "use model.attention=auto or xla\n")
    assert not out.exists()
