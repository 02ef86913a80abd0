"""torchref AMP computes its matmuls in the configured autocast dtype (`amp.dtype=bf16|fp16`).

Reference: the configuration itself (bf16 -> torch.bfloat16, fp16 -> torch.float16, fp32
strategies -> torch.float32), read from the output dtype of every HF Conv1D (the GPT-2 matmuls)
during a forward pass under the strategy's `Context.amp_context()`; the loss stays fp32, and only
fp16 gets a GradScaler. A loss bound alone cannot tell bf16 from fp16 autocast.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from gpt2common import data as data_lib

    d = tmp_path_factory.mktemp("amp") / "data"
    data_lib.prepare(data_lib.builtin_text()[:20_000], str(d), "byte", source="tinyshakespeare[:20000]")
    return str(d)


def matmul_dtypes(prepared, tmp_path, *args):
    """(Conv1D output dtypes, loss dtype, GradScaler or None) of one forward under `args`."""
    from transformers.pytorch_utils import Conv1D

    from gpt2common import hf
    from torchref.config import resolve_ref
    from torchref.model import build_model, loss_fn
    from torchref.runtime import Context, Job

    cfg, ref = resolve_ref(["model=gpt2-tiny", "train.seq_len=16", "train.batch_size=2", *args])
    threads = torch.get_num_threads()
    ctx = Context(Job(cfg, ref, prepared, "", str(tmp_path)), rank=0, world=1)
    torch.set_num_threads(threads)  # a worker's setting; keep this test process's own
    model = build_model(hf.hf_config_dict(cfg.model))
    seen = []
    for m in model.modules():
        if isinstance(m, Conv1D):
            m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    x, y = ctx.shard(0, 0, 1)
    with ctx.amp_context():
        loss = loss_fn(model, x, y)
    assert len(seen) == 4 * cfg.model.n_layer  # c_attn, attn c_proj, c_fc, mlp c_proj per block
    return set(seen), loss.dtype, ctx.grad_scaler()


@pytest.mark.parametrize("args, want", [
    (["strategy=distributed-ps-amp", "workers=2"], torch.bfloat16),  # amp.dtype defaults to bf16
    (["strategy=horovod-amp", "workers=2", "amp.dtype=bf16"], torch.bfloat16),
    (["strategy=distributed-ps-amp", "workers=2", "amp.dtype=fp16"], torch.float16),
    (["strategy=distributed-ps", "workers=2"], torch.float32),
])
def test_autocast_dtype_is_the_configured_one(prepared, tmp_path, args, want):
    """Reference: the configured dtype (module docstring)."""
    dtypes, loss_dtype, scaler = matmul_dtypes(prepared, tmp_path, *args)
    assert dtypes == {want}
    assert loss_dtype == torch.float32  # logits upcast, fp32 cross-entropy
    assert (scaler is not None) == (want == torch.float16)
